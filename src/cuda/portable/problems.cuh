// The Problem policies of the portable attention kernel: where query rows and keys come from,
// which keys each row may see, and where results go. Dense decode (BF16/FP16/FP8 paged caches),
// sparse decode (FP8 V3.2 / MODEL1 caches with an optional extra cache) and sparse prefill.
#pragma once

#include <cuda_fp8.h>

#include <climits>
#include <type_traits>

#include "attention.cuh"

namespace mla::cuda::portable {

namespace detail {

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

template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = ptx::pack2<T>(a, b);
}

__device__ __forceinline__ PlanRow load_row(const int32_t* tsm, int part) {
  return reinterpret_cast<const PlanRow*>(tsm)[part];
}

// Work items of a decode part: the pieces of its plan row, each a range of 64-key plan blocks.
__device__ __forceinline__ int decode_items(const DecodeSplit& split, int b, int part) {
  const PlanRow row = load_row(split.tile_scheduler_metadata, part);
  if (row.begin_req >= b || row.end_req < row.begin_req) return 0;
  return row.end_req - row.begin_req + 1;
}
__device__ __forceinline__ WorkItem decode_item(const DecodeSplit& split, const DecodePlanParams& plan, int part,
                                                int k) {
  const PlanRow row = load_row(split.tile_scheduler_metadata, part);
  const PlanPiece pc = plan_piece(row, split.num_splits, k, request_blocks(plan, row.begin_req + k));
  constexpr int kStagesPerBlock = kPlanBlockSize / kStageKeys;
  return {pc.req, pc.block_begin * kStagesPerBlock, pc.block_end * kStagesPerBlock, pc.is_split, pc.split_index};
}

// Writes one output row (this thread's 32 columns) of a decode piece.
template <typename OutT>
__device__ __forceinline__ void store_decode_row(const DecodeOutput& o, const DecodeSplit& split, int s_q, int h_q,
                                                 const WorkItem& item, int s, int h, int col_base, int t4,
                                                 const float* vals, float m, float l, float v_scale, float sink,
                                                 bool write_stats) {
  const int i = item.req;
  if (item.is_split) {
    const int64_t row = (int64_t(item.split_index) * s_q + s) * h_q + h;
    const float inv = l > 0.f ? v_scale / l : 0.f;
    float* dst = split.o_accum + row * kHeadDimV + col_base + 2 * t4;
#pragma unroll
    for (int n = 0; n < kNTilesO; ++n)
      *reinterpret_cast<float2*>(dst + n * 8) = make_float2(vals[2 * n] * inv, vals[2 * n + 1] * inv);
    if (write_stats) split.lse_accum[row] = l > 0.f ? log2f(l) + m : -INFINITY;
  } else {
    const float scale = l > 0.f ? v_scale / (l + exp2f(sink * kLog2e - m)) : 0.f;
    OutT* dst = static_cast<OutT*>(o.out) + i * o.out_stride_b + s * o.out_stride_s + h * o.out_stride_h +
                col_base + 2 * t4;
#pragma unroll
    for (int n = 0; n < kNTilesO; ++n) store_pair(dst + n * 8, vals[2 * n] * scale, vals[2 * n + 1] * scale);
    if (write_stats)
      o.lse[i * o.lse_stride_b + s * o.lse_stride_s + h * o.lse_stride_h] =
          l > 0.f ? (log2f(l) + m) * kLn2 : INFINITY;
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Dense decode. Key group = KV head; query rows = s_q x (h_q / h_k) folded, row r -> (r / hpg, r % hpg).

template <typename CacheT, int D>
struct DenseProblem {
  using Params = DenseDecodeParams;
  using MmaT = std::conditional_t<std::is_same_v<CacheT, __half>, __half, __nv_bfloat16>;
  using OutT = MmaT;
  static constexpr int kHeadDim = D;
  static constexpr bool kFp8 = std::is_same_v<CacheT, __nv_fp8_e4m3>;

  const Params& p;
  int hpg;

  __device__ explicit DenseProblem(const Params& params) : p(params), hpg(params.h_q / params.h_k) {}

  __device__ void coords(int& m_tile, int& group, int& part) const {
    m_tile = blockIdx.x, group = blockIdx.y, part = blockIdx.z;
  }
  __device__ int rows() const { return p.s_q * hpg; }
  __device__ DecodePlanParams plan() const {
    DecodePlanParams pp;
    pp.b = p.b;
    pp.seqlens_k = p.seqlens_k;
    return pp;
  }
  __device__ int num_items(int part) const { return detail::decode_items(p.split, p.b, part); }
  __device__ WorkItem item(int part, int k) const {
    WorkItem it = detail::decode_item(p.split, plan(), part, k);
    // The last plan block of a request may hold fewer than 64 keys: drop stages past its end.
    const int stages = ceil_div(max(p.seqlens_k[it.req], 0), kStageKeys);
    it.stage_end = min(it.stage_end, stages);
    it.stage_begin = min(it.stage_begin, it.stage_end);
    return it;
  }
  __device__ float descale(const float* d, int i) const {
    if constexpr (kFp8) return p.descale_per_request ? d[i] : d[0];
    return 1.f;
  }
  __device__ float score_scale(int i) const {
    return p.softmax_scale * kLog2e * descale(p.descale_q, i) * descale(p.descale_k, i);
  }
  __device__ int row_key_limit(int i, int, int r) const {
    if (!p.causal || p.s_q == 1) return INT_MAX;
    return r / hpg + p.seqlens_k[i] - p.s_q;
  }

  __device__ void load_q8(int i, int group, int r, int col, bool live, MmaT* dst) const {
    if (!live) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      return;
    }
    const int s = r / hpg, h = group * hpg + r % hpg;
    const auto* src = static_cast<const CacheT*>(p.q) + i * p.q_stride_b + s * p.q_stride_s + h * p.q_stride_h + col;
    detail::convert8<MmaT>(src, dst);
  }

  __device__ void load_stage(const WorkItem& item, int stage, MmaT (*k)[D + kPad], uint8_t* valid, int* pos) const {
    const int i = item.req, len = p.seqlens_k[i], t0 = stage * kStageKeys;
    const int group = blockIdx.y;
    // Page of token t, or -1 past the sequence or for a block-table entry outside the cache.
    auto page_of = [&](int t) -> int64_t {
      if (t >= len || t / p.page_block_size >= p.max_blocks_per_seq) return -1;
      const int64_t page = p.block_table[i * p.block_table_stride + t / p.page_block_size];
      return page >= 0 && page < p.num_blocks ? page : -1;
    };
    if (threadIdx.x < kStageKeys) {
      valid[threadIdx.x] = page_of(t0 + int(threadIdx.x)) >= 0;
      pos[threadIdx.x] = t0 + int(threadIdx.x);
    }
    const auto* cache = static_cast<const CacheT*>(p.k_cache);
    constexpr int kElemsPer16B = 16 / sizeof(CacheT);
    constexpr int kChunks = D / kElemsPer16B;
    for (int c = threadIdx.x; c < kStageKeys * kChunks; c += kThreads) {
      const int key = c / kChunks, col = (c % kChunks) * kElemsPer16B;
      const int t = t0 + key;
      const int64_t page = page_of(t);
      const bool ok = page >= 0;
      const CacheT* src = cache;
      if (ok) {
        src = cache + page * p.k_stride_block + int64_t(t % p.page_block_size) * p.k_stride_token +
              int64_t(group) * p.k_stride_head + col;
      }
      if constexpr (kFp8) {
        const uint4 raw = ok ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
        detail::dequant16(raw, 1.f, &k[key][col]);
      } else {
        ptx::cp_async_16(&k[key][col], src, ok);
      }
    }
  }

  __device__ void store_row(const WorkItem& item, int group, int r, int col_base, int t4, const float* vals, float m,
                            float l, bool write_stats) const {
    const int s = r / hpg, h = group * hpg + r % hpg;
    // FP8: V is k * descale_k; the scores already carry both descales.
    detail::store_decode_row<OutT>(p.o, p.split, p.s_q, p.h_q, item, s, h, col_base, t4, vals, m, l,
                                   descale(p.descale_k, item.req), -INFINITY, write_stats);
  }
};

// ---------------------------------------------------------------------------------------------
// Sparse decode over FP8 caches. Key group = query row s (each has its own indices); rows = heads.

template <KvFormat F>
struct SparseProblem {
  using Params = SparseDecodeParams;
  using MmaT = __nv_bfloat16;
  using OutT = __nv_bfloat16;
  static constexpr int kHeadDim = F == KvFormat::kV32 ? 576 : 512;

  const Params& p;

  __device__ explicit SparseProblem(const Params& params) : p(params) {}

  __device__ void coords(int& m_tile, int& group, int& part) const {
    m_tile = blockIdx.x, group = blockIdx.y, part = blockIdx.z;
  }
  __device__ int rows() const { return p.h_q; }
  __device__ DecodePlanParams plan() const {
    DecodePlanParams pp;
    pp.b = p.b;
    pp.topk = p.topk;
    pp.topk_length = p.topk_length;
    pp.extra_topk = p.extra_kv.data ? p.extra_topk : 0;
    pp.extra_topk_length = p.extra_kv.data ? p.extra_topk_length : nullptr;
    return pp;
  }
  __device__ int num_items(int part) const { return detail::decode_items(p.split, p.b, part); }
  __device__ WorkItem item(int part, int k) const { return detail::decode_item(p.split, plan(), part, k); }
  __device__ float score_scale(int) const { return p.softmax_scale * kLog2e; }
  __device__ int row_key_limit(int, int, int) const { return INT_MAX; }

  __device__ void load_q8(int i, int s, int h, int col, bool live, MmaT* dst) const {
    if (!live) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      return;
    }
    const auto* src = reinterpret_cast<const __nv_bfloat16*>(p.q) + i * p.q_stride_b + s * p.q_stride_s +
                      h * p.q_stride_h + col;
    detail::convert8<MmaT>(src, dst);
  }

  // Four threads per slot; each dequantises a quarter of the token into the stage buffer.
  __device__ void load_stage(const WorkItem& item, int stage, MmaT (*k)[kHeadDim + kPad], uint8_t* valid,
                             int* pos) const {
    constexpr int kStagesPerBlock = kPlanBlockSize / kStageKeys;
    static_assert(kThreads == 4 * kStageKeys, "four threads per slot");
    const int i = item.req, s = blockIdx.y;
    const DecodePlanParams pp = plan();
    const int blk = stage / kStagesPerBlock, main_blocks = sparse_main_blocks(pp, i);
    const bool is_main = blk < main_blocks;
    const SparseKvCache& cache = is_main ? p.kv : p.extra_kv;
    const int slots = is_main ? p.topk : p.extra_topk;
    const int len = is_main ? sparse_main_len(pp, i) : sparse_extra_len(pp, i);
    const int32_t* idx = is_main ? p.indices + i * p.indices_stride_b + s * p.indices_stride_s
                                 : p.extra_indices + i * p.extra_indices_stride_b + s * p.extra_indices_stride_s;
    const int slot_local = threadIdx.x / 4, quarter = threadIdx.x % 4;
    const int slot = ((is_main ? blk : blk - main_blocks) * kStagesPerBlock + stage % kStagesPerBlock) * kStageKeys +
                     slot_local;
    const int64_t tok = slot < slots ? idx[slot] : -1;
    const bool ok = slot < len && tok >= 0 && tok < int64_t(cache.num_blocks) * cache.page_block_size;
    if (quarter == 0) {
      valid[slot_local] = ok;
      pos[slot_local] = slot;
    }
    MmaT* row = k[slot_local];
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const uint8_t* block = ok ? cache.data + (tok / cache.page_block_size) * cache.stride_block : nullptr;
    const int off = ok ? int(tok % cache.page_block_size) : 0;
    if constexpr (F == KvFormat::kV32) {
      // Quarter q: NoPE dims [128q, 128q + 128) (exactly one scale tile) and RoPE dims 512 + [16q, 16q + 16).
      const uint8_t* rec = ok ? block + int64_t(off) * 656 : nullptr;
      const float scale = ok ? *reinterpret_cast<const float*>(rec + 512 + 4 * quarter) : 0.f;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int d = quarter * 128 + c * 16;
        if (ok) {
          detail::dequant16(__ldg(reinterpret_cast<const uint4*>(rec + d)), scale, row + d);
        } else {
          *reinterpret_cast<uint4*>(row + d) = zero;
          *reinterpret_cast<uint4*>(row + d + 8) = zero;
        }
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int d = 512 + quarter * 16 + c * 8;
        *reinterpret_cast<uint4*>(row + d) =
            ok ? __ldg(reinterpret_cast<const uint4*>(rec + 528 + (d - 512) * 2)) : zero;
      }
    } else {
      // Quarter q: NoPE dims [112q, 112q + 112) (seven 16-dim chunks, each inside one 64-dim tile)
      // and RoPE dims 448 + [16q, 16q + 16). A page block is 584 * page_block_size bytes, so records
      // are only 8-byte aligned in general: 8-byte loads.
      const uint8_t* rec = ok ? block + int64_t(off) * 576 : nullptr;
      const uint8_t* scales = ok ? block + int64_t(cache.page_block_size) * 576 + int64_t(off) * 8 : nullptr;
#pragma unroll
      for (int c = 0; c < 7; ++c) {
        const int d = quarter * 112 + c * 16;
        if (ok) {
          detail::dequant16(detail::load16_align8(rec + d), detail::ue8m0(scales[d / 64]), row + d);
        } else {
          *reinterpret_cast<uint4*>(row + d) = zero;
          *reinterpret_cast<uint4*>(row + d + 8) = zero;
        }
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int d = 448 + quarter * 16 + c * 8;
        *reinterpret_cast<uint4*>(row + d) = ok ? detail::load16_align8(rec + 448 + (d - 448) * 2) : zero;
      }
    }
  }

  __device__ void store_row(const WorkItem& item, int s, int h, int col_base, int t4, const float* vals, float m,
                            float l, bool write_stats) const {
    const float sink = p.attn_sink ? p.attn_sink[h] : -INFINITY;
    detail::store_decode_row<OutT>(p.o, p.split, p.s_q, p.h_q, item, s, h, col_base, t4, vals, m, l, 1.f, sink,
                                   write_stats);
  }
};

// ---------------------------------------------------------------------------------------------
// Sparse prefill over a BF16 KV. Key group = query row s; rows = heads; one work item per CTA.

template <int D>
struct PrefillProblem {
  using Params = SparsePrefillParams;
  using MmaT = __nv_bfloat16;
  static constexpr int kHeadDim = D;

  const Params& p;
  int m_tiles;

  __device__ explicit PrefillProblem(const Params& params) : p(params), m_tiles(ceil_div(params.h_q, kRows)) {}

  __device__ void coords(int& m_tile, int& group, int& part) const {
    m_tile = int(blockIdx.x % m_tiles), group = int(blockIdx.x / m_tiles), part = 0;
  }
  __device__ int rows() const { return p.h_q; }
  __device__ int length(int s) const { return p.topk_length ? clamp_len(p.topk_length[s], p.topk) : p.topk; }
  __device__ int num_items(int) const { return 1; }
  __device__ WorkItem item(int, int) const {
    const int s = int(blockIdx.x / m_tiles);
    return {s, 0, ceil_div(length(s), kStageKeys), false, 0};
  }
  __device__ float score_scale(int) const { return p.softmax_scale * kLog2e; }
  __device__ int row_key_limit(int, int, int) const { return INT_MAX; }

  __device__ void load_q8(int s, int, int h, int col, bool live, MmaT* dst) const {
    if (!live) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      return;
    }
    detail::convert8<MmaT>(reinterpret_cast<const __nv_bfloat16*>(p.q) + s * p.q_stride_s + h * p.q_stride_h + col,
                           dst);
  }

  __device__ void load_stage(const WorkItem& item, int stage, MmaT (*k)[D + kPad], uint8_t* valid, int* pos) const {
    const int s = item.req, len = length(s), slot0 = stage * kStageKeys;
    const int32_t* idx = p.indices + s * p.indices_stride_s;
    auto token = [&](int slot) { return slot < len ? idx[slot] : -1; };
    if (threadIdx.x < kStageKeys) {
      const int tok = token(slot0 + threadIdx.x);
      valid[threadIdx.x] = tok >= 0 && tok < p.s_kv;
      pos[threadIdx.x] = slot0 + threadIdx.x;
    }
    constexpr int kChunks = D / 8;
    const auto* kv = reinterpret_cast<const __nv_bfloat16*>(p.kv);
    for (int c = threadIdx.x; c < kStageKeys * kChunks; c += kThreads) {
      const int key = c / kChunks, col = (c % kChunks) * 8;
      const int tok = token(slot0 + key);
      const bool ok = tok >= 0 && tok < p.s_kv;
      ptx::cp_async_16(&k[key][col], ok ? kv + int64_t(tok) * p.kv_stride_s + col : kv, ok);
    }
  }

  __device__ void store_row(const WorkItem& item, int, int h, int col_base, int t4, const float* vals, float m,
                            float l, bool write_stats) const {
    const int s = item.req;
    const float sink = p.attn_sink ? p.attn_sink[h] : -INFINITY;
    const float scale = l > 0.f ? 1.f / (l + exp2f(sink * kLog2e - m)) : 0.f;
    auto* dst = reinterpret_cast<__nv_bfloat16*>(p.out) + (int64_t(s) * p.h_q + h) * kHeadDimV + col_base + 2 * t4;
#pragma unroll
    for (int n = 0; n < kNTilesO; ++n) detail::store_pair(dst + n * 8, vals[2 * n] * scale, vals[2 * n + 1] * scale);
    if (write_stats) {
      const float unit = p.log2_stats ? 1.f : kLn2;
      const int64_t row = int64_t(s) * p.h_q + h;
      p.max_logits[row] = m == -INFINITY ? -INFINITY : m * unit;
      p.lse[row] = l > 0.f ? (log2f(l) + m) * unit : INFINITY;
    }
  }
};

}  // namespace mla::cuda::portable
