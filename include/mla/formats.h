// Number formats and KV-cache codecs, byte-exact to SPEC §4 (host side).
//
// Scalar conversions round to nearest even, as PyTorch's casts do, so a cache quantised here is
// byte-identical to one quantised with torch. The codecs read and write one token at a time in
// the paged layouts; whole-cache helpers loop over blocks with explicit strides.
#pragma once

#include <cstdint>
#include <cstring>

#include "mla/types.h"

namespace mla {

// ---------------------------------------------------------------------------------------------
// Scalar conversions
// ---------------------------------------------------------------------------------------------

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Value of `f` after a round trip through bfloat16.
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

float fp16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7f/0xff are NaN;
// largest finite value 448. Conversion is not saturating: |f| > 464 (or inf, NaN) becomes NaN.
float fp8e4m3_to_float(uint8_t b);
uint8_t float_to_fp8e4m3(float f);

// ue8m0 (float8_e8m0fnu): an exponent byte, value 2^(e - 127); 0xff is NaN.
inline float ue8m0_to_float(uint8_t e) {
  if (e == 0xff) return bits_float(0x7fc00000u);
  if (e == 0) return bits_float(0x00400000u);  // 2^-127, a float32 subnormal
  return bits_float(uint32_t(e) << 23);
}

// Reads element `i` of a tensor of type `t` as float.
inline float load_as_float(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFP16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFP8E4M3: return fp8e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kFloat32: return static_cast<const float*>(base)[i];
  }
  return 0.f;
}

// Writes `v` as element `i` of a bf16 or fp16 tensor (round to nearest even).
inline void store_from_float(void* base, int64_t i, DType t, float v) {
  if (t == DType::kFP16) {
    static_cast<uint16_t*>(base)[i] = float_to_fp16(v);
  } else {
    static_cast<uint16_t*>(base)[i] = float_to_bf16(v);
  }
}

// ---------------------------------------------------------------------------------------------
// FP8 sparse KV-cache formats
// ---------------------------------------------------------------------------------------------

struct V32Layout {
  static constexpr int kHeadDim = 576;
  static constexpr int kNope = 512;
  static constexpr int kRope = 64;
  static constexpr int kTile = 128;  // one float32 scale per 128 NoPE dims
  static constexpr int kNumTiles = kNope / kTile;
  static constexpr int kBytesPerToken = kNope + kNumTiles * 4 + kRope * 2;  // 656
  static constexpr int kScaleOffset = kNope;                               // 512
  static constexpr int kRopeOffset = kNope + kNumTiles * 4;                // 528
  static_assert(kBytesPerToken == 656, "V3.2 token record is 656 bytes");
};

struct Model1Layout {
  static constexpr int kHeadDim = 512;
  static constexpr int kNope = 448;
  static constexpr int kRope = 64;
  static constexpr int kTile = 64;  // one ue8m0 scale per 64 NoPE dims
  static constexpr int kNumTiles = kNope / kTile;                     // 7
  static constexpr int kRecordBytes = kNope + kRope * 2;              // 576: NoPE + RoPE of a token
  static constexpr int kScaleRecordBytes = kNumTiles + 1;             // 8: 7 scales + 1 pad byte
  static constexpr int kBytesPerToken = kRecordBytes + kScaleRecordBytes;  // 584
  static_assert(kBytesPerToken == 584, "MODEL1 costs 584 bytes per token");
};

inline int bytes_per_token(KvFormat f) {
  return f == KvFormat::kV32 ? V32Layout::kBytesPerToken : Model1Layout::kBytesPerToken;
}
inline int head_dim_qk(KvFormat f) {
  return f == KvFormat::kV32 ? V32Layout::kHeadDim : Model1Layout::kHeadDim;
}

// Dequantises token `t` of the page block starting at `block` (a block of `page_block_size`
// tokens) into `out[head_dim_qk(f)]`. Every value is rounded to bf16, as the kernels feed bf16 to
// the matrix units: NoPE = bf16(float(e4m3) * scale), RoPE copied.
void dequantize_token(KvFormat f, const uint8_t* block, int page_block_size, int t, float* out);

// Quantises `in[head_dim_qk(f)]` (bf16 bits) into token `t` of the page block at `block`, with the
// reference quantiser: per NoPE tile, scale = 2^ceil(log2(max(amax / 448, 1e-4))), e4m3 = x / scale.
void quantize_token(KvFormat f, const uint16_t* in, uint8_t* block, int page_block_size, int t);

// Scale the reference quantiser picks for a tile whose largest magnitude is `amax`.
float quantization_scale(float amax);

}  // namespace mla
