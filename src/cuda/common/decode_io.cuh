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

template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = ptx::pack2<T>(a, b);
}

// Writes this thread's 2 * NTiles columns of output row (s, h) of request `req`. vals(n) gives
// the unnormalised pair of n8 tile n; m (log2 domain) and l are the row's running max and sum.
template <int NTiles, typename OutT, typename Vals>
__device__ __forceinline__ void store_row(const DecodeOutput& o, const DecodeSplit& split, int b, int s_q, int h_q,
                                          int req, bool is_split, int split_index, int s, int h, int col_base, int t4,
                                          const Vals& vals, float m, float l, float v_scale, float sink,
                                          bool write_stats) {
  if (is_split) {
    // Split rows live in [0, b + num_sm_parts); a foreign plan must not write outside them.
    if (split_index < 0 || split_index >= b + split.num_sm_parts) return;
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
    OutT* dst = static_cast<OutT*>(o.out) + req * o.out_stride_b + s * o.out_stride_s + h * o.out_stride_h +
                col_base + 2 * t4;
#pragma unroll
    for (int n = 0; n < NTiles; ++n) {
      const float2 v = vals(n);
      store_pair(dst + n * 8, v.x * scale, v.y * scale);
    }
    if (write_stats)
      o.lse[req * o.lse_stride_b + s * o.lse_stride_s + h * o.lse_stride_h] =
          l > 0.f ? (log2f(l) + m) * kLn2 : INFINITY;
  }
}

}  // namespace mla::cuda::decode_io
