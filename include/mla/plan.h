// Split-KV planning for decode (SPEC §2, "the metadata contract").
//
// Decode work is cut into pieces of (request, range of 64-token blocks) and spread over
// `num_sm_parts` parts, one part per persistent CTA on the GPU (one task on the CPU backend).
// The plan is `tile_scheduler_metadata [num_sm_parts, 8]` int32 (one PlanRow per part) plus
// `num_splits [b + 1]` int32, the exclusive prefix sum of how many pieces each request was cut into.
// A piece that is a whole request writes `out`/`lse` directly; the pieces of a split request write
// partials into the split workspace row `num_splits[i] + n`, and the combine kernel merges them.
//
// The fill is FlashMLA's greedy one (reference/flashmla-semantics.md §5.2): every piece costs its
// blocks plus kPlanFixedOverheadBlocks, each part gets ceil(total / num_sm_parts) + overhead, and a
// part that cannot take the next request whole takes what fits of it only if that is more than the
// overhead. On uniform batches this keeps requests whole (a split costs a second piece and the
// combine), which a fill that cuts at exact multiples of the average does not.
// Everything here is host-and-device code so the CPU backend, the device planner and the kernels
// read a plan the same way.
#pragma once

#include <cstdint>

#include "mla/params.h"
#include "mla/types.h"

#if defined(__CUDACC__)
#define MLA_HD __host__ __device__ __forceinline__
#else
#define MLA_HD inline
#endif

namespace mla {

// One row of tile_scheduler_metadata: the pieces a part runs.
struct PlanRow {
  int32_t begin_req;    // first request of the part (inclusive); >= b means the part is idle
  int32_t end_req;      // last request of the part (inclusive)
  int32_t begin_block;  // first block of begin_req
  int32_t end_block;    // end block (exclusive) of end_req
  int32_t begin_split;  // which piece of begin_req this part's first piece is
  int32_t first_split;  // begin_req is shared with other parts
  int32_t last_split;   // end_req is shared with other parts
  int32_t batch;        // the batch size the plan was made for (a plan of another batch is rejected)
};
static_assert(sizeof(PlanRow) == 8 * sizeof(int32_t), "a plan row is 8 int32");
constexpr int kPlanRowInts = 8;

// What the planner needs to know about a decode call. Dense decode sets seqlens_k; sparse decode
// sets topk (and optionally the length and extra-cache fields).
struct DecodePlanParams {
  int b = 0;
  int num_sm_parts = 1;
  const int32_t* seqlens_k = nullptr;          // [b] dense: KV length of each request
  int max_seqlen = 0x7fffffff;                 // dense: lengths past what the block table holds are clamped
  int topk = 0;                                // sparse: main top-k slots per query row
  const int32_t* topk_length = nullptr;        // [b] sparse, optional: valid main slots
  int extra_topk = 0;                          // sparse: extra-cache slots per row (0: none)
  const int32_t* extra_topk_length = nullptr;  // [b] optional: valid extra slots
  int32_t* tile_scheduler_metadata = nullptr;  // [num_sm_parts, 8] out
  int32_t* num_splits = nullptr;               // [b + 1] out
};

// ceil(a / b) for a >= 0, b > 0, without overflow near INT_MAX.
MLA_HD int ceil_div(int a, int b) { return a / b + (a % b != 0); }
MLA_HD int clamp_len(int v, int hi) { return v < 0 ? 0 : (v > hi ? hi : v); }

// Valid main / extra slots of request i of a sparse call.
MLA_HD int sparse_main_len(const DecodePlanParams& p, int i) {
  return p.topk_length ? clamp_len(p.topk_length[i], p.topk) : p.topk;
}
MLA_HD int sparse_extra_len(const DecodePlanParams& p, int i) {
  if (p.extra_topk == 0) return 0;
  return p.extra_topk_length ? clamp_len(p.extra_topk_length[i], p.extra_topk) : p.extra_topk;
}

// Blocks of main slots of request i of a sparse call (at least one, so that an empty request still
// has a piece that writes its output); extra-cache blocks follow them.
MLA_HD int sparse_main_blocks(const DecodePlanParams& p, int i) {
  const int n = ceil_div(sparse_main_len(p, i), kPlanBlockSize);
  return n > 0 ? n : 1;
}

// KV length of request i of a dense call, clamped to [0, max_seqlen].
MLA_HD int dense_len(const DecodePlanParams& p, int i) { return clamp_len(p.seqlens_k[i], p.max_seqlen); }

// Blocks of work request i has: dense ceil(len / 64) (0 when empty), sparse main + extra blocks.
MLA_HD int request_blocks(const DecodePlanParams& p, int i) {
  if (p.seqlens_k) return ceil_div(dense_len(p, i), kPlanBlockSize);
  return sparse_main_blocks(p, i) + ceil_div(sparse_extra_len(p, i), kPlanBlockSize);
}

// Blocks the planner charges request i (at least one: an empty request still costs a piece).
MLA_HD int plan_blocks(const DecodePlanParams& p, int i) {
  const int n = request_blocks(p, i);
  return n > 0 ? n : 1;
}

// One piece of a part: request `req`, blocks [block_begin, block_end).
struct PlanPiece {
  int req;
  int block_begin;
  int block_end;
  bool is_split;    // writes the split workspace instead of out/lse
  int split_index;  // row of the split workspace when is_split
};

// The k-th request a part runs (k = 0 .. end_req - begin_req), as a piece. `total_blocks` is
// request_blocks() of that request now. A request's first piece starts at block 0 and its last
// piece runs to its last block, whatever lengths the plan was made for: a plan reused after the
// lengths changed still covers every block (ranges are clamped, so none reads past the work).
MLA_HD PlanPiece plan_piece(const PlanRow& row, const int32_t* num_splits, int k, int total_blocks) {
  PlanPiece pc;
  pc.req = row.begin_req + k;
  const bool first = k == 0;
  const bool last = pc.req == row.end_req;
  pc.is_split = (first && row.first_split) || (last && row.last_split);
  pc.split_index = num_splits[pc.req] + (first ? row.begin_split : 0);
  const bool last_piece = !pc.is_split || pc.split_index == num_splits[pc.req + 1] - 1;
  // 0 <= block_begin <= block_end <= total_blocks, whatever the row holds.
  pc.block_end = clamp_len(last && !last_piece ? row.end_block : total_blocks, total_blocks);
  pc.block_begin = clamp_len(first ? row.begin_block : 0, pc.block_end);
  return pc;
}

// The greedy fill, one request at a time: add(i, request_blocks(p, i)) for i = 0 .. b - 1, then
// finish(). Each add is O(1) plus one step per part the request fills; the state is a few integers,
// so the device planner runs it from registers. Writes every PlanRow and num_splits[0..b].
struct PlanFill {
  PlanRow* rows;
  int32_t* num_splits;
  int b, parts;
  long long payload, remain = 0;  // every part's budget, and what the open part has left
  int part = 0, pieces = 0;       // rows written, pieces of the requests added so far
  int prev_end_block = 0;         // end_block of the open part if it closes after the last request added
  PlanRow row{};                  // the open part

  MLA_HD PlanFill(const DecodePlanParams& p, long long total)
      : rows(reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)),
        num_splits(p.num_splits),
        b(p.b),
        parts(p.num_sm_parts),
        payload((total + p.num_sm_parts - 1) / p.num_sm_parts + kPlanFixedOverheadBlocks) {
    num_splits[0] = 0;
    open(0, 0, 0);
  }
  MLA_HD void open(int req, int blk, int split) {
    row.begin_req = req;
    row.begin_block = blk;
    row.begin_split = split;
    row.first_split = blk != 0;
    remain = payload;
  }
  MLA_HD void close(int end_req, int end_block, bool last_split) {
    row.end_req = end_req;
    row.end_block = end_block;
    row.last_split = last_split;
    if (row.begin_req == end_req) row.first_split = row.last_split = row.first_split || last_split;
    row.batch = b;
    if (part < parts) rows[part] = row;  // the payload always fits the work into `parts` rows
    ++part;
  }
  MLA_HD void add(int i, int blocks) {
    const int F = kPlanFixedOverheadBlocks;
    const int charged = blocks > 0 ? blocks : 1;  // an empty request still costs one block
    int blk = 0, split = 0;
    if (remain < charged + F) {
      // Not whole into the open part: what fits beyond the overhead, if anything, then whole parts
      // of it (a fresh part always takes some: payload > F) until the rest fits.
      if (remain > F) {
        blk = int(remain - F), split = 1;
        close(i, blk, true);
      } else {
        close(i - 1, prev_end_block, false);  // the open part holds at least request i - 1
      }
      open(i, blk, split);
      while (remain < charged - blk + F) {
        blk += int(remain - F), ++split;
        close(i, blk, true);
        open(i, blk, split);
      }
    }
    remain -= charged - blk + F;
    pieces += split + 1;
    num_splits[i + 1] = pieces;
    prev_end_block = blocks > 0 ? charged : 0;
  }
  // Closes the open part after the last request; the parts left are idle (begin_req = b).
  MLA_HD void finish() {
    close(b - 1, prev_end_block, false);
    while (part < parts) {
      open(b, 0, 0);
      close(b - 1, prev_end_block, false);
    }
  }
};

// Number of parts for a call, from the number of SMs (or CPU "virtual SMs") available. Dense decode
// folds s_q * h_q / h_k query rows into 64-row tiles; sparse decode runs 64 heads per CTA.
// The planner's view of a decode call (its plan pointers are those of p.split).
MLA_HD DecodePlanParams plan_params_for(int b, const DecodeSplit& split) {
  DecodePlanParams pp;
  pp.b = b;
  pp.num_sm_parts = split.num_sm_parts;
  pp.tile_scheduler_metadata = const_cast<int32_t*>(split.tile_scheduler_metadata);
  pp.num_splits = const_cast<int32_t*>(split.num_splits);
  return pp;
}
MLA_HD DecodePlanParams dense_plan_params(const DenseDecodeParams& p) {
  DecodePlanParams pp = plan_params_for(p.b, p.split);
  pp.seqlens_k = p.seqlens_k;
  const long long capacity = (long long)p.max_blocks_per_seq * p.page_block_size;
  pp.max_seqlen = capacity < 0x7fffffff ? int(capacity) : 0x7fffffff;
  return pp;
}
MLA_HD DecodePlanParams sparse_plan_params(const SparseDecodeParams& p) {
  DecodePlanParams pp = plan_params_for(p.b, p.split);
  pp.topk = p.topk;
  pp.topk_length = p.topk_length;
  pp.extra_topk = p.extra_kv.data ? p.extra_topk : 0;
  pp.extra_topk_length = p.extra_kv.data ? p.extra_topk_length : nullptr;
  return pp;
}

// Shapes the checks will reject still get one part, never a division by zero.
inline int num_sm_parts_dense(int num_sms, int s_q, int h_q, int h_k) {
  if (s_q <= 0 || h_q <= 0 || h_k <= 0 || h_q % h_k != 0) return 1;
  const int parts = num_sms / h_k / ceil_div(s_q * (h_q / h_k), 64);
  return parts > 1 ? parts : 1;
}
inline int num_sm_parts_sparse(int num_sms, int s_q, int h_q) {
  if (s_q <= 0 || h_q <= 0) return 1;
  const int parts = num_sms / s_q / ceil_div(h_q, 64);
  return parts > 1 ? parts : 1;
}

// Host planner: fills params.tile_scheduler_metadata and params.num_splits. Throws mla::Error when
// a length is negative.
void plan_decode_host(const DecodePlanParams& params);

// Checks that a plan (possibly made by an earlier call) covers exactly the blocks of every request
// of `params`, each request's pieces numbered 0..n-1 as num_splits says. Throws mla::Error naming
// what does not match: a plan reused after the lengths changed is an error, not a wrong result.
void check_plan_matches(const DecodePlanParams& params);

}  // namespace mla
