// The device planner and combine kernel against their host counterparts. Needs a GPU; skipped with
// exit code 77 (ctest: skipped) on machines without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "mla/dispatch.h"
#include "mla/formats.h"
#include "mla/mla.h"
#include "mla/reference.h"
#include "../../src/cuda/common/plan_block.cuh"
#include "../../src/cuda/sm90/kv_tensor_map.h"

namespace mla {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

namespace {


#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

template <typename T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  if (cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

// The general planner over every row (256 threads, as the planner kernel), where plan_decode would
// take the fast one.
__global__ void general_plan_kernel(DecodePlanParams p) {
  using Planner = cuda::BlockPlanner<256>;
  __shared__ Planner::Scratch scratch;
  extern __shared__ unsigned long long part_cost[];
  Planner::run_general(p, -1, scratch, part_cost);
}

TEST(CudaPlan, EqualsHostPlan) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    // Trial 0: many rounds of the planner's threads. Trials 2 (dense) and 3 (sparse, equal
    // requests): a line of about 6.7e9 units, past 2^32, which the fast planners must leave to the
    // general one (in 32 bits it would wrap). Trials 6 and 7: a line just under 2^31 units, the fast
    // planners' largest. Every third trial from 1 runs the general planner over every row. Sparse
    // trials go without topk_length or extra_topk_length at random: with neither, every request
    // has the same blocks and plan_decode makes the plan in closed form.
    const int b = trial == 0 ? 13000 : trial == 2 || trial == 3 ? 200 : trial == 6 || trial == 7 ? 63 : 1 + int(rng() % 3000);
    const bool huge = trial == 2 || trial == 3 || trial == 6 || trial == 7, general = trial % 3 == 1;
    std::vector<int32_t> lens(b), topk_len(b), extra_len(b);
    for (auto& l : lens) l = huge ? 0x7fffffff - int(rng() % 100000) : rng() % 7 == 0 ? 0 : int(rng() % 40000);
    DecodePlanParams p;
    p.b = b;
    p.num_sm_parts = 1 + int(rng() % 132);
    p.fixed_cost = 1 + (trial / 2) % kPlanFixedOverheadBlocks;  // every fixed cost, dense and sparse
    const bool sparse = trial % 2;
    const bool main_lens = !huge && rng() % 2, extra_lens = rng() % 2;
    if (sparse) {
      p.topk = huge ? 0x7fffffff - int(rng() % 100000) : 1 + int(rng() % 4096);
      for (auto& l : topk_len) l = int(rng() % (p.topk + 1));
      p.extra_topk = trial % 4 == 1 ? 1 + int(rng() % 1024) : 0;
      for (auto& l : extra_len) l = int(rng() % (p.extra_topk + 1));
    }
    std::vector<int32_t> rows(p.num_sm_parts * kPlanRowInts), ns(b + 1);
    DecodePlanParams host = p;
    if (sparse) {
      host.topk_length = main_lens ? topk_len.data() : nullptr;
      host.extra_topk_length = p.extra_topk && extra_lens ? extra_len.data() : nullptr;
    } else {
      host.seqlens_k = lens.data();
    }
    host.tile_scheduler_metadata = rows.data();
    host.num_splits = ns.data();
    plan_decode_host(host);

    DecodePlanParams dev = host;
    int32_t* d_lens = to_device(lens);
    int32_t* d_topk = to_device(topk_len);
    int32_t* d_extra = to_device(extra_len);
    int32_t* d_rows = to_device(std::vector<int32_t>(rows.size(), -9));
    int32_t* d_ns = to_device(std::vector<int32_t>(ns.size(), -9));
    dev.seqlens_k = sparse ? nullptr : d_lens;
    dev.topk_length = host.topk_length ? d_topk : nullptr;
    dev.extra_topk_length = host.extra_topk_length ? d_extra : nullptr;
    dev.tile_scheduler_metadata = d_rows;
    dev.num_splits = d_ns;
    if (general) {
      general_plan_kernel<<<1, 256, cuda::BlockPlanner<256>::part_cost_bytes(p.num_sm_parts)>>>(dev);
      CUDA_OK(cudaGetLastError());
    } else {
      CUDA_OK(cuda::plan_decode(dev, nullptr));
    }
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(to_host(d_rows, rows.size()), rows) << "trial " << trial << (general ? " (general planner)" : "");
    EXPECT_EQ(to_host(d_ns, ns.size()), ns) << "trial " << trial << (general ? " (general planner)" : "");
    for (void* ptr : {(void*)d_lens, (void*)d_topk, (void*)d_extra, (void*)d_rows, (void*)d_ns}) cudaFree(ptr);
  }
}

// Every CTA plans for itself, as an attention kernel that plans in its prologue: 384 threads (the
// small-heads sparse kernel's), two CTAs per part (s_q = 2) storing the same row. `general`: the
// general planner even where the fast one applies.
__global__ void self_plan_kernel(DecodePlanParams p, bool general) {
  using Planner = cuda::BlockPlanner<384>;
  __shared__ Planner::Scratch scratch;
  extern __shared__ unsigned long long part_cost[];
  if (general) Planner::run_general(p, int(blockIdx.x), scratch, part_cost);
  else Planner::plan(p, int(blockIdx.x), scratch, part_cost);
}

TEST(CudaPlan, EachCtaMakesItsOwnRow) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 150; ++trial) {
    // Trial 0: several rounds of 384; trials 2 (dense) and 3 (sparse, equal requests): a line past
    // 2^32 units (the fast planners must decline it); trials 6 and 7: just under 2^31 (their
    // largest); every third trial from 1 runs the general planner on an ordinary batch. Sparse
    // trials go without topk_length at random (every request the same blocks: the closed form,
    // with an extra cache at times).
    const int b = trial == 0 ? 2000 : trial == 2 || trial == 3 ? 200 : trial == 6 || trial == 7 ? 63 : 1 + int(rng() % 700);
    const bool huge = trial == 2 || trial == 3 || trial == 6 || trial == 7, general = trial % 3 == 1;
    std::vector<int32_t> lens(b), topk_len(b);
    for (auto& l : lens) l = huge ? 0x7fffffff - int(rng() % 100000) : rng() % 7 == 0 ? 0 : int(rng() % 20000);
    DecodePlanParams p;
    p.b = b;
    p.num_sm_parts = 1 + int(rng() % 132);
    p.fixed_cost = 1 + (trial / 2) % kPlanFixedOverheadBlocks;
    const bool sparse = trial % 2, main_lens = !huge && rng() % 2;
    if (sparse) {
      p.topk = huge ? 0x7fffffff - int(rng() % 100000) : 1 + int(rng() % 2048);
      p.extra_topk = !huge && rng() % 3 == 0 ? 1 + int(rng() % 1024) : 0;
      for (auto& l : topk_len) l = int(rng() % (p.topk + 1));
    }
    std::vector<int32_t> rows(p.num_sm_parts * kPlanRowInts), ns(b + 1);
    DecodePlanParams host = p;
    if (sparse) host.topk_length = main_lens ? topk_len.data() : nullptr;
    else host.seqlens_k = lens.data();
    host.tile_scheduler_metadata = rows.data();
    host.num_splits = ns.data();
    plan_decode_host(host);

    DecodePlanParams dev = host;
    int32_t* d_len = to_device(sparse ? topk_len : lens);
    int32_t* d_rows = to_device(std::vector<int32_t>(rows.size(), -9));
    int32_t* d_ns = to_device(std::vector<int32_t>(ns.size(), -9));
    dev.seqlens_k = sparse ? nullptr : d_len;
    dev.topk_length = host.topk_length ? d_len : nullptr;
    dev.tile_scheduler_metadata = d_rows;
    dev.num_splits = d_ns;
    const size_t smem = cuda::BlockPlanner<384>::part_cost_bytes(p.num_sm_parts);
    self_plan_kernel<<<dim3(unsigned(p.num_sm_parts), 2), 384, smem>>>(dev, general);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(to_host(d_rows, rows.size()), rows) << "trial " << trial << (general ? " (general planner)" : "");
    EXPECT_EQ(to_host(d_ns, ns.size()), ns) << "trial " << trial << (general ? " (general planner)" : "");
    for (void* ptr : {(void*)d_len, (void*)d_rows, (void*)d_ns}) cudaFree(ptr);
  }
}

// One CTA plans for part `only` alone, as the attention kernels' CTAs do, with nobody else writing.
__global__ void lone_plan_kernel(DecodePlanParams p, int only) {
  using Planner = cuda::BlockPlanner<384>;
  __shared__ Planner::Scratch scratch;
  extern __shared__ unsigned long long part_cost[];
  Planner::plan(p, only, scratch, part_cost);
}

// A CTA of a call with uniform requests (the closed-form planner) that plans for its part alone
// writes its row and every num_splits entry its pieces read ([begin_req, end_req + 1]) as the host
// plan has them, and past those only its share of the entries (index % num_sm_parts == its part),
// so that the parts together write each entry without all of them writing all b + 1.
TEST(CudaPlan, ACtaAloneWritesTheSplitsItReads) {
  std::mt19937 rng(11);
  int kinds[3] = {0, 0, 0};  // whole, cut, even split
  for (int trial = 0; trial < 300; ++trial) {
    DecodePlanParams p;
    p.b = 1 + int(rng() % (trial % 2 ? 80 : 600));
    p.num_sm_parts = 1 + int(rng() % 132);
    p.fixed_cost = 1 + trial % kPlanFixedOverheadBlocks;
    p.topk = 1 + int(rng() % 4096);
    p.extra_topk = rng() % 4 == 0 ? 1 + int(rng() % 1024) : 0;
    const PlanUniformChoice choice = plan_uniform_choice(p);
    ASSERT_TRUE(choice.ok);
    ++kinds[choice.even_k > 0 ? 2 : choice.whole ? 0 : 1];
    std::vector<int32_t> rows(p.num_sm_parts * kPlanRowInts), ns(p.b + 1);
    DecodePlanParams host = p;
    host.tile_scheduler_metadata = rows.data();
    host.num_splits = ns.data();
    plan_decode_host(host);

    const int only = int(rng() % p.num_sm_parts);
    DecodePlanParams dev = p;
    int32_t* d_rows = to_device(std::vector<int32_t>(rows.size(), -9));
    int32_t* d_ns = to_device(std::vector<int32_t>(ns.size(), -9));
    dev.tile_scheduler_metadata = d_rows;
    dev.num_splits = d_ns;
    lone_plan_kernel<<<1, 384, cuda::BlockPlanner<384>::part_cost_bytes(p.num_sm_parts)>>>(dev, only);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    const auto got_rows = to_host(d_rows, rows.size());
    const auto got_ns = to_host(d_ns, ns.size());
    const std::string what = "trial " + std::to_string(trial) + ", b " + std::to_string(p.b) + ", parts " +
                             std::to_string(p.num_sm_parts) + ", part " + std::to_string(only);
    for (int x = 0; x < kPlanRowInts; ++x)
      EXPECT_EQ(got_rows[only * kPlanRowInts + x], rows[only * kPlanRowInts + x]) << what << ", row field " << x;
    const PlanRow& row = reinterpret_cast<const PlanRow*>(rows.data())[only];
    const bool busy = row.begin_req < p.b && row.end_req >= row.begin_req;
    for (int i = 0; i <= p.b; ++i) {
      const bool read = busy && i >= row.begin_req && i <= row.end_req + 1, share = i % p.num_sm_parts == only;
      if (read || share) EXPECT_EQ(got_ns[i], ns[i]) << what << ", num_splits[" << i << "]";
      else if (busy) EXPECT_EQ(got_ns[i], -9) << what << ": num_splits[" << i << "] is neither read nor its share";
    }
    for (void* ptr : {(void*)d_rows, (void*)d_ns}) cudaFree(ptr);
  }
  for (int k = 0; k < 3; ++k) EXPECT_GT(kinds[k], 10) << "plan kind " << k << " (whole, cut, even) too rare";
}

// Plans these lengths over `parts` parts, fills the partials at random (a split with lse -inf gets a
// NaN row: it has weight 0 and must add nothing) and checks the device combine against the host's.
void expect_combine_matches_host(const std::vector<int32_t>& lens, int s_q, int h_q, int parts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  const int b = int(lens.size());
  std::vector<int32_t> rows(parts * kPlanRowInts), ns(b + 1);
  DecodePlanParams pp;
  pp.b = b, pp.num_sm_parts = parts, pp.seqlens_k = lens.data();
  pp.tile_scheduler_metadata = rows.data(), pp.num_splits = ns.data();
  plan_decode_host(pp);
  ASSERT_GT(ns[b], b) << "the test needs split requests";

  const size_t acc_rows = size_t(b + parts) * s_q * h_q;
  std::vector<float> o_accum(acc_rows * kHeadDimV), lse_accum(acc_rows), sink(h_q);
  for (size_t r = 0; r < acc_rows; ++r) {
    lse_accum[r] = rng() % 9 == 0 ? -INFINITY : 3.f * dist(rng);
    for (int x = 0; x < kHeadDimV; ++x) o_accum[r * kHeadDimV + x] = std::isinf(lse_accum[r]) ? NAN : dist(rng);
  }
  for (int h = 0; h < h_q; ++h) sink[h] = h == 0 ? INFINITY : h == 1 ? -INFINITY : dist(rng);

  CombineParams p;
  p.b = b, p.s_q = s_q, p.h_q = h_q;
  p.split = {parts, rows.data(), ns.data(), o_accum.data(), lse_accum.data()};
  const size_t out_n = size_t(b) * s_q * h_q * kHeadDimV;
  std::vector<uint16_t> out(out_n, 0);
  std::vector<float> lse(size_t(b) * s_q * h_q, 0.f);
  p.o.out = out.data();
  p.o.out_stride_b = s_q * h_q * kHeadDimV, p.o.out_stride_s = h_q * kHeadDimV, p.o.out_stride_h = kHeadDimV;
  p.o.lse = lse.data();
  p.o.lse_stride_b = s_q * h_q, p.o.lse_stride_s = h_q, p.o.lse_stride_h = 1;
  p.attn_sink = sink.data();
  reference::combine(p);

  CombineParams d = p;
  d.split.tile_scheduler_metadata = to_device(rows);
  d.split.num_splits = to_device(ns);
  d.split.o_accum = to_device(o_accum);
  d.split.lse_accum = to_device(lse_accum);
  d.o.out = to_device(std::vector<uint16_t>(out_n, 0));
  d.o.lse = to_device(std::vector<float>(lse.size(), 0.f));
  d.attn_sink = to_device(sink);
  CUDA_OK(cuda::combine(d, nullptr, /*pdl=*/true));
  CUDA_OK(cudaDeviceSynchronize());
  const auto got_out = to_host(static_cast<uint16_t*>(d.o.out), out_n);
  const auto got_lse = to_host(d.o.lse, lse.size());
  int split_rows = 0, failures = 0;
  for (int i = 0; i < b && failures < 20; ++i) {
    const bool split = ns[i + 1] - ns[i] > 1;
    for (int s = 0; s < s_q; ++s)
      for (int h = 0; h < h_q; ++h) {
        const size_t row = (size_t(i) * s_q + s) * h_q + h;
        if (!split) {
          EXPECT_EQ(got_lse[row], 0.f) << "whole requests are not the combine's to write";
          continue;
        }
        ++split_rows;
        if (std::isinf(lse[row])) {
          EXPECT_EQ(got_lse[row], lse[row]);
        } else {
          EXPECT_NEAR(got_lse[row], lse[row], 1e-5f * (1.f + std::fabs(lse[row])));
        }
        for (int x = 0; x < kHeadDimV; ++x) {
          const float want = bf16_to_float(out[row * kHeadDimV + x]);
          const float got = bf16_to_float(got_out[row * kHeadDimV + x]);
          const bool ok = std::fabs(got - want) <= 1e-5f + std::fabs(want) / 128;  // false for NaN
          EXPECT_TRUE(ok) << "request " << i << " row " << s << " head " << h << " col " << x << ": " << got
                          << " against " << want;
          failures += !ok;
        }
      }
  }
  EXPECT_GT(split_rows, 0);
  for (const void* ptr : {(const void*)d.split.tile_scheduler_metadata, (const void*)d.split.num_splits,
                          (const void*)d.split.o_accum, (const void*)d.split.lse_accum, (const void*)d.o.out, (const void*)d.o.lse,
                          (const void*)d.attn_sink})
    cudaFree(const_cast<void*>(ptr));
}

TEST(CudaCombine, MatchesHostCombine) {
  std::mt19937 rng(4);
  std::vector<int32_t> lens(9);
  for (auto& l : lens) l = int(rng() % 6000);
  lens[2] = 0;
  expect_combine_matches_host(lens, /*s_q=*/2, /*h_q=*/19, /*parts=*/23, 5);
}

TEST(CudaCombine, ManySplitsOfOneLongRequest) {
  // One request over 132 parts (more splits than a warp has lanes, not a multiple of the loads in
  // flight) beside a short one, 128 heads; then 70 heads (not a multiple of a CTA's heads).
  expect_combine_matches_host({65536, 100}, 1, 128, 132, 6);
  expect_combine_matches_host({20000, 3000, 40000}, 2, 70, 101, 7);
  // The same long request among short ones, so that a warp takes two quarters (24 requests of 128
  // heads: 3072 rows), then all four (40 requests, s_q = 2: 10240 rows): batches of four and two
  // splits cross the 32-split rounds of the lse weights.
  for (int b : {24, 40}) {
    std::vector<int32_t> lens(b, 70);
    lens[b / 2] = 65536;
    expect_combine_matches_host(lens, b == 24 ? 1 : 2, 128, 132, 10 + b);
  }
}

TEST(CudaCombine, ManyRequests) {
  // 1140, 2432 and 4864 rows of 19 heads: a warp takes one, two, then all four quarters of its
  // head's columns.
  std::mt19937 rng(8);
  for (int b : {30, 64, 128}) {
    std::vector<int32_t> lens(b);
    for (auto& l : lens) l = int(rng() % 6000);
    expect_combine_matches_host(lens, /*s_q=*/2, /*h_q=*/19, /*parts=*/132, 9 + b);
  }
  // DeepSeek's decode batch: 128 requests of 128 heads over 66 parts (the dense varlen
  // benchmark's plan shape): whole requests beside requests cut into pieces.
  std::vector<int32_t> lens(128);
  for (auto& l : lens) l = 64 + int(rng() % 8192);
  expect_combine_matches_host(lens, /*s_q=*/1, /*h_q=*/128, /*parts=*/66, 140);
}

// A C++ caller's out need not put its rows on 16 bytes (an offset view, an odd row stride): dense
// decode then writes every row exactly as into an aligned out, bit for bit, and nothing between
// the rows. The sm90 kernel stores aligned rows 16 bytes a lane and others by pairs. Both outs are
// checked against the host reference too, over a cache whose unattended slots are NaN.
TEST(CudaDense, OutRowsOffSixteenBytesMatchAlignedRows) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const int b = 3, s_q = 2, h_q = 128, h_k = 1, d = 576, page = 64, parts = 7;
  const std::vector<int32_t> lens = {700, 320, 1};
  const int max_blocks = 11, num_pages = b * max_blocks;
  std::vector<int32_t> table(size_t(b) * max_blocks);
  for (size_t x = 0; x < table.size(); ++x) table[x] = int32_t((x * 7 + 3) % num_pages);  // 7 is prime to 33
  std::vector<uint16_t> cache(size_t(num_pages) * page * d, float_to_bf16(std::nanf("")));
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < lens[i]; ++t)
      for (int x = 0; x < d; ++x)
        cache[(size_t(table[i * max_blocks + t / page]) * page + t % page) * d + x] = float_to_bf16(0.3f * dist(rng));
  std::vector<uint16_t> q(size_t(b) * s_q * h_q * d);
  for (auto& v : q) v = float_to_bf16(dist(rng));

  DenseDecodeParams p;
  p.b = b, p.s_q = s_q, p.h_q = h_q, p.h_k = h_k, p.d_qk = d;
  p.page_block_size = page, p.num_blocks = num_pages, p.max_blocks_per_seq = max_blocks;
  p.softmax_scale = 1.f / 24.f, p.causal = true;
  p.q_stride_b = s_q * h_q * d, p.q_stride_s = h_q * d, p.q_stride_h = d;
  p.k_stride_block = page * d, p.k_stride_token = d, p.k_stride_head = d;
  p.block_table_stride = max_blocks;
  p.o.lse_stride_b = s_q * h_q, p.o.lse_stride_s = h_q, p.o.lse_stride_h = 1;
  std::vector<int32_t> rows(parts * kPlanRowInts), ns(b + 1);
  DecodePlanParams pp = dense_plan_params(p);
  pp.num_sm_parts = parts, pp.seqlens_k = lens.data();
  pp.tile_scheduler_metadata = rows.data(), pp.num_splits = ns.data();
  plan_decode_host(pp);
  ASSERT_GT(ns[b], b) << "the test needs split requests beside whole ones";
  int whole = 0;
  for (int i = 0; i < b; ++i) whole += ns[i + 1] - ns[i] == 1;
  ASSERT_GT(whole, 0) << "the test needs whole requests beside split ones";
  const size_t acc_rows = size_t(b + parts) * s_q * h_q, n_rows = size_t(b) * s_q * h_q;

  // Host reference into a contiguous out.
  std::vector<uint16_t> want(n_rows * kHeadDimV);
  std::vector<float> want_lse(n_rows), acc(acc_rows * kHeadDimV), acc_lse(acc_rows);
  {
    DenseDecodeParams h = p;
    h.q = q.data(), h.k_cache = cache.data(), h.block_table = table.data(), h.seqlens_k = lens.data();
    h.o.out = want.data(), h.o.lse = want_lse.data();
    h.o.out_stride_b = s_q * h_q * kHeadDimV, h.o.out_stride_s = h_q * kHeadDimV, h.o.out_stride_h = kHeadDimV;
    h.split = {parts, rows.data(), ns.data(), acc.data(), acc_lse.data()};
    reference::dense_decode(h);
  }

  DenseDecodeParams dev = p;
  dev.q = to_device(q), dev.k_cache = to_device(cache), dev.block_table = to_device(table);
  dev.seqlens_k = to_device(lens);
  dev.split = {parts, to_device(rows), to_device(ns), to_device(std::vector<float>(acc.size(), NAN)),
               to_device(std::vector<float>(acc_rows, NAN))};
  dev.o.lse = to_device(std::vector<float>(n_rows, NAN));
  const uint16_t fill = 0x7f7f;  // a finite bf16 no output takes
  // Runs the call into an out of row stride `stride_h` starting `offset` elements into its buffer;
  // returns the whole buffer.
  auto run = [&](int64_t stride_h, int offset) {
    const size_t n = size_t(offset) + n_rows * size_t(stride_h);
    uint16_t* buf = to_device(std::vector<uint16_t>(n, fill));
    DenseDecodeParams c = dev;
    c.o.out = buf + offset;
    c.o.out_stride_h = stride_h, c.o.out_stride_s = h_q * stride_h, c.o.out_stride_b = s_q * h_q * stride_h;
    EXPECT_EQ(cuda::dense_decode(c, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto host = to_host(buf, n);
    cudaFree(buf);
    return host;
  };
  const std::vector<uint16_t> aligned = run(kHeadDimV, 0);
  int failures = 0;
  for (size_t r = 0; r < n_rows && failures < 20; ++r)
    for (int x = 0; x < kHeadDimV; ++x) {
      const float w = bf16_to_float(want[r * kHeadDimV + x]), g = bf16_to_float(aligned[r * kHeadDimV + x]);
      const bool ok = std::fabs(g - w) <= 1e-4f + std::fabs(w) / 128;  // false for NaN
      EXPECT_TRUE(ok) << "row " << r << " col " << x << ": " << g << " against " << w;
      failures += !ok;
    }
  for (auto [stride_h, offset] : {std::tuple{int64_t(kHeadDimV), 2}, std::tuple{int64_t(kHeadDimV + 2), 0},
                                  std::tuple{int64_t(kHeadDimV + 4), 6}}) {
    const std::vector<uint16_t> got = run(stride_h, offset);
    for (size_t r = 0; r < n_rows; ++r) {
      const uint16_t* row = got.data() + offset + r * stride_h;
      ASSERT_TRUE(std::equal(row, row + kHeadDimV, aligned.data() + r * kHeadDimV))
          << "row " << r << ", stride " << stride_h << ", offset " << offset;
      ASSERT_TRUE(std::all_of(row + kHeadDimV, row + stride_h, [&](uint16_t v) { return v == fill; }))
          << "written past row " << r << ", stride " << stride_h;
    }
    ASSERT_TRUE(std::all_of(got.data(), got.data() + offset, [&](uint16_t v) { return v == fill; }));
  }
  // Rows off 4 bytes cannot take the pairs' stores: an error naming out, before anything runs.
  for (auto [stride_h, offset] : {std::tuple{int64_t(kHeadDimV), 1}, std::tuple{int64_t(kHeadDimV + 1), 0}}) {
    DenseDecodeParams c = dev;
    c.o.out = static_cast<uint16_t*>(const_cast<void*>(dev.q)) + offset;  // never written: the call is refused
    c.o.out_stride_h = stride_h, c.o.out_stride_s = h_q * stride_h, c.o.out_stride_b = s_q * h_q * stride_h;
    try {
      (void)cuda::dense_decode(c, nullptr);
      ADD_FAILURE() << "an out off 4 bytes must be refused (stride " << stride_h << ", offset " << offset << ")";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("out: ", 0), 0u) << e.what();
    }
  }
  for (const void* ptr : {dev.q, dev.k_cache, (const void*)dev.block_table, (const void*)dev.seqlens_k,
                          (const void*)dev.split.tile_scheduler_metadata, (const void*)dev.split.num_splits,
                          (const void*)dev.split.o_accum, (const void*)dev.split.lse_accum, (const void*)dev.o.lse})
    cudaFree(const_cast<void*>(ptr));
}

// The dense sm90 kernel loads Q through a tensor map exactly where a KV head's rows are one stride
// apart (one token, or each token's heads right after the token before's) and on 16 bytes, and
// copies the rows itself otherwise: the host encodes the map for the first kind and refuses the
// rest. Strides of dimensions of extent 1 (one row, one KV head, one request) never matter.
TEST(CudaDense, QueryTensorMapWhereRowsAreEvenlyStrided) {
  char* q = nullptr;
  CUDA_OK(cudaMalloc(&q, size_t(1) << 24));
  struct Case {
    const char* what;
    int b, s_q, h_q, h_k;
    int64_t stride_h, stride_s, stride_b;  // elements
    int offset_bytes;
    bool mapped;
  };
  const Case cases[] = {
      {"contiguous, one token", 4, 1, 128, 1, 576, 128 * 576, 128 * 576, 0, true},
      {"contiguous, two tokens", 4, 2, 128, 1, 576, 128 * 576, 256 * 576, 0, true},
      {"two KV heads, one token", 4, 1, 64, 2, 576, 64 * 576, 64 * 576, 0, true},
      {"two KV heads, two tokens: a head's next token is h_q rows on", 4, 2, 64, 2, 576, 64 * 576, 128 * 576, 0,
       false},
      {"each token's heads 8 rows short of the next token's", 4, 2, 128, 1, 576, 136 * 576, 272 * 576, 0, false},
      {"rows 584 apart, padded batches, base 16 bytes in", 4, 1, 128, 1, 584, 128 * 584, 128 * 584 + 64, 16, true},
      {"rows 577 apart", 4, 1, 128, 1, 577, 128 * 577, 128 * 577, 0, false},
      {"batches 577 rows apart", 4, 1, 128, 1, 576, 128 * 576, 128 * 576 + 1, 0, false},
      {"base 2 bytes in", 4, 1, 128, 1, 576, 128 * 576, 128 * 576, 2, false},
      {"one request, any batch stride", 1, 1, 128, 1, 576, 128 * 576, 3, 0, true},
      {"one row, any strides", 1, 1, 1, 1, 7, 9, 11, 0, true},
  };
  for (const Case& c : cases) {
    DenseDecodeParams p;
    p.b = c.b, p.s_q = c.s_q, p.h_q = c.h_q, p.h_k = c.h_k;
    p.q = q + c.offset_bytes;
    p.q_stride_h = c.stride_h, p.q_stride_s = c.stride_s, p.q_stride_b = c.stride_b;
    CUtensorMap map;
    EXPECT_EQ(cuda::sm90::encode_q_tensor_map<__nv_bfloat16>(&map, p, 576), c.mapped) << c.what;
    EXPECT_EQ(cuda::sm90::encode_q_tensor_map<__half>(&map, p, 512), c.mapped) << c.what << " (fp16, d 512)";
  }
  cudaFree(q);
}

// On a Hopper GPU dense decode over 64-token pages runs the sm90 kernel; what it lacks (FP8,
// other page sizes) and MLA_KERNELS_IMPL=portable reach the portable kernel.
TEST(CudaDispatch, DenseDecodePicksTheHopperKernelOnSm90) {
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  DenseDecodeParams p;
  p.b = 4, p.s_q = 2, p.h_q = 128, p.h_k = 1, p.page_block_size = 64, p.causal = true;
  const bool hopper = major == 9 && minor == 0;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    p.dtype = dtype;
    EXPECT_STREQ(cuda::implementation_name(OpKind::kDenseDecode, required_features(p)), hopper ? "sm90" : "portable");
  }
  // At most 32 rows per KV head: the 64-row kernel too by default; the small-rows kernel when named.
  for (auto [s_q, h_q, h_k] : {std::tuple{1, 16, 1}, std::tuple{2, 16, 1}, std::tuple{1, 64, 2}, std::tuple{1, 1, 1}}) {
    p.s_q = s_q, p.h_q = h_q, p.h_k = h_k;
    EXPECT_STREQ(cuda::implementation_name(OpKind::kDenseDecode, required_features(p)), hopper ? "sm90" : "portable")
        << s_q << " x " << h_q << " / " << h_k;
    if (hopper) {
      ASSERT_EQ(setenv("MLA_KERNELS_IMPL", "sm90_small", 1), 0);
      EXPECT_STREQ(cuda::implementation_name(OpKind::kDenseDecode, required_features(p)), "sm90_small");
      unsetenv("MLA_KERNELS_IMPL");
    }
  }
  p.s_q = 3, p.h_q = 16, p.h_k = 1;  // 48 rows
  EXPECT_STREQ(cuda::implementation_name(OpKind::kDenseDecode, required_features(p)), hopper ? "sm90" : "portable");
  p.s_q = 2, p.h_q = 128;
  p.dtype = DType::kFP8E4M3;
  EXPECT_STREQ(cuda::implementation_name(OpKind::kDenseDecode, required_features(p)), "portable");
  p.dtype = DType::kBF16, p.page_block_size = 16;
  EXPECT_STREQ(cuda::implementation_name(OpKind::kDenseDecode, required_features(p)), "portable");
  p.page_block_size = 64;
  // Sparse decode: at most 32 heads run the small-heads kernel, more the 64-head-tile one.
  SparseDecodeParams sp;
  sp.b = 4, sp.s_q = 1, sp.topk = 2048, sp.format = KvFormat::kV32;
  for (int h_q : {1, 16, 32, 48, 64, 128}) {
    sp.h_q = h_q;
    EXPECT_STREQ(cuda::implementation_name(OpKind::kSparseDecode, required_features(sp)),
                 !hopper ? "portable" : h_q <= 32 ? "sm90_small" : "sm90")
        << h_q << " heads";
  }
  ASSERT_EQ(setenv("MLA_KERNELS_IMPL", "portable", 1), 0);
  EXPECT_STREQ(cuda::implementation_name(OpKind::kDenseDecode, required_features(p)), "portable");
  unsetenv("MLA_KERNELS_IMPL");
}

}  // namespace
}  // namespace mla

int main(int argc, char** argv) {
  if (!mla::have_gpu()) {
    std::printf("mla_cuda_tests: no CUDA device on this machine; the device planner and combine tests did not run\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
