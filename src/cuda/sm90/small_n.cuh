// The consumer steps shared by the Hopper kernels that put the query rows (dense) or heads (sparse)
// in wgmma's N dimension (N = 16 or 32) instead of padding them to M = 64: per 64-key block,
//   small_qk:        S^T (64 keys x N) = K Q^T, K a block of 64 x 64 key tiles, Q N x 64 tiles;
//   small_mask_max:  mask S^T, reduce each column's max over the 8 lanes that share it, publish
//                    each warp's maxima (the caller then synchronises the warpgroup);
//   small_softmax:   the block max from the four warps, the running max and rescale factor per
//                    column, P = exp2(S - m) written as P [column][key], O^T rescaled;
//   small_pv:        O^T (512 x N, eight 64-dim tiles) += V^T P^T, V read transposed (MN-major) from
//                    the first eight key tiles;
//   small_row_sums:  the epilogue's per-column sums over lanes and warps;
//   small_store_column: one column of O^T to its output row (out / lse, or a split's partial).
// Accumulator layout (wgmma m64nN, fp32): warp w, lane (g = lane / 4, t4 = lane % 4) holds
// rows (keys or dims) 16 w + g and + 8, columns 8 n + 2 t4 and + 1, as v[4 n + 2 hk + e].
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "mla/params.h"
#include "mla/types.h"
#include "m64.cuh"
#include "ptx_sm90.cuh"

namespace mla::cuda::sm90 {

constexpr int kSmallBlock = 64;                    // keys per block: wgmma M of S^T
constexpr int kSmallTileBytes = kSmallBlock * 128;  // a 64 x 64 tile of 16-bit elements
constexpr int kSmallVTiles = 8;                    // d_v 512: wgmma M tiles of O^T

template <typename T>
__device__ __forceinline__ T small_from_float(float v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else return __float2bfloat16_rn(v);
}

#if defined(MLA_SM90A_DEVICE)

// k_tile(t): the shared-memory address of key tile t (0 <= t < kTiles).
// kWait false: the products are committed as one group and left in flight (the caller waits).
template <typename T, int N, int kTiles, bool kWait = true, typename KTile>
__device__ __forceinline__ void small_qk(const KTile& k_tile, const uint8_t (*q)[N * 128], float (&s)[N / 2]) {
  wgmma_fence();
  const uint64_t dq = smem_desc(q[0], 0, 1024);  // the Q tiles are consecutive
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const uint64_t dk = smem_desc(k_tile(t), 0, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_ss_small<T, N, 0>(s, desc_offset(dk, kk * 32), desc_offset(dq, t * N * 128 + kk * 32), t > 0 || kk > 0);
  }
  wgmma_commit();
  if constexpr (kWait) {
    wgmma_wait<0>();
    fence_regs(s);
  }
}

// A piece's starting state: running maxima -inf, partial sums and O^T zero.
template <int N>
__device__ __forceinline__ void small_start(float (&m_run)[N / 8][2], float (&l_part)[N / 8][2],
                                            float (&o)[kSmallVTiles][N / 2]) {
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) m_run[n][e] = -INFINITY, l_part[n][e] = 0.f;
#pragma unroll
  for (int mt = 0; mt < kSmallVTiles; ++mt)
#pragma unroll
    for (int j = 0; j < N / 2; ++j) o[mt][j] = 0.f;
}

// valid(key, column): whether key (0..63 in the block) counts for column (row or head); `whole`:
// every key counts for every column (no per-key test).
template <int N, typename Valid>
__device__ __forceinline__ void small_mask_max(float (&s)[N / 2], float scale_log2, bool whole, const Valid& valid,
                                               float (*warp_max)[N], int warp, int lane) {
  const int g = lane / 4, t4 = lane % 4, key_lo = warp * 16 + g;
  float mx[N / 8][2];
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float m = -INFINITY;
#pragma unroll
      for (int hk = 0; hk < 2; ++hk) {
        float& v = s[4 * n + 2 * hk + e];
        v = whole || valid(key_lo + 8 * hk, 8 * n + 2 * t4 + e) ? v * scale_log2 : -INFINITY;
        m = fmaxf(m, v);
      }
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      mx[n][e] = m;
    }
  if (g == 0) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) warp_max[warp][8 * n + 2 * t4 + e] = mx[n][e];
  }
}

// key_of(key): the column of P that S^T's row `key` goes to (its key's place in the block).
struct SameKey {
  __device__ int operator()(int key) const { return key; }
};
template <typename T, int N, typename KeyOf = SameKey>
__device__ __forceinline__ void small_softmax(float (&s)[N / 2], const float (*warp_max)[N], float (&m_run)[N / 8][2],
                                              float (&l_part)[N / 8][2], float (&o)[kSmallVTiles][N / 2], uint8_t* p,
                                              int warp, int lane, const KeyOf& key_of = {}) {
  const int g = lane / 4, t4 = lane % 4, key_lo = warp * 16 + g;
  float alpha[N / 8][2];
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = 8 * n + 2 * t4 + e;
      const float blk = fmaxf(fmaxf(warp_max[0][c], warp_max[1][c]), fmaxf(warp_max[2][c], warp_max[3][c]));
      const float m_new = lazy_max(m_run[n][e], blk);
      alpha[n][e] = m_new == m_run[n][e] ? 1.f : exp2_ftz(m_run[n][e] - m_new);
      m_run[n][e] = m_new;
      const float base = m_new == -INFINITY ? 0.f : m_new;  // all of the column's S are -inf then
      float sum = 0.f;
#pragma unroll
      for (int hk = 0; hk < 2; ++hk) {
        float& v = s[4 * n + 2 * hk + e];
        v = exp2_ftz(v - base);
        sum += v;
        *reinterpret_cast<T*>(p + swz(c, key_of(key_lo + 8 * hk))) = small_from_float<T>(v);
      }
      l_part[n][e] = l_part[n][e] * alpha[n][e] + sum;
    }
  bool moved = false;
#pragma unroll
  for (int n = 0; n < N / 8; ++n) moved = moved || alpha[n][0] != 1.f || alpha[n][1] != 1.f;
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int mt = 0; mt < kSmallVTiles; ++mt)
#pragma unroll
      for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int q = 0; q < 4; ++q) o[mt][4 * n + q] *= alpha[n][q % 2];
  }
  // Keep the rescale ahead of the next wgmma fence (else the compiler adds one arrive per chain).
#pragma unroll
  for (int mt = 0; mt < kSmallVTiles; ++mt) fence_regs(o[mt]);
  fence_proxy_async();  // P is read by wgmma next
}

template <typename T, int N, bool kWait = true, typename KTile>
__device__ __forceinline__ void small_pv(const KTile& k_tile, const uint8_t* p, float (&o)[kSmallVTiles][N / 2]) {
  wgmma_fence();
  const uint64_t dp = smem_desc(p, 0, 1024);
#pragma unroll
  for (int mt = 0; mt < kSmallVTiles; ++mt) {
    const uint64_t dv = smem_desc(k_tile(mt), kSmallTileBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_ss_small<T, N, 1>(o[mt], desc_offset(dv, kk * 2048), desc_offset(dp, kk * 32), 1);
  }
  wgmma_commit();
  if constexpr (kWait) {
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < kSmallVTiles; ++mt) fence_regs(o[mt]);
  }
}

// Publishes each warp's column sums (the caller synchronises, then adds the four warps').
template <int N>
__device__ __forceinline__ void small_row_sums(const float (&l_part)[N / 8][2], float (*warp_sum)[N], int warp,
                                               int lane) {
  const int g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_part[n][e];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (g == 0) warp_sum[warp][8 * n + 2 * t4 + e] = l;
    }
}

// Writes column (n, e) of O^T (this thread's 32 values of it: dims 64 mt + key_lo + 8 hk) to output
// row (s, h) of request req: out / lse with the attention sink for whole pieces (sink -inf: none),
// or the fp32 partial of a split for the combine kernel. m (log2 domain) and l are the column's
// running max and sum; write_stats: this thread writes the row's lse.
template <typename T, int N>
__device__ __forceinline__ void small_store_column(const DecodeOutput& out, const DecodeSplit& split, int b, int s_q,
                                                   int h_q, int req, bool is_split, int split_index, int s, int h,
                                                   const float (&o)[kSmallVTiles][N / 2], int n, int e, int key_lo,
                                                   float m, float l, float sink, bool write_stats) {
  if (is_split) {
    // Split rows live in [0, b + num_sm_parts); a foreign plan must not write outside them.
    if (split_index < 0 || split_index >= b + split.num_sm_parts) return;
    const int64_t row = (int64_t(split_index) * s_q + s) * h_q + h;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* dst = split.o_accum + row * kHeadDimV;
#pragma unroll
    for (int mt = 0; mt < kSmallVTiles; ++mt)
#pragma unroll
      for (int hk = 0; hk < 2; ++hk) dst[mt * 64 + key_lo + 8 * hk] = o[mt][4 * n + 2 * hk + e] * inv;
    if (write_stats) split.lse_accum[row] = l > 0.f ? log2f(l) + m : -INFINITY;
  } else {
    const float inv = l > 0.f ? 1.f / (l + exp2f(sink * kLog2e - m)) : 0.f;
    T* dst = static_cast<T*>(out.out) + req * out.out_stride_b + s * out.out_stride_s + h * out.out_stride_h;
#pragma unroll
    for (int mt = 0; mt < kSmallVTiles; ++mt)
#pragma unroll
      for (int hk = 0; hk < 2; ++hk)
        dst[mt * 64 + key_lo + 8 * hk] = small_from_float<T>(o[mt][4 * n + 2 * hk + e] * inv);
    if (write_stats)
      out.lse[req * out.lse_stride_b + s * out.lse_stride_s + h * out.lse_stride_h] =
          l > 0.f ? (log2f(l) + m) * kLn2 : INFINITY;
  }
}

#endif  // MLA_SM90A_DEVICE

}  // namespace mla::cuda::sm90
