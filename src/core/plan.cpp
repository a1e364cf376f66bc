#include "mla/plan.h"

#include <algorithm>
#include <vector>

namespace mla {

namespace {

void check_lengths(const DecodePlanParams& p) {
  MLA_CHECK(p.b > 0, "batch size must be positive, got ", p.b);
  MLA_CHECK(p.num_sm_parts > 0, "num_sm_parts must be positive, got ", p.num_sm_parts);
  for (int i = 0; i < p.b; ++i) {
    if (p.seqlens_k) MLA_CHECK(p.seqlens_k[i] >= 0, "cache_seqlens[", i, "] must be >= 0, got ", p.seqlens_k[i]);
    if (p.topk_length) MLA_CHECK(p.topk_length[i] >= 0, "topk_length[", i, "] must be >= 0, got ", p.topk_length[i]);
    if (p.extra_topk_length)
      MLA_CHECK(p.extra_topk_length[i] >= 0, "extra_topk_length[", i, "] must be >= 0, got ", p.extra_topk_length[i]);
  }
}

}  // namespace

void plan_decode_host(const DecodePlanParams& p) { plan_decode_host_part(p, -1); }

void plan_decode_host_part(const DecodePlanParams& p, int only_part) {
  check_lengths(p);
  MLA_CHECK(only_part >= -1 && only_part < p.num_sm_parts, "part must be in [0, num_sm_parts = ", p.num_sm_parts,
            ") (or -1 for every row), got ", only_part);
  std::vector<int> blocks(p.b);
  const int f = plan_fixed(p);
  long long total = 0;
  for (int i = 0; i < p.b; ++i) total += plan_units(blocks[i] = request_blocks(p, i), f);
  const long long w0 = plan_width(total, p.num_sm_parts);
  unsigned unfit = 0;
  std::vector<long long> cost(size_t(kPlanWidthChoices) * p.num_sm_parts, 0);  // [width choice][part]
  long long start = 0;
  for (int i = 0; i < p.b; ++i) {
    unfit |= plan_cuts(start, blocks[i], w0, f);
    for (int c = 0; c <= f; ++c) {
      const int part = plan_first_part(start, w0, c, f);
      if (part < p.num_sm_parts) cost[size_t(c) * p.num_sm_parts + part] += plan_units(blocks[i], f);
    }
    start += plan_units(blocks[i], f);
  }
  for (int c = 0; c <= f; ++c)
    for (int part = 0; part < p.num_sm_parts; ++part)
      if (cost[size_t(c) * p.num_sm_parts + part] > w0 + f) unfit |= 1u << c;
  const long long w = plan_choose_width(w0, unfit, f);
  // Uniform requests may take the even split instead.
  if (const int k = plan_even_for(p, f, w0, unfit, w); k > 0) {
    auto* rows = reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata);
    for (int part = 0; part < p.num_sm_parts; ++part)
      if (only_part < 0 || part == only_part) rows[part] = plan_even_row(p.b, blocks[0], k, part);
    for (int i = 0; i <= p.b; ++i) p.num_splits[i] = i * k;
    return;
  }
  PlanRow row = plan_idle(p.b);  // row only_part, when that is all it makes
  if (only_part < 0)
    for (int part = 0; part < p.num_sm_parts; ++part) plan_idle_row(p, part);
  start = 0;
  p.num_splits[0] = 0;
  for (int i = 0; i < p.b; ++i) {
    p.num_splits[i + 1] = p.num_splits[i] + plan_request(p, i, start, blocks[i], w, only_part, &row);
    start += plan_units(blocks[i], f);
  }
  if (only_part >= 0) reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)[only_part] = row;
}

void check_plan_matches(const DecodePlanParams& p) {
  check_lengths(p);
  const int32_t* ns = p.num_splits;
  MLA_CHECK(ns[0] == 0, "num_splits[0] must be 0, got ", ns[0]);
  for (int i = 0; i < p.b; ++i)
    MLA_CHECK(ns[i + 1] > ns[i], "num_splits must increase: num_splits[", i + 1, "] = ", ns[i + 1],
              " after num_splits[", i, "] = ", ns[i]);
  MLA_CHECK(ns[p.b] <= p.b + p.num_sm_parts, "num_splits[b] = ", ns[p.b], " exceeds b + num_sm_parts = ",
            p.b + p.num_sm_parts);

  // Walk the plan as the kernels do (plan_piece) and check that each request's pieces follow one
  // another from block 0 to its last block, numbered 0..n-1 as num_splits says. A plan made for
  // other lengths of the same batch passes (its pieces are clamped and its last piece runs to the
  // end); a plan for another batch, or one that is not a plan, does not.
  std::vector<int> next_block(p.b, 0), next_piece(p.b, 0);
  const auto* rows = reinterpret_cast<const PlanRow*>(p.tile_scheduler_metadata);
  const char* hint = "; was the plan made for another batch?";
  for (int part = 0; part < p.num_sm_parts; ++part) {
    const PlanRow& r = rows[part];
    MLA_CHECK(r.batch == p.b, "tile_scheduler_metadata row ", part, " was planned for a batch of ", r.batch,
              " requests, not ", p.b, hint);
    if (r.begin_req >= p.b || r.end_req < r.begin_req) continue;
    MLA_CHECK(r.begin_req >= 0 && r.end_req < p.b, "tile_scheduler_metadata row ", part, " names requests ",
              r.begin_req, "..", r.end_req, " outside [0, ", p.b, ")", hint);
    for (int k = 0; k <= r.end_req - r.begin_req; ++k) {
      const int i = r.begin_req + k;
      const int total = request_blocks(p, i);
      const int piece = k == 0 ? r.begin_split : 0;
      MLA_CHECK(piece == next_piece[i], "tile_scheduler_metadata row ", part, " runs piece ", piece, " of request ", i,
                ", expected piece ", next_piece[i], hint);
      const PlanPiece pc = plan_piece(r, ns, k, total);
      MLA_CHECK(pc.is_split == (ns[i + 1] - ns[i] > 1), "tile_scheduler_metadata row ", part, " marks request ", i,
                pc.is_split ? " split" : " whole", " but num_splits gives it ", ns[i + 1] - ns[i], " pieces", hint);
      MLA_CHECK(pc.block_begin == std::min(next_block[i], total), "tile_scheduler_metadata row ", part,
                " starts request ", i, " at block ", pc.block_begin, ", expected block ", next_block[i], hint);
      next_block[i] = std::max(next_block[i], pc.block_end);
      ++next_piece[i];
    }
  }
  for (int i = 0; i < p.b; ++i) {
    MLA_CHECK(next_piece[i] == ns[i + 1] - ns[i], "num_splits gives request ", i, " ", ns[i + 1] - ns[i],
              " pieces but tile_scheduler_metadata has ", next_piece[i], hint);
    MLA_CHECK(next_block[i] == request_blocks(p, i), "the plan covers ", next_block[i], " of the ",
              request_blocks(p, i), " blocks of request ", i, hint);
  }
}

}  // namespace mla
