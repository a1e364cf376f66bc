// Device helpers for reading FP8 caches: e4m3 (and 16-bit) to 16-bit conversion of 8 elements with
// a scale, the UE8M0 scale decode of MODEL1, and 16-byte loads from 8-byte aligned records.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "ptx.cuh"

namespace mla::cuda::fp8 {

// 8 elements of type Src at `src` as T, written to `dst` (16 bytes).
template <typename T, typename Src>
__device__ __forceinline__ void convert8(const Src* src, T* dst, float scale = 1.f) {
  uint32_t packed[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float lo, hi;
    if constexpr (std::is_same_v<Src, __nv_fp8_e4m3>) {
      lo = float(src[2 * j]) * scale, hi = float(src[2 * j + 1]) * scale;
    } else if constexpr (std::is_same_v<Src, __half>) {
      lo = __half2float(src[2 * j]), hi = __half2float(src[2 * j + 1]);
    } else {
      lo = __bfloat162float(src[2 * j]), hi = __bfloat162float(src[2 * j + 1]);
    }
    packed[j] = ptx::pack2<T>(lo, hi);
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// 16 e4m3 bytes times `scale`, rounded to bf16, written to dst (32 bytes).
__device__ __forceinline__ void dequant16(uint4 raw, float scale, __nv_bfloat16* dst) {
  const auto* b = reinterpret_cast<const __nv_fp8_e4m3*>(&raw);
  convert8<__nv_bfloat16>(b, dst, scale);
  convert8<__nv_bfloat16>(b + 8, dst + 8, scale);
}

// 16 bytes from an 8-byte aligned address.
__device__ __forceinline__ uint4 load16_align8(const uint8_t* p) {
  const uint2 lo = __ldg(reinterpret_cast<const uint2*>(p)), hi = __ldg(reinterpret_cast<const uint2*>(p + 8));
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ float ue8m0(uint8_t e) {
  if (e == 0xff) return __int_as_float(0x7fc00000);
  if (e == 0) return __int_as_float(0x00400000);
  return __int_as_float(int(e) << 23);
}

// 8 e4m3 values (the bytes of `raw`, lowest first) times `scale`, rounded to bf16: two values per
// hardware conversion (e4m3x2 -> f16x2 is exact), the same numbers as convert8.
__device__ __forceinline__ uint4 dequant8_bf16(uint2 raw, float scale) {
  uint32_t out[4];
  const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
  for (int w = 0; w < 2; ++w)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(words[w] >> (16 * h)), __NV_E4M3);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&r));
      out[2 * w + h] = ptx::pack2<__nv_bfloat16>(f.x * scale, f.y * scale);
    }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

}  // namespace mla::cuda::fp8
