#include "mla/plan.h"

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

void plan_decode_host(const DecodePlanParams& p) {
  check_lengths(p);
  long long total = 0;
  for (int i = 0; i < p.b; ++i) total += plan_blocks(p, i) + kPlanFixedOverheadBlocks;
  const int consumed = plan_fill(p, total, [&](int i) { return request_blocks(p, i); });
  // The payload guarantees every request is consumed; anything else is a planner bug.
  MLA_CHECK(consumed == p.b, "internal error: the plan left requests ", consumed, "..", p.b - 1, " unassigned");
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

  // For every request: the next block and the next piece we expect to see, parts in order.
  std::vector<int> next_block(p.b, 0), next_piece(p.b, 0);
  const auto* rows = reinterpret_cast<const PlanRow*>(p.tile_scheduler_metadata);
  const char* hint = "; was the plan made for other cache_seqlens / topk_length values?";
  for (int part = 0; part < p.num_sm_parts; ++part) {
    const PlanRow& r = rows[part];
    if (r.begin_req >= p.b || r.end_req < r.begin_req) continue;
    MLA_CHECK(r.begin_req >= 0 && r.end_req < p.b, "tile_scheduler_metadata row ", part, " names requests ", r.begin_req,
              "..", r.end_req, " outside [0, ", p.b, ")");
    for (int k = 0; k <= r.end_req - r.begin_req; ++k) {
      const int i = r.begin_req + k;
      const int total = request_blocks(p, i);
      const bool last = i == r.end_req;
      const int begin = k == 0 ? r.begin_block : 0;
      const int end = last ? r.end_block : total;
      const int piece = k == 0 ? r.begin_split : 0;
      MLA_CHECK(begin == next_block[i] && end >= begin && end <= (total > 0 ? total : 0),
                "tile_scheduler_metadata row ", part, " covers blocks [", begin, ", ", end, ") of request ", i,
                " which has ", total, " blocks, next expected block ", next_block[i], hint);
      MLA_CHECK(piece == next_piece[i], "tile_scheduler_metadata row ", part, " runs piece ", piece, " of request ", i,
                ", expected piece ", next_piece[i], hint);
      const bool is_split = (k == 0 && r.first_split) || (last && r.last_split);
      MLA_CHECK(is_split == (ns[i + 1] - ns[i] > 1), "tile_scheduler_metadata row ", part, " marks request ", i,
                is_split ? " split" : " whole", " but num_splits gives it ", ns[i + 1] - ns[i], " pieces", hint);
      next_block[i] = end;
      ++next_piece[i];
    }
  }
  for (int i = 0; i < p.b; ++i) {
    MLA_CHECK(next_block[i] == request_blocks(p, i), "the plan covers ", next_block[i], " of the ",
              request_blocks(p, i), " blocks of request ", i, hint);
    MLA_CHECK(next_piece[i] == ns[i + 1] - ns[i], "num_splits gives request ", i, " ", ns[i + 1] - ns[i],
              " pieces but tile_scheduler_metadata has ", next_piece[i], hint);
  }
}

}  // namespace mla
