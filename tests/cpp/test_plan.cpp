// The split planner: a worked example, and the invariants every plan must hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "mla/plan.h"

namespace mla {
namespace {

struct HostPlan {
  std::vector<int32_t> rows, num_splits;
  DecodePlanParams params;
};

HostPlan make_plan(DecodePlanParams p) {
  HostPlan h;
  h.rows.assign(p.num_sm_parts * kPlanRowInts, -7);
  h.num_splits.assign(p.b + 1, -7);
  p.tile_scheduler_metadata = h.rows.data();
  p.num_splits = h.num_splits.data();
  plan_decode_host(p);
  h.params = p;
  return h;
}

void expect_covers_exactly(const HostPlan& h);
void expect_balanced(const HostPlan& h);

TEST(Plan, WorkedExample) {
  // Dense lengths [1000, 64, 0, 4096] over 8 parts: 16, 1, 1 (empty, charged one) and 64 blocks, each
  // after 5 units of fixed cost, lie on the line at [5, 21), [26, 27), [32, 33), [38, 102); W =
  // ceil(102 / 8) = 13, so part j runs the blocks in units [13 j, 13 j + 13).
  const std::vector<int32_t> lens = {1000, 64, 0, 4096};
  DecodePlanParams p;
  p.b = 4;
  p.num_sm_parts = 8;
  p.seqlens_k = lens.data();
  const HostPlan h = make_plan(p);
  const int expected[8][7] = {
      // begin_req, end_req, begin_block, end_block, begin_split, first_split, last_split
      {0, 0, 0, 8, 0, 1, 1},   {0, 0, 8, 16, 1, 1, 1},  {1, 3, 0, 1, 0, 0, 1},   {3, 3, 1, 14, 1, 1, 1},
      {3, 3, 14, 27, 2, 1, 1}, {3, 3, 27, 40, 3, 1, 1}, {3, 3, 40, 53, 4, 1, 1}, {3, 3, 53, 64, 5, 1, 1},
  };
  for (int part = 0; part < 8; ++part) {
    for (int f = 0; f < 7; ++f) EXPECT_EQ(h.rows[part * 8 + f], expected[part][f]) << "part " << part << " field " << f;
    EXPECT_EQ(h.rows[part * 8 + 7], 4) << "part " << part << ": the batch the plan was made for";
  }
  EXPECT_EQ(h.num_splits, (std::vector<int32_t>{0, 2, 3, 4, 10}));
}

TEST(Plan, UniformRequestsStayWhole) {
  // 32 requests of 32 blocks over 33 parts (sparse s_q = 2, 128 heads): W = ceil(32 * 37 / 33) = 36
  // would cut 31 requests; W' = 37 cuts none, so each part runs one request whole, the last part is
  // idle, and nothing is split or combined.
  DecodePlanParams p;
  p.b = 32;
  p.num_sm_parts = 33;
  p.topk = 2048;
  const HostPlan h = make_plan(p);
  for (int part = 0; part < 32; ++part)
    EXPECT_EQ(std::vector<int32_t>(h.rows.begin() + part * 8, h.rows.begin() + part * 8 + 7),
              (std::vector<int32_t>{part, part, 0, 32, 0, 0, 0}))
        << "part " << part;
  EXPECT_EQ(h.rows[32 * 8], 32) << "the last part is idle";
  for (int i = 0; i <= 32; ++i) EXPECT_EQ(h.num_splits[i], i);
}

TEST(Plan, UniformDenseRequestsStayWhole) {
  // 128 requests of 8192 tokens (128 blocks) over 132 parts: W = 129 would cut every request; W' = 133
  // (within W + overhead) cuts none.
  const std::vector<int32_t> lens(128, 8192);
  DecodePlanParams p;
  p.b = 128;
  p.num_sm_parts = 132;
  p.seqlens_k = lens.data();
  const HostPlan h = make_plan(p);
  for (int part = 0; part < 128; ++part)
    EXPECT_EQ(std::vector<int32_t>(h.rows.begin() + part * 8, h.rows.begin() + part * 8 + 7),
              (std::vector<int32_t>{part, part, 0, 128, 0, 0, 0}))
        << "part " << part;
  for (int part = 128; part < 132; ++part) EXPECT_EQ(h.rows[part * 8], 128) << "part " << part << " is idle";
  expect_covers_exactly(h);
  expect_balanced(h);
}

TEST(Plan, FewRowsUniformRequestsUseEveryPart) {
  // The same batch planned for the small-heads sparse kernel (16 heads: fixed cost
  // kPlanFewRowsFixedBlocks): a request now takes fewer units than any width in [W, W + f] needs to
  // keep requests whole, so the cuts fall at multiples of W and every part runs about W units,
  // 4 parts no longer idle.
  SparseDecodeParams sp;
  sp.b = 128, sp.s_q = 1, sp.h_q = 16, sp.topk = 8192;
  sp.split.num_sm_parts = 132;
  const DecodePlanParams p = sparse_plan_params(sp);
  EXPECT_EQ(p.fixed_cost, kPlanFewRowsFixedBlocks);
  const HostPlan h = make_plan(p);
  for (int part = 0; part < 132; ++part) EXPECT_LT(h.rows[part * 8], 128) << "part " << part << " runs work";
  expect_covers_exactly(h);
  expect_balanced(h);
  sp.h_q = 32;
  EXPECT_EQ(sparse_plan_params(sp).fixed_cost, kPlanFewRowsFixedBlocks);
  sp.h_q = 64;  // 64-head tiles: FlashMLA's fixed cost
  EXPECT_EQ(sparse_plan_params(sp).fixed_cost, kPlanFixedOverheadBlocks);
}

TEST(Plan, DenseFewRowsKeepUniformRequestsWhole) {
  // Dense calls plan with FlashMLA's fixed cost at any row count (they run the 64-row kernel): 128
  // requests of 128 blocks over 132 parts (h_q = 16, tensor parallelism 8) stay whole, one per part,
  // with no combine, where the few-rows cost would cut every request in two.
  const std::vector<int32_t> lens(128, 8192);
  DenseDecodeParams d;
  d.b = 128, d.s_q = 1, d.h_q = 16, d.h_k = 1;
  d.max_blocks_per_seq = 128, d.page_block_size = 64;
  d.split.num_sm_parts = 132;
  for (int h_q : {16, 32, 128}) {
    d.h_q = h_q;
    EXPECT_EQ(dense_plan_params(d).fixed_cost, kPlanFixedOverheadBlocks) << h_q << " heads";
  }
  d.h_q = 16;
  DecodePlanParams p = dense_plan_params(d);
  p.seqlens_k = lens.data();
  const HostPlan h = make_plan(p);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(h.num_splits[i + 1] - h.num_splits[i], 1) << "request " << i;
  expect_covers_exactly(h);
}

TEST(Plan, UniformChoiceFromTheShapeAloneMatchesThePlan) {
  // plan_uniform_choice (which lets a Hopper sparse call that planned for itself skip the combine,
  // or merge an even split's halves in a cluster) says "whole" exactly where the plan cuts no
  // request, and names the even split's k exactly where the plan makes it (part j running piece
  // j % k of request j / k, num_splits i k), over batches, topk (main and extra), part counts and
  // both fixed costs; and does not apply to a call with per-request lengths.
  int whole = 0, split = 0, even = 0, pairs = 0;
  for (int parts : {1, 7, 33, 66, 78, 132})
    for (int topk : {1, 64, 200, 2048, 8192})
      for (int extra : {0, 100})
        for (int f : {kPlanFewRowsFixedBlocks, kPlanFixedOverheadBlocks})
          for (int b = 1; b <= 2 * parts + 3; b += b < 70 ? 1 : 7) {
            DecodePlanParams p;
            p.b = b, p.num_sm_parts = parts, p.topk = topk, p.extra_topk = extra, p.fixed_cost = f;
            const std::string shape = "b " + std::to_string(b) + " parts " + std::to_string(parts) + " topk " +
                                      std::to_string(topk) + " extra " + std::to_string(extra) + " f " +
                                      std::to_string(f);
            const HostPlan h = make_plan(p);
            bool none_cut = true;
            for (int i = 0; i < b; ++i) none_cut = none_cut && h.num_splits[i + 1] - h.num_splits[i] == 1;
            const PlanUniformChoice c = plan_uniform_choice(p);
            ASSERT_TRUE(c.ok) << shape;
            EXPECT_EQ(c.whole, none_cut) << shape;
            std::vector<int32_t> rows(size_t(parts) * kPlanRowInts);
            for (int j = 0; j < parts; ++j)
              *reinterpret_cast<PlanRow*>(rows.data() + j * kPlanRowInts) =
                  plan_even_row(b, request_blocks(p, 0), c.even_k > 0 ? c.even_k : 1, j);
            EXPECT_EQ(c.even_k > 0, c.even_k > 0 && h.rows == rows) << shape;
            if (c.even_k > 0)
              for (int i = 0; i <= b; ++i) EXPECT_EQ(h.num_splits[i], i * c.even_k) << shape;
            ++(none_cut ? whole : split);
            even += c.even_k > 0;
            pairs += c.even_k == 2;
          }
  EXPECT_GT(whole, 100);
  EXPECT_GT(split, 100);
  EXPECT_GT(even, 100);
  EXPECT_GT(pairs, 20);
  SparseDecodeParams sp;  // the benchmark's V3.2 shapes on 132 SMs
  sp.b = 128, sp.s_q = 1, sp.h_q = 16, sp.topk = 2048;
  sp.split.num_sm_parts = 132;
  EXPECT_TRUE(plan_uniform_choice(sparse_plan_params(sp)).whole);
  sp.b = 64, sp.h_q = 32;
  EXPECT_FALSE(plan_uniform_choice(sparse_plan_params(sp)).whole);
  EXPECT_EQ(plan_uniform_choice(sparse_plan_params(sp)).even_k, 2) << "halves, in pairs of parts";
  sp.b = 128, sp.h_q = 128, sp.split.num_sm_parts = 66;
  EXPECT_TRUE(plan_uniform_choice(sparse_plan_params(sp)).whole);
  const std::vector<int32_t> lens(128, 2048);
  DecodePlanParams with_lengths = sparse_plan_params(sp);
  with_lengths.topk_length = lens.data();
  EXPECT_FALSE(plan_uniform_choice(with_lengths).ok) << "per-request lengths: only the device knows them";
  EXPECT_FALSE(plan_uniform_choice(with_lengths).whole);
  with_lengths.topk_length = nullptr, with_lengths.extra_topk = 64, with_lengths.extra_topk_length = lens.data();
  EXPECT_FALSE(plan_uniform_choice(with_lengths).whole);
  with_lengths.extra_topk_length = nullptr, with_lengths.b = 0;
  EXPECT_FALSE(plan_uniform_choice(with_lengths).whole) << "no requests";
}

// What a part runs: its blocks (an empty request charged one) plus f per piece, continuing pieces
// included; 0 for an idle part.
long long part_cost(const HostPlan& h, int part) {
  const DecodePlanParams& p = h.params;
  const PlanRow& r = reinterpret_cast<const PlanRow*>(h.rows.data())[part];
  if (r.begin_req >= p.b) return 0;
  long long cost = 0;
  for (int k = 0; k <= r.end_req - r.begin_req; ++k) {
    const PlanPiece pc = plan_piece(r, h.num_splits.data(), k, request_blocks(p, r.begin_req + k));
    const int run = pc.block_end - pc.block_begin;
    cost += std::max(run, request_blocks(p, pc.req) == 0 ? 1 : 0) + plan_fixed(p);
  }
  return cost;
}

// The most any part runs.
long long longest_part(const HostPlan& h) {
  long long most = 0;
  for (int part = 0; part < h.params.num_sm_parts; ++part) most = std::max(most, part_cost(h, part));
  return most;
}

TEST(Plan, EvenSplitOfUniformRequests) {
  // 64 requests of 32 blocks over 132 parts (V3.2 at 32 heads, f = 2): the line's width 17 would
  // give parts of 15 and 17 blocks; the even split gives 128 parts one half of a request each.
  DecodePlanParams p;
  p.b = 64, p.num_sm_parts = 132, p.topk = 2048, p.fixed_cost = kPlanFewRowsFixedBlocks;
  HostPlan h = make_plan(p);
  for (int part = 0; part < 132; ++part) {
    const std::vector<int32_t> row(h.rows.begin() + part * 8, h.rows.begin() + part * 8 + 7);
    if (part < 128)
      EXPECT_EQ(row, (std::vector<int32_t>{part / 2, part / 2, part % 2 * 16, part % 2 * 16 + 16, part % 2, 1, 1}))
          << "part " << part;
    else
      EXPECT_EQ(row[0], 64) << "part " << part << " is idle";
  }
  for (int i = 0; i <= 64; ++i) EXPECT_EQ(h.num_splits[i], 2 * i);
  expect_covers_exactly(h);
  EXPECT_EQ(longest_part(h), 18);

  // Over many uniform shapes: the plan never runs a part longer than the line's plan of the same
  // lengths (given as topk_length, which the even split does not take), and shorter wherever the
  // even split is taken.
  int taken = 0;
  for (int parts : {7, 33, 66, 132})
    for (int topk : {64, 200, 1024, 2048, 8192})
      for (int f : {kPlanFewRowsFixedBlocks, kPlanFixedOverheadBlocks})
        for (int b = 1; b <= parts; ++b) {
          DecodePlanParams u;
          u.b = b, u.num_sm_parts = parts, u.topk = topk, u.fixed_cost = f;
          const HostPlan even = make_plan(u);
          const std::vector<int32_t> lens(b, topk);
          DecodePlanParams l = u;
          l.topk_length = lens.data();
          const HostPlan line = make_plan(l);
          expect_covers_exactly(even);
          const bool split_evenly = even.rows != line.rows;
          taken += split_evenly;
          if (split_evenly)
            EXPECT_LT(longest_part(even), longest_part(line)) << "b " << b << " parts " << parts << " topk " << topk;
          else
            EXPECT_EQ(even.num_splits, line.num_splits);
        }
  EXPECT_GT(taken, 50);
}

TEST(Plan, EachPartAloneMakesTheSameRow) {
  // An attention kernel that plans for itself makes num_splits and its own part's row only: on
  // random dense and sparse batches that row and num_splits equal the whole plan's.
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int b = 1 + int(rng() % 300);
    std::vector<int32_t> lens(b);
    for (auto& l : lens) l = rng() % 6 == 0 ? 0 : int(rng() % 9000);
    DecodePlanParams p;
    p.b = b;
    p.num_sm_parts = 1 + int(rng() % 132);
    p.fixed_cost = 1 + (trial / 2) % kPlanFixedOverheadBlocks;
    if (trial % 2) {
      p.topk = 1 + int(rng() % 2048);
      p.topk_length = lens.data();
      for (auto& l : lens) l %= p.topk + 1;
    } else {
      p.seqlens_k = lens.data();
    }
    const HostPlan whole = make_plan(p);
    for (int part = 0; part < p.num_sm_parts; ++part) {
      std::vector<int32_t> rows(p.num_sm_parts * kPlanRowInts, -5), ns(b + 1, -5);
      DecodePlanParams own = p;
      own.tile_scheduler_metadata = rows.data();
      own.num_splits = ns.data();
      plan_decode_host_part(own, part);
      ASSERT_EQ(std::vector<int32_t>(rows.begin() + part * 8, rows.begin() + part * 8 + 8),
                std::vector<int32_t>(whole.rows.begin() + part * 8, whole.rows.begin() + part * 8 + 8))
          << "trial " << trial << " part " << part;
      ASSERT_EQ(ns, whole.num_splits) << "trial " << trial;
      if (part + 1 < p.num_sm_parts) ASSERT_EQ(rows[(part + 1) * 8], -5) << "other rows are left alone";
    }
  }
}

TEST(Plan, InvariantDivisionIsExact) {
  // The device planner's division by an invariant width: a / d for every 32-bit a, checked at the
  // edges (0, multiples of d and their neighbours, 2^31, 2^32 - 1) and at random, for small, odd,
  // power-of-two and huge divisors.
  std::mt19937_64 rng(11);
  std::vector<unsigned> divisors = {1, 2, 3, 5, 6, 7, 63, 64, 65, 641, 6700417, 0x7fffffffu, 0x80000000u, 0xfffffffeu, 0xffffffffu};
  for (int k = 0; k < 2000; ++k) divisors.push_back(1u + unsigned(rng() >> (33 + rng() % 31)));
  for (unsigned d : divisors) {
    const PlanInvariantDiv div(d);
    std::vector<unsigned long long> as = {0, 1, 2, 0x7fffffffULL, 0x80000000ULL, 0xfffffffeULL, 0xffffffffULL};
    for (unsigned long long q : {1ULL, 2ULL, 3ULL, 0xffffffffULL / d, 0xffffffffULL / d - 1})
      for (long long e : {-1LL, 0LL, 1LL}) {
        const long long a = (long long)(q * d) + e;
        if (a >= 0 && a <= 0xffffffffLL) as.push_back((unsigned long long)a);
      }
    for (int k = 0; k < 200; ++k) as.push_back(rng() >> (32 + rng() % 32));
    for (unsigned long long a : as) ASSERT_EQ(div((long long)a), (long long)(a / d)) << a << " / " << d;
  }
}

TEST(Plan, IdlePartsWhenThereIsLittleWork) {
  // One 1-block request over 6 parts: W = ceil(6 / 6) = 1, its block is unit 5, so part 5 runs it
  // whole and parts 0-4 are idle (begin_req = b).
  const std::vector<int32_t> lens = {10};
  DecodePlanParams p;
  p.b = 1;
  p.num_sm_parts = 6;
  p.seqlens_k = lens.data();
  const HostPlan h = make_plan(p);
  for (int part = 0; part < 5; ++part) EXPECT_EQ(h.rows[part * 8], 1) << "part " << part;
  EXPECT_EQ(std::vector<int32_t>(h.rows.begin() + 40, h.rows.begin() + 47),
            (std::vector<int32_t>{0, 0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(h.num_splits, (std::vector<int32_t>{0, 1}));
}

// Walks a plan the way the kernels do and checks every block of every request is run exactly once,
// by the pieces num_splits promises, with whole requests written directly.
void expect_covers_exactly(const HostPlan& h) {
  const DecodePlanParams& p = h.params;
  std::vector<std::vector<int>> seen(p.b);
  std::vector<int> pieces(p.b, 0);
  std::vector<std::vector<int>> split_ids(p.b);
  for (int b = 0; b < p.b; ++b) seen[b].assign(request_blocks(p, b), 0);
  const auto* rows = reinterpret_cast<const PlanRow*>(h.rows.data());
  for (int part = 0; part < p.num_sm_parts; ++part) {
    const PlanRow& r = rows[part];
    if (r.begin_req >= p.b) continue;
    for (int k = 0; k <= r.end_req - r.begin_req; ++k) {
      const PlanPiece pc = plan_piece(r, h.num_splits.data(), k, request_blocks(p, r.begin_req + k));
      for (int blk = pc.block_begin; blk < pc.block_end; ++blk) ++seen[pc.req][blk];
      ++pieces[pc.req];
      const int n = h.num_splits[pc.req + 1] - h.num_splits[pc.req];
      EXPECT_EQ(pc.is_split, n > 1) << "request " << pc.req;
      if (pc.is_split) split_ids[pc.req].push_back(pc.split_index);
    }
  }
  EXPECT_EQ(h.num_splits[0], 0);
  EXPECT_LE(h.num_splits[p.b], p.b + p.num_sm_parts - 1);
  for (int b = 0; b < p.b; ++b) {
    for (int blk = 0; blk < int(seen[b].size()); ++blk) EXPECT_EQ(seen[b][blk], 1) << "request " << b << " block " << blk;
    const int n = h.num_splits[b + 1] - h.num_splits[b];
    EXPECT_GE(n, 1);
    EXPECT_EQ(pieces[b], n) << "request " << b;
    if (n > 1) {
      // Pieces write distinct workspace rows num_splits[b] .. num_splits[b+1]-1.
      std::vector<int> want;
      for (int k = 0; k < n; ++k) want.push_back(h.num_splits[b] + k);
      EXPECT_EQ(split_ids[b], want) << "request " << b;
    }
  }
  EXPECT_NO_THROW(check_plan_matches(p));
}

// A fresh plan is also balanced: no part costs more than W + overhead (its blocks, an empty
// request's one, plus the fixed cost of each piece), the bound of FlashMLA's greedy fill.
void expect_balanced(const HostPlan& h) {
  const DecodePlanParams& p = h.params;
  const int f = plan_fixed(p);
  long long total = 0;
  for (int b = 0; b < p.b; ++b) total += plan_units(request_blocks(p, b), f);
  const long long bound = (total + p.num_sm_parts - 1) / p.num_sm_parts + f;
  for (int part = 0; part < p.num_sm_parts; ++part) EXPECT_LE(part_cost(h, part), bound) << "part " << part;
}

// The plan of a dense batch with these lengths over num_sm_parts parts, at this fixed cost per
// piece, covers every block exactly once and is balanced.
void expect_sound_dense_plan(const std::vector<int32_t>& lens, int num_sm_parts,
                             int fixed_cost = kPlanFixedOverheadBlocks) {
  DecodePlanParams p;
  p.b = int(lens.size());
  p.num_sm_parts = num_sm_parts;
  p.seqlens_k = lens.data();
  p.fixed_cost = fixed_cost;
  const HostPlan h = make_plan(p);
  expect_covers_exactly(h);
  expect_balanced(h);
}

TEST(Plan, DenseInvariantsOnRandomBatches) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> lens(1 + rng() % 200);
    for (auto& l : lens) l = rng() % 5 == 0 ? 0 : int(rng() % 20000);
    // every fixed cost the planner takes
    expect_sound_dense_plan(lens, 1 + int(rng() % 140), 1 + trial % kPlanFixedOverheadBlocks);
  }
}

TEST(Plan, BalancedOnSmallBatchesOfWholePages) {
  // Few requests of whole or nearly whole pages, some empty, over few parts: where a wider width
  // cuts no request but would pile whole requests into one part, the planner must not take it.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<int32_t> lens(1 + rng() % 12);
    for (auto& l : lens) l = rng() % 3 == 0 ? 0 : 64 * (1 + int(rng() % 12)) - int(rng() % 64);
    expect_sound_dense_plan(lens, 1 + int(rng() % 16));
    if (::testing::Test::HasFailure()) break;
  }
}

TEST(Plan, SparseInvariantsWithLengthsAndExtraCache) {
  std::mt19937 rng(2);
  for (int trial = 0; trial < 300; ++trial) {
    const int b = 1 + int(rng() % 100);
    std::vector<int32_t> topk_len(b), extra_len(b);
    DecodePlanParams p;
    p.b = b;
    p.num_sm_parts = 1 + int(rng() % 70);
    p.topk = 1 + int(rng() % 3000);
    for (auto& l : topk_len) l = int(rng() % (p.topk + 20));  // > topk is clamped
    if (trial % 2) p.topk_length = topk_len.data();
    if (trial % 3) {
      p.extra_topk = 1 + int(rng() % 1500);
      for (auto& l : extra_len) l = int(rng() % (p.extra_topk + 1));
      if (trial % 4 < 2) p.extra_topk_length = extra_len.data();
    }
    const HostPlan h = make_plan(p);
    expect_covers_exactly(h);
    expect_balanced(h);
    for (int i = 0; i < b; ++i) {
      EXPECT_EQ(sparse_main_blocks(p, i), std::max(1, (sparse_main_len(p, i) + 63) / 64));
      EXPECT_EQ(request_blocks(p, i), sparse_main_blocks(p, i) + (sparse_extra_len(p, i) + 63) / 64);
    }
  }
}

TEST(Plan, ZeroLengthRequestsGetOneWholePiece) {
  const std::vector<int32_t> lens = {0, 0, 0};
  DecodePlanParams p;
  p.b = 3;
  p.num_sm_parts = 4;
  p.seqlens_k = lens.data();
  const HostPlan h = make_plan(p);
  EXPECT_EQ(h.num_splits, (std::vector<int32_t>{0, 1, 2, 3}));
  expect_covers_exactly(h);
}

TEST(Plan, PlanForOtherLengthsStillCoversEveryBlock) {
  // Engines reuse one plan for every layer of a step; if the lengths change under it, every block
  // must still be run exactly once (first pieces start at 0, last pieces run to the end).
  std::vector<int32_t> lens = {300, 5000, 70};
  DecodePlanParams p;
  p.b = 3;
  p.num_sm_parts = 6;
  p.seqlens_k = lens.data();
  HostPlan h = make_plan(p);
  ASSERT_GT(h.num_splits[2] - h.num_splits[1], 2) << "request 1 must be split for this test";
  for (const std::vector<int32_t>& now : {std::vector<int32_t>{100, 100, 100}, {9000, 20000, 0}, {0, 0, 0},
                                          {64, 64 * 13 + 1, 1}}) {
    lens = now;
    expect_covers_exactly(h);
  }
}

TEST(Plan, PlanOfAnotherBatchIsRejected) {
  std::vector<int32_t> lens(8, 4000);
  DecodePlanParams p;
  p.b = 8;
  p.num_sm_parts = 12;
  p.seqlens_k = lens.data();
  HostPlan h = make_plan(p);
  DecodePlanParams smaller = h.params;
  smaller.b = 4;  // the first 5 entries of num_splits, the rows of an 8-request plan
  try {
    check_plan_matches(smaller);
    FAIL() << "a plan for 8 requests must not run a batch of 4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("another batch"), std::string::npos) << e.what();
  }
}

TEST(Plan, PiecesOfAnyRowStayInsideTheRequest) {
  // Whatever a (foreign or garbage) row holds, a piece never names blocks outside the request.
  std::mt19937 rng(5);
  const std::vector<int32_t> num_splits = {0, 3, 4, 9};
  for (int trial = 0; trial < 20000; ++trial) {
    PlanRow r;
    auto any = [&] { return int(rng() % 200) - 100; };
    r.begin_req = int(rng() % 3), r.end_req = r.begin_req + int(rng() % (3 - r.begin_req));
    r.begin_block = any(), r.end_block = any(), r.begin_split = any();
    r.first_split = int(rng() % 2), r.last_split = int(rng() % 2), r.batch = 3;
    const int total = int(rng() % 40);
    for (int k = 0; k <= r.end_req - r.begin_req; ++k) {
      const PlanPiece pc = plan_piece(r, num_splits.data(), k, total);
      ASSERT_LE(0, pc.block_begin);
      ASSERT_LE(pc.block_begin, pc.block_end);
      ASSERT_LE(pc.block_end, total);
    }
  }
}

TEST(Plan, NegativeLengthNamesTheArgument) {
  const std::vector<int32_t> lens = {10, -3};
  DecodePlanParams p;
  p.b = 2;
  p.num_sm_parts = 2;
  p.seqlens_k = lens.data();
  try {
    make_plan(p);
    FAIL() << "negative length accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache_seqlens[1]"), std::string::npos) << e.what();
  }
}

TEST(Plan, PartsCount) {
  EXPECT_EQ(num_sm_parts_dense(132, 1, 128, 1), 66);  // FlashMLA's H800 example
  EXPECT_EQ(num_sm_parts_dense(132, 1, 16, 1), 132);
  EXPECT_EQ(num_sm_parts_dense(132, 2, 128, 1), 33);
  EXPECT_EQ(num_sm_parts_dense(4, 4, 128, 8), 1);
  EXPECT_EQ(num_sm_parts_sparse(132, 2, 128), 33);
  EXPECT_EQ(num_sm_parts_sparse(132, 1, 16), 132);
  EXPECT_EQ(num_sm_parts_dense(132, 65536, 65536, 1), 1);  // 2^32 rows: counted in 64 bits, no division by 0
}

}  // namespace
}  // namespace mla
