// Where the slots of a sparse-decode plan block come from: main slots first (at least one block,
// so an empty request still writes its output), then the extra cache's. Host-and-device code
// shared by the CPU backend and the CUDA kernels.
#pragma once

#include "mla/params.h"
#include "mla/plan.h"

namespace mla {

struct SparseBlockSlots {
  const SparseKvCache* cache;  // the cache the indices point into
  const int32_t* indices;      // the query row's index list (main or extra)
  int slot0;                   // the block's first slot in that list
  int slots;                   // entries in the list (topk or extra_topk)
  int len;                     // valid entries (topk_length / extra_topk_length, clamped)
};

// Request i's lengths as the planner sees them (each read from memory once per request by the
// callers that walk many blocks of it).
struct SparseRequestLens {
  int main_blocks;  // blocks of main slots (at least one); extra-cache blocks follow them
  int main_len;     // valid main entries (topk_length, clamped)
  int extra_len;    // valid extra entries (extra_topk_length, clamped)
};
MLA_HD SparseRequestLens sparse_request_lens(const DecodePlanParams& plan, int i) {
  return {sparse_main_blocks(plan, i), sparse_main_len(plan, i), sparse_extra_len(plan, i)};
}

// Plan block `blk` of request i, query row s, given the request's lengths.
MLA_HD SparseBlockSlots sparse_block_slots(const SparseDecodeParams& p, const SparseRequestLens& lens, int i, int s,
                                           int blk) {
  if (blk < lens.main_blocks)
    return {&p.kv, p.indices + i * p.indices_stride_b + s * p.indices_stride_s, blk * kPlanBlockSize, p.topk,
            lens.main_len};
  return {&p.extra_kv, p.extra_indices + i * p.extra_indices_stride_b + s * p.extra_indices_stride_s,
          (blk - lens.main_blocks) * kPlanBlockSize, p.extra_topk, lens.extra_len};
}
// The same; `plan` is sparse_plan_params(p).
MLA_HD SparseBlockSlots sparse_block_slots(const SparseDecodeParams& p, const DecodePlanParams& plan, int i, int s,
                                           int blk) {
  return sparse_block_slots(p, sparse_request_lens(plan, i), i, s, blk);
}

// A flat token index names a token of `cache`: anything else is an invalid index, never read.
MLA_HD bool sparse_token_in_cache(const SparseKvCache& cache, int64_t tok) {
  return tok >= 0 && tok < int64_t(cache.num_blocks) * cache.page_block_size;
}

}  // namespace mla
