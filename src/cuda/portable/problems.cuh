// The Problem policies of the portable attention kernel: where query rows and keys come from,
// which keys each row may see, and where results go. Dense decode (BF16/FP16/FP8 paged caches),
// sparse decode (FP8 V3.2 / MODEL1 caches with an optional extra cache) and sparse prefill.
#pragma once

#include <cuda_fp8.h>

#include <climits>
#include <type_traits>

#include "../common/decode_io.cuh"
#include "../common/fp8.cuh"
#include "attention.cuh"
#include "mla/sparse_slots.h"

namespace mla::cuda::portable {

namespace detail {

using fp8::convert8;
using fp8::dequant16;
using fp8::load16_align8;
using fp8::ue8m0;

// Work items of a decode part: its plan pieces, in stages of kStageKeys keys.
__device__ __forceinline__ int decode_items(const DecodeSplit& split, int b, int part) {
  return decode_io::num_pieces(split, b, part);
}
__device__ __forceinline__ WorkItem decode_item(const DecodeSplit& split, const DecodePlanParams& plan, int part,
                                                int k) {
  const PlanPiece pc = decode_io::piece(split, plan, part, k);
  constexpr int kStagesPerBlock = kPlanBlockSize / kStageKeys;
  return {pc.req, pc.block_begin * kStagesPerBlock, pc.block_end * kStagesPerBlock, pc.is_split, pc.split_index};
}

template <typename OutT>
__device__ __forceinline__ void store_decode_row(const DecodeOutput& o, const DecodeSplit& split, int b, int s_q, int h_q,
                                                 const WorkItem& item, int s, int h, int col_base, int t4,
                                                 const float* vals, float m, float l, float v_scale, float sink,
                                                 bool write_stats) {
  decode_io::store_row<kNTilesO, OutT>(o, split, b, s_q, h_q, item.req, item.is_split, item.split_index, s, h,
                                       col_base, t4, [&](int n) { return make_float2(vals[2 * n], vals[2 * n + 1]); },
                                       m, l, v_scale, sink, write_stats);
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
    return dense_plan_params(p);
  }
  __device__ int num_items(int part) const { return detail::decode_items(p.split, p.b, part); }
  __device__ WorkItem item(int part, int k) const {
    const DecodePlanParams pp = plan();
    WorkItem it = detail::decode_item(p.split, pp, part, k);
    // The last plan block of a request may hold fewer than 64 keys: drop stages past its end.
    const int stages = ceil_div(dense_len(pp, it.req), kStageKeys);
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
    return r / hpg + dense_len(plan(), i) - p.s_q;
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

  static constexpr int kElemsPer16B = 16 / sizeof(CacheT);
  static constexpr int kChunks = D / kElemsPer16B;  // 16-byte pieces of a key row
  // Eight threads per key (one block-table lookup each); thread e of a key copies pieces
  // e, e + 8, e + 16, ... so the eight read 128 contiguous bytes per instruction.
  static constexpr int kIters = (kChunks + kKeyLanes - 1) / kKeyLanes;
  struct Prefetch {
    uint4 raw[kFp8 ? kIters : 1];  // FP8 rows in flight (BF16/FP16 go through cp.async)
  };

  // Issues the loads of one stage: 32 tokens of request item.req, KV head blockIdx.y.
  __device__ void fetch(const WorkItem& item, int stage, Prefetch& f, MmaT (*k)[D + kPad], uint8_t* valid,
                        int* pos) const {
    const int i = item.req, len = dense_len(plan(), i);
    const int key = threadIdx.x / kKeyLanes, lane = threadIdx.x % kKeyLanes;
    const int t = stage * kStageKeys + key;
    // The token's page, or none past the sequence or for a block-table entry outside the cache.
    const int page_idx = t / p.page_block_size;
    int64_t page = -1;
    if (t < len && page_idx < p.max_blocks_per_seq) {
      page = p.block_table[i * p.block_table_stride + page_idx];
      if (page < 0 || page >= p.num_blocks) page = -1;
    }
    if (lane == 0) {
      valid[key] = page >= 0;
      pos[key] = t;
    }
    const auto* cache = static_cast<const CacheT*>(p.k_cache);
    const CacheT* row = page < 0 ? cache
                                 : cache + page * p.k_stride_block +
                                       int64_t(t - page_idx * p.page_block_size) * p.k_stride_token +
                                       int64_t(blockIdx.y) * p.k_stride_head;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int chunk = j * kKeyLanes + lane;
      if (chunk >= kChunks) break;
      const int col = chunk * kElemsPer16B;
      if constexpr (kFp8) {
        f.raw[j] = page >= 0 ? __ldg(reinterpret_cast<const uint4*>(row + col)) : make_uint4(0, 0, 0, 0);
      } else {
        ptx::cp_async_16(&k[key][col], row + (page >= 0 ? col : 0), page >= 0);
      }
    }
  }

  // FP8: the prefetched bytes, widened to bf16 (exact), into the stage buffer.
  __device__ void commit(const Prefetch& f, MmaT (*k)[D + kPad]) const {
    if constexpr (kFp8) {
      const int key = threadIdx.x / kKeyLanes, lane = threadIdx.x % kKeyLanes;
#pragma unroll
      for (int j = 0; j < kIters; ++j) {
        const int chunk = j * kKeyLanes + lane;
        if (chunk < kChunks) detail::dequant16(f.raw[j], 1.f, &k[key][chunk * kElemsPer16B]);
      }
    }
  }

  __device__ void store_row(const WorkItem& item, int group, int r, int col_base, int t4, const float* vals, float m,
                            float l, bool write_stats) const {
    const int s = r / hpg, h = group * hpg + r % hpg;
    // FP8: V is k * descale_k; the scores already carry both descales.
    detail::store_decode_row<OutT>(p.o, p.split, p.b, p.s_q, p.h_q, item, s, h, col_base, t4, vals, m, l,
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
    return sparse_plan_params(p);
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

  // Eight threads per slot. NoPE: 16-dim chunk c (16 e4m3 bytes) goes to thread c % 8, so the
  // eight read 128 contiguous bytes per load, and every chunk lies inside one scale tile (V3.2: 128
  // dims, MODEL1: 64 dims). RoPE: 64 bf16 = 8 pieces of 16 bytes, one per thread. MODEL1 page
  // blocks are 584 * page_block_size bytes, so its records are only 8-byte aligned in general and
  // are read with 8-byte loads.
  static constexpr bool kV32 = F == KvFormat::kV32;
  static constexpr int kNope = kV32 ? 512 : 448;
  static constexpr int kNopeChunks = kNope / 16;                              // 32 / 28
  static constexpr int kNopeIters = (kNopeChunks + kKeyLanes - 1) / kKeyLanes;  // 4
  static constexpr int kRecordBytes = kV32 ? 656 : 576;
  static constexpr int kRopeOffset = kV32 ? 528 : 448;  // bytes into the record
  static_assert(kKeyLanes * 16 == 128, "one 16-byte RoPE piece per thread");
  struct Prefetch {
    bool ok;
    uint4 nope[kNopeIters];
    uint4 rope;
    uint4 scales;  // V3.2: the four float32 tile scales; MODEL1: the 8-byte scale record in .x/.y
  };

  __device__ void fetch(const WorkItem& item, int stage, Prefetch& f, MmaT (*)[kHeadDim + kPad], uint8_t* valid,
                        int* pos) const {
    constexpr int kStagesPerBlock = kPlanBlockSize / kStageKeys;
    const SparseBlockSlots src = sparse_block_slots(p, plan(), item.req, blockIdx.y, stage / kStagesPerBlock);
    const SparseKvCache& cache = *src.cache;
    const int slot_local = threadIdx.x / kKeyLanes, lane = threadIdx.x % kKeyLanes;
    const int slot = src.slot0 + (stage % kStagesPerBlock) * kStageKeys + slot_local;
    const int64_t tok = slot < src.len ? src.indices[slot] : -1;  // slots past the length are never read
    f.ok = sparse_token_in_cache(cache, tok);
    if (lane == 0) {
      valid[slot_local] = f.ok;
      pos[slot_local] = slot;
    }
    if (!f.ok) return;
    const uint8_t* block = cache.data + (tok / cache.page_block_size) * cache.stride_block;
    const int off = int(tok % cache.page_block_size);
    const uint8_t* rec = block + int64_t(off) * kRecordBytes;
#pragma unroll
    for (int j = 0; j < kNopeIters; ++j) {
      const int chunk = j * kKeyLanes + lane;
      if (chunk >= kNopeChunks) break;
      const uint8_t* src = rec + chunk * 16;
      f.nope[j] = kV32 ? __ldg(reinterpret_cast<const uint4*>(src)) : detail::load16_align8(src);
    }
    const uint8_t* rope = rec + kRopeOffset + lane * 16;
    f.rope = kV32 ? __ldg(reinterpret_cast<const uint4*>(rope)) : detail::load16_align8(rope);
    if constexpr (kV32) {
      f.scales = __ldg(reinterpret_cast<const uint4*>(rec + 512));
    } else {
      const uint2 e = __ldg(reinterpret_cast<const uint2*>(block + int64_t(cache.page_block_size) * 576 + int64_t(off) * 8));
      f.scales = make_uint4(e.x, e.y, 0, 0);
    }
  }

  __device__ void commit(const Prefetch& f, MmaT (*k)[kHeadDim + kPad]) const {
    const int slot_local = threadIdx.x / kKeyLanes, lane = threadIdx.x % kKeyLanes;
    MmaT* row = k[slot_local];
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < kNopeIters; ++j) {
      const int chunk = j * kKeyLanes + lane;
      if (chunk >= kNopeChunks) break;
      const int d = chunk * 16;
      if (f.ok) {
        float scale;
        if constexpr (kV32) {
          const uint32_t bits[4] = {f.scales.x, f.scales.y, f.scales.z, f.scales.w};
          scale = __uint_as_float(bits[j]);  // chunk j * 8 + lane lies in tile j
        } else {
          const int tile = d / 64;
          scale = detail::ue8m0(uint8_t((tile < 4 ? f.scales.x >> (8 * tile) : f.scales.y >> (8 * (tile - 4))) & 0xff));
        }
        detail::dequant16(f.nope[j], scale, row + d);
      } else {
        *reinterpret_cast<uint4*>(row + d) = zero;
        *reinterpret_cast<uint4*>(row + d + 8) = zero;
      }
    }
    *reinterpret_cast<uint4*>(row + kNope + lane * 8) = f.ok ? f.rope : zero;
  }

  __device__ void store_row(const WorkItem& item, int s, int h, int col_base, int t4, const float* vals, float m,
                            float l, bool write_stats) const {
    const float sink = p.attn_sink ? p.attn_sink[h] : -INFINITY;
    detail::store_decode_row<OutT>(p.o, p.split, p.b, p.s_q, p.h_q, item, s, h, col_base, t4, vals, m, l, 1.f, sink,
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

  static constexpr int kChunks = D / 8;  // 16-byte pieces of a key row
  static constexpr int kIters = kChunks / kKeyLanes;  // eight threads per key, as in DenseProblem
  static_assert(kChunks % kKeyLanes == 0, "eight threads per key, whole pieces each");
  struct Prefetch {};

  __device__ void fetch(const WorkItem& item, int stage, Prefetch&, MmaT (*k)[D + kPad], uint8_t* valid,
                        int* pos) const {
    const int s = item.req, len = length(s);
    const int key = threadIdx.x / kKeyLanes, lane = threadIdx.x % kKeyLanes;
    const int slot = stage * kStageKeys + key;
    const int tok = slot < len ? p.indices[s * p.indices_stride_s + slot] : -1;
    const bool ok = tok >= 0 && tok < p.s_kv;
    if (lane == 0) {
      valid[key] = ok;
      pos[key] = slot;
    }
    const auto* kv = reinterpret_cast<const __nv_bfloat16*>(p.kv);
    const __nv_bfloat16* row = ok ? kv + int64_t(tok) * p.kv_stride_s : kv;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int col = (j * kKeyLanes + lane) * 8;
      ptx::cp_async_16(&k[key][col], row + (ok ? col : 0), ok);
    }
  }

  __device__ void commit(const Prefetch&, MmaT (*)[D + kPad]) const {}

  __device__ void store_row(const WorkItem& item, int, int h, int col_base, int t4, const float* vals, float m,
                            float l, bool write_stats) const {
    const int s = item.req;
    const float sink = p.attn_sink ? p.attn_sink[h] : -INFINITY;
    const float scale = l > 0.f ? 1.f / (l + exp2f(sink * kLog2e - m)) : 0.f;
    auto* dst = reinterpret_cast<__nv_bfloat16*>(p.out) + (int64_t(s) * p.h_q + h) * kHeadDimV + col_base + 2 * t4;
#pragma unroll
    for (int n = 0; n < kNTilesO; ++n) decode_io::store_pair(dst + n * 8, vals[2 * n] * scale, vals[2 * n + 1] * scale);
    if (write_stats) {
      const float unit = p.log2_stats ? 1.f : kLn2;
      const int64_t row = int64_t(s) * p.h_q + h;
      p.max_logits[row] = m == -INFINITY ? -INFINITY : m * unit;
      p.lse[row] = l > 0.f ? (log2f(l) + m) * unit : INFINITY;
    }
  }
};

}  // namespace mla::cuda::portable
