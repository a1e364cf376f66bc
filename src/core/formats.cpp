#include "mla/formats.h"

#include <algorithm>
#include <cmath>

namespace mla {

float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24
    const float v = float(mant) * bits_float(0x33800000u);
    return bits_float(float_bits(v) | sign);
  }
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t float_to_fp16(float f) {
  uint32_t x = float_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity (>= 65520)
  if (x < 0x38800000u) {
    // Below the smallest normal (2^-14): adding 0.5 aligns the value to the 2^-24 subnormal grid
    // and lets the FPU round to nearest even.
    const float v = std::fabs(f) + 0.5f;
    return sign | uint16_t(float_bits(v) - 0x3f000000u);
  }
  const uint32_t mant_odd = (x >> 13) & 1u;
  x += (uint32_t(15 - 127) << 23) + 0xfffu + mant_odd;
  return sign | uint16_t(x >> 13);
}

float fp8e4m3_to_float(uint8_t b) {
  const bool neg = b & 0x80u;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t mant = b & 0x7u;
  float v;
  if (exp == 0xf && mant == 0x7) {
    v = bits_float(0x7fc00000u);
  } else if (exp == 0) {
    v = float(mant) * 0.001953125f;  // mant * 2^-9
  } else {
    v = bits_float(((exp + 120u) << 23) | (mant << 20));
  }
  return neg ? -v : v;
}

uint8_t float_to_fp8e4m3(float f) {
  uint32_t x = float_bits(f);
  const uint8_t sign = uint8_t((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  uint8_t r;
  if (x >= 0x43f00000u) {  // >= 480, inf or NaN
    r = 0x7f;
  } else if (x < (121u << 23)) {
    // Below the smallest normal (2^-6): adding 2^14 aligns the value to the 2^-9 subnormal grid.
    const float v = bits_float(x) + 16384.0f;
    r = uint8_t(float_bits(v) - float_bits(16384.0f));
  } else {
    const uint32_t mant_odd = (x >> 20) & 1u;
    x += (uint32_t(7 - 127) << 23) + 0x7ffffu + mant_odd;
    r = uint8_t(x >> 20);
  }
  return r | sign;
}

float quantization_scale(float amax) {
  const float s = std::max(amax / 448.0f, 1e-4f);
  // 2^ceil(log2(s)), exactly: frexp gives s = m * 2^e with m in [0.5, 1).
  int e = 0;
  const float m = std::frexp(s, &e);
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

namespace {

// Largest magnitude over n bf16 values.
float tile_amax(const uint16_t* x, int n) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(bf16_to_float(x[i])));
  return amax;
}

}  // namespace

void dequantize_token(KvFormat f, const uint8_t* block, int page_block_size, int t, float* out) {
  if (f == KvFormat::kV32) {
    using L = V32Layout;
    const uint8_t* rec = block + int64_t(t) * L::kBytesPerToken;
    float scales[L::kNumTiles];
    std::memcpy(scales, rec + L::kScaleOffset, sizeof(scales));
    for (int d = 0; d < L::kNope; ++d) out[d] = round_bf16(fp8e4m3_to_float(rec[d]) * scales[d / L::kTile]);
    const uint8_t* rope = rec + L::kRopeOffset;
    for (int r = 0; r < L::kRope; ++r) {
      uint16_t h;
      std::memcpy(&h, rope + 2 * r, 2);
      out[L::kNope + r] = bf16_to_float(h);
    }
  } else {
    using L = Model1Layout;
    const uint8_t* rec = block + int64_t(t) * L::kRecordBytes;
    const uint8_t* sc = block + int64_t(page_block_size) * L::kRecordBytes + int64_t(t) * L::kScaleRecordBytes;
    for (int d = 0; d < L::kNope; ++d) out[d] = round_bf16(fp8e4m3_to_float(rec[d]) * ue8m0_to_float(sc[d / L::kTile]));
    const uint8_t* rope = rec + L::kNope;
    for (int r = 0; r < L::kRope; ++r) {
      uint16_t h;
      std::memcpy(&h, rope + 2 * r, 2);
      out[L::kNope + r] = bf16_to_float(h);
    }
  }
}

void quantize_token(KvFormat f, const uint16_t* in, uint8_t* block, int page_block_size, int t) {
  if (f == KvFormat::kV32) {
    using L = V32Layout;
    uint8_t* rec = block + int64_t(t) * L::kBytesPerToken;
    for (int j = 0; j < L::kNumTiles; ++j) {
      const float s = quantization_scale(tile_amax(in + j * L::kTile, L::kTile));
      std::memcpy(rec + L::kScaleOffset + 4 * j, &s, 4);
      for (int d = j * L::kTile; d < (j + 1) * L::kTile; ++d) rec[d] = float_to_fp8e4m3(bf16_to_float(in[d]) / s);
    }
    std::memcpy(rec + L::kRopeOffset, in + L::kNope, 2 * L::kRope);
  } else {
    using L = Model1Layout;
    uint8_t* rec = block + int64_t(t) * L::kRecordBytes;
    uint8_t* sc = block + int64_t(page_block_size) * L::kRecordBytes + int64_t(t) * L::kScaleRecordBytes;
    for (int j = 0; j < L::kNumTiles; ++j) {
      const float s = quantization_scale(tile_amax(in + j * L::kTile, L::kTile));
      sc[j] = uint8_t(float_bits(s) >> 23);  // power of two, normal: the exponent byte is ue8m0
      for (int d = j * L::kTile; d < (j + 1) * L::kTile; ++d) rec[d] = float_to_fp8e4m3(bf16_to_float(in[d]) / s);
    }
    sc[L::kNumTiles] = 0;  // pad byte
    std::memcpy(rec + L::kNope, in + L::kNope, 2 * L::kRope);
  }
}

}  // namespace mla
