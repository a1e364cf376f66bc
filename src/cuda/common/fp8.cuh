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

}  // namespace mla::cuda::fp8
