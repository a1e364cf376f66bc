// What every decode kernel shares: reading its part's plan row, and writing one output row of a
// piece, either the final out/lse (attention sink applied) or the fp32 partial of a split for the
// combine kernel. Columns follow the mma accumulator layout: thread t of a quad holds columns
// col_base + 8 n + 2 t and + 1 for n in [0, NTiles).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mla/params.h"
#include "mla/plan.h"
#include "ptx.cuh"

namespace mla::cuda::decode_io {

__device__ __forceinline__ PlanRow load_row(const int32_t* tsm, int part) {
  return reinterpret_cast<const PlanRow*>(tsm)[part];
}

// Pieces of a decode part. A row naming requests outside [0, b) (a plan of another batch) is
// clamped: no request of this call is read or written out of range, whatever the metadata holds.
__device__ __forceinline__ int num_pieces(const DecodeSplit& split, int b, int part) {
  const PlanRow row = load_row(split.tile_scheduler_metadata, part);
  if (row.begin_req < 0 || row.begin_req >= b || row.end_req < row.begin_req) return 0;
  return min(row.end_req, b - 1) - row.begin_req + 1;
}
// Piece k of a part: request, range of 64-key plan blocks, split slot.
__device__ __forceinline__ PlanPiece piece(const DecodeSplit& split, const DecodePlanParams& plan, int part, int k) {
  const PlanRow row = load_row(split.tile_scheduler_metadata, part);
  return plan_piece(row, split.num_splits, k, request_blocks(plan, row.begin_req + k));
}

// The merged normaliser (log2 domain) with the attention sink folded in, log2(2^g + 2^sink2): g the
// merged lse (INFINITY where no key counted), sink2 the sink times log2(e) (-INFINITY: none). The
// combine kernel and the small-heads kernel's cluster merge both use it, so that they agree bitwise.
__device__ __forceinline__ float fold_sink(float g, float sink2) {
  return g != INFINITY ? g + log2f(1.f + exp2f(sink2 - g)) : (sink2 == -INFINITY ? INFINITY : sink2);
}

template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = ptx::pack2<T>(a, b);
}

// Whether every row of a [b, s, h, d] tensor of 16-bit elements with these strides (in elements)
// starts 16-byte aligned (the same answer in every thread of a call): Q for the kernels' 16-byte
// copies, out for store_row's 16-byte stores.
__device__ __forceinline__ bool rows_16b_aligned(const void* base, int64_t stride_b, int64_t stride_s,
                                                 int64_t stride_h) {
  return ((reinterpret_cast<uintptr_t>(base) | uintptr_t((stride_b | stride_s | stride_h) * 2)) & 15) == 0;
}

// A 4 x 4 transpose of 32-bit words within each quad of a warp (every lane calls it): lane t's
// word j becomes lane j's word t. Given the packed pairs of four n8 tiles (lane t: columns 8 j + 2 t,
// + 1 of tile j), lane t then holds the eight columns of tile t.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int t4) {
#pragma unroll
  for (int bit = 2; bit >= 1; bit >>= 1) {
    // Swap bit `bit` of (lane, word): each lane gives away the words whose bit differs from its own.
    const bool hi = (t4 & bit) != 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j & bit) continue;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? w[j] : w[j | bit], bit);
      if (hi) w[j] = got;
      else w[j | bit] = got;
    }
  }
}

// Writes this thread's 2 * NTiles columns of output row (s, h) of request `req`. vals(n) gives
// the unnormalised pair of n8 tile n; m (log2 domain) and l are the row's running max and sum.
// kQuadStores: every lane of the warp calls it (a quad per row; `live` false for a row past the
// tile's, which writes nothing), and where out's rows start on 16 bytes each lane stores whole
// tiles with 16-byte stores after a transpose in the quad, so that a warp's store covers whole
// 32-byte sectors (the pairs alone write half sectors, a quarter of the store width).
template <int NTiles, typename OutT, bool kQuadStores = false, typename Vals>
__device__ __forceinline__ void store_row(const DecodeOutput& o, const DecodeSplit& split, int b, int s_q, int h_q,
                                          int req, bool is_split, int split_index, int s, int h, int col_base, int t4,
                                          const Vals& vals, float m, float l, float v_scale, float sink,
                                          bool write_stats, bool live = true) {
  if (is_split) {
    // Split rows live in [0, b + num_sm_parts); a foreign plan must not write outside them.
    if (!live || split_index < 0 || split_index >= b + split.num_sm_parts) return;
    const int64_t row = (int64_t(split_index) * s_q + s) * h_q + h;
    const float inv = l > 0.f ? v_scale / l : 0.f;
    float* dst = split.o_accum + row * kHeadDimV + col_base + 2 * t4;
#pragma unroll
    for (int n = 0; n < NTiles; ++n) {
      const float2 v = vals(n);
      *reinterpret_cast<float2*>(dst + n * 8) = make_float2(v.x * inv, v.y * inv);
    }
    if (write_stats) split.lse_accum[row] = l > 0.f ? log2f(l) + m : -INFINITY;
  } else {
    const float scale = l > 0.f ? v_scale / (l + exp2f(sink * kLog2e - m)) : 0.f;
    OutT* row_out = static_cast<OutT*>(o.out) + req * o.out_stride_b + s * o.out_stride_s + h * o.out_stride_h +
                    col_base;
    static_assert(sizeof(OutT) == 2, "out holds 16-bit elements");
    if (kQuadStores && NTiles % 4 == 0 && rows_16b_aligned(o.out, o.out_stride_b, o.out_stride_s, o.out_stride_h)) {
#pragma unroll
      for (int n0 = 0; n0 < NTiles; n0 += 4) {
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 v = vals(n0 + j);
          w[j] = ptx::pack2<OutT>(v.x * scale, v.y * scale);
        }
        quad_transpose(w, t4);
        if (live) *reinterpret_cast<uint4*>(row_out + (n0 + t4) * 8) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else if (live) {
#pragma unroll
      for (int n = 0; n < NTiles; ++n) {
        const float2 v = vals(n);
        store_pair(row_out + n * 8 + 2 * t4, v.x * scale, v.y * scale);
      }
    }
    if (write_stats && live)
      o.lse[req * o.lse_stride_b + s * o.lse_stride_s + h * o.lse_stride_h] =
          l > 0.f ? (log2f(l) + m) * kLn2 : INFINITY;
  }
}

}  // namespace mla::cuda::decode_io
