// Steps of the Hopper kernels with 64 query rows (dense) or heads (sparse) as wgmma's M and one
// warpgroup's 256 output columns in registers: P from the S accumulators, the online-softmax
// rescale, and O += P V with V read from four consecutive 64 x 64 key tiles (MN-major).
// Accumulator layout (wgmma m64nN, fp32): warp w, lane (g = lane / 4, t4 = lane % 4) holds rows
// 16 w + g and + 8, columns 8 n + 2 t4 and + 1 of n8 tile n, as v[4 n + 2 (row half) + e].
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../common/ptx.cuh"
#include "ptx_sm90.cuh"

namespace mla::cuda::sm90 {

constexpr int kM64TileBytes = 64 * 128;  // a 64 x 64 tile of 16-bit elements
constexpr int kM64OTiles = 32;           // n8 tiles of a warpgroup's 64 x 256 output

// Byte offset of 16-bit element (r, c) in a tile of 128-byte rows (64 x 64) with the 128-byte swizzle.
__device__ __forceinline__ int swz(int r, int c) { return r * 128 + ((((c >> 3) ^ (r & 7))) << 4) + (c & 7) * 2; }

#if defined(MLA_SM90A_DEVICE)
// Stores warp `warp`'s P (rows 16 warp .. + 15 of a 64 x 64 16-bit tile in the 128-byte swizzle;
// pa as pack_p makes it: pa[kk][e] holds row 16 warp + g + 8 (e % 2), keys 16 kk + 8 (e / 2) + 2 t4
// and + 1) with four stmatrix.x4, one per 16 keys, where sixteen 4-byte stores would each need an
// address. Lane 8 j + i names row i of matrix j: the rows' half j % 2, the keys' half j / 2.
__device__ __forceinline__ void store_p(uint8_t* tile, const uint32_t (&pa)[4][4], int warp, int lane) {
  const int j = lane / 8, row = warp * 16 + (j % 2) * 8 + lane % 8;
  const uint32_t base = smem_addr(tile) + uint32_t(row) * 128u;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint32_t addr = base + (uint32_t((2 * kk + j / 2) ^ (row & 7)) << 4);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(pa[kk][0]),
                 "r"(pa[kk][1]), "r"(pa[kk][2]), "r"(pa[kk][3])
                 : "memory");
  }
}
#endif

template <typename T>
__device__ __forceinline__ float2 unpack(uint32_t v) {
  if constexpr (std::is_same_v<T, __half>) return __half22float2(*reinterpret_cast<const __half2*>(&v));
  else return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

// P (the 64 x 64 fp32 S accumulators after exp2) as the A fragments of four k16 steps of P V: the
// accumulator layout of n8 tiles 2kk and 2kk + 1 is the A layout of k-step kk.
template <typename T>
__device__ __forceinline__ void pack_p(const float (&s)[32], uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) pa[kk][e] = ptx::pack2<T>(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
}

// P = exp2(S scale + bias) for this thread's two rows (S unscaled; bias -m, or -inf for a row whose
// keys in this block are all masked), adding each row's values to sum.
__device__ __forceinline__ void exponentiate_fma(float (&s)[32], float scale, const float (&bias)[2],
                                                 float (&sum)[2]) {
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    const int h = (n % 4) / 2;
    s[n] = exp2_ftz(fmaf(s[n], scale, bias[h]));
    sum[h] += s[n];
  }
}

// P = exp2(S - m) for this thread's two rows (0 where the row max is still -inf: every S of the row
// is -inf then), adding each row's values to sum.
__device__ __forceinline__ void exponentiate(float (&s)[32], const float (&m)[2], float (&sum)[2]) {
  const float bias[2] = {m[0] == -INFINITY ? 0.f : -m[0], m[1] == -INFINITY ? 0.f : -m[1]};
  exponentiate_fma(s, 1.f, bias, sum);  // S * 1 - m in one rounding: S - m exactly
}

// The running max after a block whose max is `block`, moved lazily: only when the block exceeds it
// by more than 2^8 (log2 units), so that most blocks leave it, and with it O and the sums, as they
// are (exp2(S - m) <= 2^8 then, well inside fp32 and the 16-bit P). From -inf it always moves.
__device__ __forceinline__ float lazy_max(float m, float block) {
  constexpr float kSlack = 8.f;
  return block > m + kSlack ? block : m;
}

// Rescales this thread's two rows of a warpgroup's 64 x 256 output: row g by f0, row g + 8 by f1.
__device__ __forceinline__ void scale_rows(float (&o)[128], float f0, float f1) {
#pragma unroll
  for (int n = 0; n < kM64OTiles; ++n) o[4 * n] *= f0, o[4 * n + 1] *= f0, o[4 * n + 2] *= f1, o[4 * n + 3] *= f1;
}

#if defined(MLA_SM90A_DEVICE)

// O (this warpgroup's 256 columns) += P V, P in registers, V = the four tiles from v.
template <typename T>
__device__ __forceinline__ void pv_rs(const uint8_t* v, const uint32_t (&pa)[4][4], float (&o)[128]) {
  wgmma_fence();
  const uint64_t dv = smem_desc(v, kM64TileBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_rs_v<T>(o, pa[kk], desc_offset(dv, kk * 2048), 1);
  wgmma_commit();
}
// The same with P from a shared-memory tile.
template <typename T>
__device__ __forceinline__ void pv_ss(const uint8_t* p_tile, const uint8_t* v, float (&o)[128]) {
  wgmma_fence();
  const uint64_t dp = smem_desc(p_tile, 0, 1024), dv = smem_desc(v, kM64TileBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_ss_v<T>(o, desc_offset(dp, kk * 32), desc_offset(dv, kk * 2048), 1);
  wgmma_commit();
}

#endif  // MLA_SM90A_DEVICE

}  // namespace mla::cuda::sm90
