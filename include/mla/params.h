// Plain parameter structs, one per op. Every pointer says its shape; strides are in elements of
// the pointed-to type (bytes for FP8 sparse caches) and the innermost dimension is contiguous.
// The same structs feed the CPU backend and the CUDA kernels.
#pragma once

#include <cstdint>

#include "mla/types.h"

namespace mla {

// The split plan of a decode call (see plan.h) and the fp32 workspace its split pieces write.
struct DecodeSplit {
  int num_sm_parts = 1;
  const int32_t* tile_scheduler_metadata = nullptr;  // [num_sm_parts, 8]
  const int32_t* num_splits = nullptr;               // [b + 1]
  float* o_accum = nullptr;    // [b + num_sm_parts, s_q, h_q, d_v], each partial normalised by its own sum
  float* lse_accum = nullptr;  // [b + num_sm_parts, s_q, h_q], log2 domain: log2(sum) + max; -inf if empty
  // The plan is still to be made (tile_scheduler_metadata and num_splits are outputs): the call
  // plans before it attends, in the attention kernel itself where that kernel can.
  bool plan_fresh = false;
};

// Bytes of split workspace a decode call needs (o_accum then lse_accum, each 256-byte aligned).
inline int64_t decode_workspace_bytes(int b, int s_q, int h_q, int num_sm_parts) {
  const int64_t rows = int64_t(b + num_sm_parts) * s_q * h_q;
  auto align = [](int64_t n) { return (n + 255) / 256 * 256; };
  return align(rows * kHeadDimV * 4) + align(rows * 4);
}

// Output of a decode call.
struct DecodeOutput {
  void* out = nullptr;  // [b, s_q, h_q, d_v], dtype out_dtype
  DType out_dtype = DType::kBF16;
  int64_t out_stride_b = 0, out_stride_s = 0, out_stride_h = 0;
  float* lse = nullptr;  // natural log, +inf for a row with no valid key; indexed [b][s][h] by strides
  int64_t lse_stride_b = 0, lse_stride_s = 0, lse_stride_h = 0;
};

// The combine step of a decode call: merges the partials of every split request into out / lse.
struct CombineParams {
  int b = 0, s_q = 0, h_q = 0, d_v = kHeadDimV;
  DecodeSplit split;
  DecodeOutput o;
  const float* attn_sink = nullptr;  // [h_q] or null
};

// Dense decode over a paged BF16/FP16 cache (fwd_kvcache_mla, dense_decode_fwd) or an FP8 e4m3
// cache with descales (fwd_kvcache_mla_fp8).
struct DenseDecodeParams {
  int b = 0, s_q = 0, h_q = 0, h_k = 0;
  int d_qk = kHeadDimV32, d_v = kHeadDimV;
  int page_block_size = 0, num_blocks = 0, max_blocks_per_seq = 0;
  DType dtype = DType::kBF16;  // of q and k_cache
  float softmax_scale = 0.f;
  bool causal = false;  // bottom-right aligned; ignored when s_q == 1

  const void* q = nullptr;  // [b, s_q, h_q, d_qk]
  int64_t q_stride_b = 0, q_stride_s = 0, q_stride_h = 0;
  const void* k_cache = nullptr;  // [num_blocks, page_block_size, h_k, d_qk]; V = first d_v dims
  int64_t k_stride_block = 0, k_stride_token = 0, k_stride_head = 0;
  const int32_t* block_table = nullptr;  // [b, max_blocks_per_seq]
  int64_t block_table_stride = 0;
  const int32_t* seqlens_k = nullptr;  // [b]

  // FP8 only: scores use softmax_scale * descale_q * descale_k, V is k * descale_k.
  const float* descale_q = nullptr;  // [1] or [b]
  const float* descale_k = nullptr;  // [1] or [b]
  bool descale_per_request = false;

  DecodeOutput o;
  DecodeSplit split;
};

// A paged FP8 sparse cache: [num_blocks, page_block_size, 1, bytes_per_token(format)] bytes.
struct SparseKvCache {
  const uint8_t* data = nullptr;
  int num_blocks = 0;
  int page_block_size = 0;
  int64_t stride_block = 0;  // bytes from one page block to the next (>= page_block_size * bytes/token)
};

// Sparse decode over FP8 caches (sparse_decode_fwd, fwd_kvcache_mla with indices).
struct SparseDecodeParams {
  int b = 0, s_q = 0, h_q = 0;
  int d_qk = kHeadDimV32, d_v = kHeadDimV;
  KvFormat format = KvFormat::kV32;
  float softmax_scale = 0.f;

  const uint16_t* q = nullptr;  // [b, s_q, h_q, d_qk] bf16
  int64_t q_stride_b = 0, q_stride_s = 0, q_stride_h = 0;

  SparseKvCache kv;
  int topk = 0;
  const int32_t* indices = nullptr;  // [b, s_q, topk] flat token indices into kv; invalid if < 0 or out of range
  int64_t indices_stride_b = 0, indices_stride_s = 0;
  const int32_t* topk_length = nullptr;  // [b] or null: slots >= topk_length[b] are ignored

  SparseKvCache extra_kv;  // with extra_indices; neither when there is no extra cache (none of its blocks: run as none)
  int extra_topk = 0;
  const int32_t* extra_indices = nullptr;  // [b, s_q, extra_topk] into extra_kv
  int64_t extra_indices_stride_b = 0, extra_indices_stride_s = 0;
  const int32_t* extra_topk_length = nullptr;  // [b] or null

  const float* attn_sink = nullptr;  // [h_q] or null

  DecodeOutput o;
  DecodeSplit split;
};

// Sparse prefill over a BF16 KV (sparse_prefill_fwd). No batch dimension.
struct SparsePrefillParams {
  int s_q = 0, s_kv = 0, h_q = 0, topk = 0;
  int d_qk = kHeadDimV32, d_v = kHeadDimV;
  float softmax_scale = 0.f;
  bool log2_stats = true;  // max_logits and lse in base 2 (sgl-kernel) or natural log (FlashMLA)

  const uint16_t* q = nullptr;  // [s_q, h_q, d_qk] bf16
  int64_t q_stride_s = 0, q_stride_h = 0;
  const uint16_t* kv = nullptr;  // [s_kv, 1, d_qk] bf16; V = first d_v dims
  int64_t kv_stride_s = 0;
  const int32_t* indices = nullptr;  // [s_q, 1, topk]; invalid if < 0 or >= s_kv
  int64_t indices_stride_s = 0;
  const int32_t* topk_length = nullptr;  // [s_q] or null
  const float* attn_sink = nullptr;      // [h_q] or null

  uint16_t* out = nullptr;  // [s_q, h_q, d_v] bf16, contiguous
  float* max_logits = nullptr;  // [s_q, h_q]; -inf for a row with no valid key
  float* lse = nullptr;         // [s_q, h_q]; +inf for a row with no valid key
};

}  // namespace mla
