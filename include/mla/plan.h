// Split-KV planning for decode (SPEC §2, "the metadata contract").
//
// Decode work is cut into pieces of (request, range of 64-token blocks) and spread over
// `num_sm_parts` parts, one part per persistent CTA on the GPU (one task on the CPU backend).
// The plan is `tile_scheduler_metadata [num_sm_parts, 8]` int32 (one PlanRow per part) plus
// `num_splits [b + 1]` int32, the exclusive prefix sum of how many pieces each request was cut into.
// A piece that is a whole request writes `out`/`lse` directly; the pieces of a split request write
// partials into the split workspace row `num_splits[i] + n`, and the combine kernel merges them.
//
// The fill: the requests are laid end to end on a line of cost units, each first its piece's fixed
// cost (kPlanFixedOverheadBlocks units) and then one unit per block; part j runs the blocks whose
// units fall in [j W, (j + 1) W), W = ceil(total / num_sm_parts). A part's cost (its blocks plus the
// fixed cost of each of its pieces) is at most W + overhead, as in FlashMLA's greedy fill
// (reference/flashmla-semantics.md §5.2, payload W + overhead): only a piece that continues a
// request from the part before is not paid for on the line. Unlike the greedy fill, where each part
// starts where the previous one stopped, every request's rows and piece count follow from its own
// position on the line, so the device planner runs one thread per request: a scan for the
// positions, one for num_splits.
// The width: cuts at multiples of W fall inside requests even when the requests could stay whole
// (32 requests of 32 blocks over 33 parts: W = 36 against 37 units per request splits 31 of them;
// the greedy fill, with room W + overhead per part, splits none). So the planner takes the
// smallest W' in [W, W + overhead] that splits no request and leaves no part costing more than
// W + overhead, if there is one (with no request split, a part's cost is the sum of its requests'
// units), else W.
// Requests that all have the same blocks (plan_uniform_requests) at most half as many as the parts
// may instead be split evenly, one piece per part (plan_even_pieces), where that part is shorter.
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
  int fixed_cost = kPlanFixedOverheadBlocks;   // a piece's cost in blocks, in [1, kPlanFixedOverheadBlocks]
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

// A plan's fixed cost per piece, clamped to [1, kPlanFixedOverheadBlocks].
MLA_HD int plan_fixed(const DecodePlanParams& p) {
  return p.fixed_cost < 1 ? 1 : (p.fixed_cost > kPlanFixedOverheadBlocks ? kPlanFixedOverheadBlocks : p.fixed_cost);
}

// Blocks the planner charges a request of `blocks` = request_blocks (at least one: an empty request
// still costs a piece), and the units of the planner's line it takes (plus the fixed cost f).
MLA_HD int plan_charged(int blocks) { return blocks > 0 ? blocks : 1; }
MLA_HD int plan_units(int blocks, int f) { return plan_charged(blocks) + f; }

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

// Units of the line per part: W = ceil(total / num_sm_parts), total = the sum of plan_units over
// the requests.
MLA_HD long long plan_width(long long total, int num_sm_parts) { return (total + num_sm_parts - 1) / num_sm_parts; }

// The widths the planner tries: W + c for c in [0, f + 1) with f the fixed cost; at most this many.
constexpr int kPlanWidthChoices = kPlanFixedOverheadBlocks + 1;

// Division of a position on the line (a >= 0) by a width d: a / d. The planner functions below take
// their divisions as such an object, so that the device planner can pass one that divides by an
// invariant width faster (plan_block.cuh) and compute the same plan.
struct PlanDiv {
  long long d = 1;
  PlanDiv() = default;
  MLA_HD explicit PlanDiv(long long divisor) : d(divisor) {}
  MLA_HD long long operator()(long long a) const { return a / d; }
};

// The same division for 0 <= a < 2^32 and a divisor fixed for many divisions (the device planner's,
// for lines shorter than 2^31 units): m = floor((2^32 - 1) / d) makes the high half of a * m either
// a / d or one less, and the remainder settles which. A multiply where a / d is a long subroutine.
struct PlanInvariantDiv {
  unsigned d = 1, m = 0xffffffffu;
  PlanInvariantDiv() = default;
  MLA_HD explicit PlanInvariantDiv(unsigned divisor) : d(divisor), m(0xffffffffu / divisor) {}
  MLA_HD long long operator()(long long a) const {
    const unsigned x = unsigned(a);
#if defined(__CUDA_ARCH__)
    const unsigned q = __umulhi(x, m);
#else
    const unsigned q = unsigned((unsigned long long)x * m >> 32);
#endif
    return (long long)(q + (x - q * d >= d ? 1u : 0u));
  }
};

// Bit c set: request (at unit `start`, `blocks` = request_blocks) is cut in two by width W + c;
// by[c] divides by W + c.
template <class Div>
MLA_HD unsigned plan_cuts_by(const Div* by, long long start, int blocks, int f) {
  const long long first = start + f, last = start + plan_units(blocks, f) - 1;
  unsigned cut = 0;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int c = 0; c < kPlanWidthChoices; ++c)
    if (c <= f) cut |= unsigned(by[c](first) != by[c](last)) << c;
  return cut;
}
MLA_HD unsigned plan_cuts(long long start, int blocks, long long w, int f) {
  PlanDiv by[kPlanWidthChoices];
  for (int c = 0; c < kPlanWidthChoices; ++c) by[c].d = w + c;
  return plan_cuts_by(by, start, blocks, f);
}

// The part whose units hold request (at unit `start`)'s first block, at width W + c: with no
// request cut, the part that runs the whole request. `by` divides by W + c.
template <class Div>
MLA_HD int plan_first_part_by(const Div& by, long long start, int f) { return int(by(start + f)); }
MLA_HD int plan_first_part(long long start, long long w, int c, int f) { return plan_first_part_by(PlanDiv{w + c}, start, f); }

// The width used: `unfit` has bit c set where width W + c cuts a request (the OR of every request's
// plan_cuts) or leaves a part costing more than W + f. The smallest other width, else W.
MLA_HD long long plan_choose_width(long long w, unsigned unfit, int f) {
  for (int c = 0; c <= f; ++c)
    if (!(unfit >> c & 1u)) return w + c;
  return w;
}

// Whether every request of p has the same blocks: a sparse call without per-request lengths (the
// usual V3.2 call). Its plan follows from its shape alone (plan_uniform_unfit).
MLA_HD bool plan_uniform_requests(const DecodePlanParams& p) {
  return p.seqlens_k == nullptr && p.topk_length == nullptr && (p.extra_topk == 0 || p.extra_topk_length == nullptr);
}

// The planner's test for width w0 + c on a line of b requests of u units each (total = b u units,
// under 2^31; f the fixed cost) at part `part`: whether a part boundary falls more than f units into
// a request (cuts it), or the requests whose first block unit lies in the part's units cost more
// than w0 + f. Bit c of the width choice is unfit where any part's test is true. by_u divides by u.
template <class Div>
MLA_HD bool plan_uniform_unfit(const Div& by_u, unsigned u, unsigned total, unsigned w0, int f, int b, int c,
                               int part) {
  const unsigned w = w0 + unsigned(c), at = unsigned(part) * w;  // the part's first unit
  const bool cuts = part > 0 && at < total && at - unsigned(by_u(at)) * u > unsigned(f);
  const unsigned first = at >= unsigned(f) ? unsigned(by_u(at - f + u - 1)) : 0u;
  const unsigned last_unit = at + w - 1;
  const unsigned last = last_unit >= unsigned(f) ? unsigned(by_u(last_unit - f)) + 1u : 0u;
  const unsigned after = last < unsigned(b) ? last : unsigned(b);
  const unsigned count = after > first ? after - first : 0u;
  return cuts || count * u > w0 + unsigned(f);
}

// A part with no piece (its units hold no block): begin_req = b. Every row starts as this one.
MLA_HD PlanRow plan_idle(int b) {
  PlanRow r;
  r.begin_req = b, r.end_req = b - 1;
  r.begin_block = r.end_block = r.begin_split = r.first_split = r.last_split = 0;
  r.batch = b;
  return r;
}
MLA_HD void plan_idle_row(const DecodePlanParams& p, int part) {
  reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)[part] = plan_idle(p.b);
}

// The even split of a call with uniform requests (b requests of `blocks` blocks, total = b u units
// under 2^31): k = num_sm_parts / b pieces per request, `per` = ceil(blocks / k) blocks each (the
// last one fewer), part j running piece j % k of request j / k, one piece per part. The line's plan
// (width w; `whole`: it cuts no request) cuts where the units fall, so a part that continues a
// request runs up to w blocks and then pays its piece's fixed cost off the line: b = 64 requests of
// 32 blocks over 132 parts (f = 2) get parts of 15 and 17 blocks, where halves of 16 would do. The
// even split is taken where its piece, fixed cost included, is shorter than the line's longest
// part. Returns k (0: keep the line's plan).
MLA_HD int plan_even_pieces(int b, int blocks, int f, int parts, long long w, bool whole) {
  if (b <= 0 || blocks < 2 || parts / b < 2) return 0;
  const int k0 = parts / b < blocks ? parts / b : blocks;
  const int per = ceil_div(blocks, k0);
  const long long line = whole ? w : w + f;
  return per + f < line ? ceil_div(blocks, per) : 0;  // k0 pieces of per may leave the last empty
}
// The even split's k for a call whose line took width w = plan_choose_width(w0, unfit, f) (the same
// test in every planner): 0 where its requests differ or the line's plan is kept.
MLA_HD int plan_even_for(const DecodePlanParams& p, int f, long long w0, unsigned unfit, long long w) {
  if (!plan_uniform_requests(p)) return 0;
  return plan_even_pieces(p.b, request_blocks(p, 0), f, p.num_sm_parts, w, !(unfit >> (w - w0) & 1u));
}
MLA_HD int plan_even_per(int blocks, int k) { return ceil_div(blocks, k); }
// Row j of an even split of k pieces per request (plan_even_pieces).
MLA_HD PlanRow plan_even_row(int b, int blocks, int k, int j) {
  PlanRow r = plan_idle(b);
  const int i = j / k, piece = j - i * k, per = plan_even_per(blocks, k);
  if (i >= b) return r;
  r.begin_req = r.end_req = i;
  r.begin_block = piece * per;
  r.end_block = piece + 1 < k ? (piece + 1) * per : blocks;
  r.begin_split = piece;
  r.first_split = r.last_split = k > 1;
  return r;
}

// The line of a call with uniform requests: b requests of `blocks` blocks, u = blocks + f units
// each, total = b u units, W = w0. `ok` false where the closed-form plan does not apply (no
// requests or parts, a line of 2^31 units or more: the general planner makes those).
struct PlanUniformLine {
  bool ok = false;
  int f = 0, blocks = 0;
  unsigned u = 0, total = 0, w0 = 0;
};
MLA_HD PlanUniformLine plan_uniform_line(const DecodePlanParams& p) {
  PlanUniformLine l;
  if (p.b <= 0 || p.num_sm_parts <= 0) return l;
  l.f = plan_fixed(p);
  l.blocks = request_blocks(p, 0);
  l.u = unsigned(plan_units(l.blocks, l.f));
  const unsigned long long total = (unsigned long long)p.b * l.u;
  if (total >= (1ull << 31)) return l;
  l.total = unsigned(total);
  l.w0 = (l.total + unsigned(p.num_sm_parts) - 1) / unsigned(p.num_sm_parts);
  l.ok = true;
  return l;
}

// What the plan of a call with uniform requests (plan_uniform_requests) does, which its shape alone
// decides: `whole`, some width in [W, W + f] passes plan_uniform_unfit at every part and the even
// split is not taken, so no request is split and the combine has nothing to merge; `even_k` > 0, the
// even split of that many pieces per request is taken (plan_even_for). `ok` false where the
// closed-form plan does not apply. Host code: at most (f + 1) x num_sm_parts tests, stopping at the
// first width that fits and at a width's first unfit part.
struct PlanUniformChoice {
  bool ok = false, whole = false;
  int even_k = 0;
};
inline PlanUniformChoice plan_uniform_choice(const DecodePlanParams& p) {
  PlanUniformChoice r;
  if (!plan_uniform_requests(p)) return r;
  const PlanUniformLine l = plan_uniform_line(p);
  if (!l.ok) return r;
  r.ok = true;
  const PlanInvariantDiv by_u(l.u);
  for (int c = 0; c <= l.f; ++c) {
    bool fits = true;
    for (int part = 0; part < p.num_sm_parts && fits; ++part)
      fits = !plan_uniform_unfit(by_u, l.u, l.total, l.w0, l.f, p.b, c, part);
    if (fits) {
      r.even_k = plan_even_pieces(p.b, l.blocks, l.f, p.num_sm_parts, l.w0 + c, true);
      r.whole = r.even_k == 0;
      return r;
    }
  }
  r.even_k = plan_even_pieces(p.b, l.blocks, l.f, p.num_sm_parts, l.w0, false);
  return r;
}

// Request i, starting at unit `start` of the line, with `blocks` = request_blocks(p, i): writes the
// fields of the rows it begins or ends (every other field of those rows is written by the request
// that begins or ends them, or is the idle row's) and returns its piece count. Rows start idle.
// With only_part >= 0 it writes that row alone, into *only_row (a decode CTA planning for itself).
// `by` divides by w.
template <class Div>
MLA_HD int plan_request_by(const Div& by, const DecodePlanParams& p, int i, long long start, int blocks, long long w,
                           int only_part = -1, PlanRow* only_row = nullptr) {
  const int fixed = plan_fixed(p);
  const long long first = start + fixed, end = start + plan_units(blocks, fixed);  // its block units
  const int f = int(by(first)), l = int(by(end - 1));                        // its first and last part
  const bool opens = i == 0 || by(start - 1) < f;        // the request before has no block in part f
  const bool closes = i == p.b - 1 || by(end + fixed) > l;    // nor the one after in part l
  PlanRow* rows = reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata);
  const int j0 = only_part >= 0 ? (only_part > f ? only_part : f) : f;
  const int j1 = only_part >= 0 ? (only_part < l ? only_part : l) : l;
  for (int j = j0; j <= j1; ++j) {
    PlanRow& r = only_part >= 0 ? *only_row : rows[j];
    const bool begins = j > f || opens, ends = j < l || closes;
    if (begins) {
      r.begin_req = i;
      r.begin_block = j > f ? int(j * w - first) : 0;
      r.begin_split = j - f;
      r.first_split = j > f;
    }
    if (ends) {
      r.end_req = i;
      r.end_block = j < l ? int((j + 1) * w - first) : blocks;
      r.last_split = j < l;
    }
    if (begins && ends) r.first_split = r.last_split = l > f;  // the part's only piece: split or not
  }
  return l - f + 1;
}
MLA_HD int plan_request(const DecodePlanParams& p, int i, long long start, int blocks, long long w,
                        int only_part = -1, PlanRow* only_row = nullptr) {
  return plan_request_by(PlanDiv{w}, p, i, start, blocks, w, only_part, only_row);
}

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
// The fixed cost per piece of a sparse call of h_q heads: the small-heads kernel's for at most 32.
MLA_HD int plan_fixed_for_heads(long long h_q) {
  return h_q > 0 && h_q <= 32 ? kPlanFewRowsFixedBlocks : kPlanFixedOverheadBlocks;
}
// The fixed cost per piece of a dense call, whatever its rows per KV head: dense calls run the
// 64-row kernel by default and plan with its (FlashMLA's) cost. With the few-rows cost a batch of
// 128 requests of 128 blocks over 132 parts has every request cut in two, with FlashMLA's each
// stays whole (H200, the 64-row kernel, plan reused: 297.1 -> 293.8 us; b=1 s_k=8192 20.7 -> 16.9).
MLA_HD constexpr int plan_fixed_dense() { return kPlanFixedOverheadBlocks; }
MLA_HD DecodePlanParams dense_plan_params(const DenseDecodeParams& p) {
  DecodePlanParams pp = plan_params_for(p.b, p.split);
  pp.fixed_cost = plan_fixed_dense();
  pp.seqlens_k = p.seqlens_k;
  const long long capacity = (long long)p.max_blocks_per_seq * p.page_block_size;
  pp.max_seqlen = capacity < 0x7fffffff ? int(capacity) : 0x7fffffff;
  return pp;
}
// Whether a sparse call attends an extra cache: extra indices over at least one page block. An
// extra cache of no page blocks holds no token an index could name (and may have no data): the
// plan gives it no slots, so every backend runs the call as the one without it (the extra slots
// of a request exist only through the plan's extra_topk).
MLA_HD bool has_extra_cache(const SparseDecodeParams& p) {
  return p.extra_indices != nullptr && p.extra_kv.num_blocks > 0;
}

MLA_HD DecodePlanParams sparse_plan_params(const SparseDecodeParams& p) {
  DecodePlanParams pp = plan_params_for(p.b, p.split);
  pp.fixed_cost = plan_fixed_for_heads(p.h_q);
  pp.topk = p.topk;
  pp.topk_length = p.topk_length;
  pp.extra_topk = has_extra_cache(p) ? p.extra_topk : 0;
  pp.extra_topk_length = has_extra_cache(p) ? p.extra_topk_length : nullptr;
  return pp;
}

// Shapes the checks will reject still get one part, never a division by zero.
// (Rows per KV head counted in 64 bits: s_q * h_q / h_k may pass 2^31 before the checks run.)
inline int num_sm_parts_dense(int num_sms, int s_q, int h_q, int h_k) {
  if (s_q <= 0 || h_q <= 0 || h_k <= 0 || h_q % h_k != 0) return 1;
  const long long tiles = (static_cast<long long>(s_q) * (h_q / h_k) + 63) / 64;
  const long long parts = num_sms / h_k / tiles;
  return parts > 1 ? int(parts) : 1;
}
inline int num_sm_parts_sparse(int num_sms, int s_q, int h_q) {
  if (s_q <= 0 || h_q <= 0) return 1;
  const int parts = num_sms / s_q / ceil_div(h_q, 64);
  return parts > 1 ? parts : 1;
}

// Host planner: fills params.tile_scheduler_metadata and params.num_splits. Throws mla::Error when
// a length is negative.
void plan_decode_host(const DecodePlanParams& params);
// The same plan's row `part` alone (the other rows are left as they are) and all of num_splits; an
// attention kernel planning for its own part makes the same row, and of num_splits at least the
// entries that part's pieces read (plan_block.cuh, writes_split).
void plan_decode_host_part(const DecodePlanParams& params, int part);

// Checks that a plan (possibly made by an earlier call) covers exactly the blocks of every request
// of `params`, each request's pieces numbered 0..n-1 as num_splits says. Throws mla::Error naming
// what does not match: a plan reused after the lengths changed is an error, not a wrong result.
void check_plan_matches(const DecodePlanParams& params);

}  // namespace mla
