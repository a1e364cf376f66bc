// The CPU backend against brute-force loops in double precision, over several plan sizes so the
// split and combine paths run; unattended cache slots hold NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "mla/formats.h"
#include "mla/reference.h"

namespace mla {
namespace {

constexpr double kInfD = std::numeric_limits<double>::infinity();

// Plan + workspace of a decode call, owned by the test.
struct Split {
  std::vector<int32_t> rows, num_splits;
  std::vector<float> o_accum, lse_accum;
  DecodeSplit view;
};

void plan_into(Split& s, DecodePlanParams pp, int s_q, int h_q) {
  s.rows.assign(pp.num_sm_parts * kPlanRowInts, 0);
  s.num_splits.assign(pp.b + 1, 0);
  pp.tile_scheduler_metadata = s.rows.data();
  pp.num_splits = s.num_splits.data();
  plan_decode_host(pp);
  const size_t rows = size_t(pp.b + pp.num_sm_parts) * s_q * h_q;
  s.o_accum.assign(rows * kHeadDimV, std::nanf(""));
  s.lse_accum.assign(rows, std::nanf(""));
  s.view.num_sm_parts = pp.num_sm_parts;
  s.view.tile_scheduler_metadata = s.rows.data();
  s.view.num_splits = s.num_splits.data();
  s.view.o_accum = s.o_accum.data();
  s.view.lse_accum = s.lse_accum.data();
}

// Brute-force attention of one row: scores in double, softmax, sink.
struct Expected {
  std::vector<double> out;
  double lse;
};
Expected attend(const std::vector<const float*>& keys, const float* q, double scale, int d_qk, double sink) {
  Expected e{std::vector<double>(kHeadDimV, 0.0), kInfD};
  if (keys.empty()) return e;
  std::vector<double> z(keys.size());
  double m = -kInfD;
  for (size_t j = 0; j < keys.size(); ++j) {
    double acc = 0;
    for (int d = 0; d < d_qk; ++d) acc += double(q[d]) * keys[j][d];
    z[j] = acc * scale;
    m = std::max(m, z[j]);
  }
  double sum = 0;
  for (double v : z) sum += std::exp(v - m);
  e.lse = std::log(sum) + m;
  const double denom = sum + std::exp(sink - m);
  for (size_t j = 0; j < keys.size(); ++j)
    for (int d = 0; d < kHeadDimV; ++d) e.out[d] += std::exp(z[j] - m) / denom * keys[j][d];
  return e;
}

void expect_close(float got, double want, double abs_tol, double rel_tol, const char* what) {
  if (std::isinf(want)) {
    EXPECT_EQ(got, float(want)) << what;
    return;
  }
  EXPECT_LE(std::fabs(got - want), abs_tol + rel_tol * std::fabs(want)) << what << ": got " << got << " want " << want;
}

std::vector<float> bf16_values(std::mt19937& rng, size_t n, float sigma) {
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = round_bf16(std::clamp(dist(rng), -1.f, 1.f));
  return v;
}

class DenseDecode : public ::testing::TestWithParam<int> {};

TEST_P(DenseDecode, MatchesBruteForce) {
  const int num_sm_parts = GetParam();
  std::mt19937 rng(10 + num_sm_parts);
  const int b = 4, s_q = 3, h_q = 6, h_k = 2, d = 576, page = 16;
  const std::vector<int32_t> lens = {700, 0, 1500, 2};
  const int max_blocks = 1500 / page + 2;
  int num_pages = 0;
  for (int l : lens) num_pages += (l + page - 1) / page;
  num_pages += 3;  // pages no request uses
  // Shuffled block table; unused entries hold garbage.
  std::vector<int32_t> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(b * max_blocks, 2147480000);
  int next = 0;
  for (int i = 0; i < b; ++i)
    for (int j = 0; j < (lens[i] + page - 1) / page; ++j) table[i * max_blocks + j] = perm[next++];
  // Cache: NaN everywhere, then real values in the attended slots only.
  const float nan = std::nanf("");
  std::vector<uint16_t> cache(size_t(num_pages) * page * h_k * d, float_to_bf16(nan));
  std::vector<float> keyf(size_t(num_pages) * page * h_k * d, nan);
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < lens[i]; ++t)
      for (int g = 0; g < h_k; ++g) {
        const size_t base = ((size_t(table[i * max_blocks + t / page]) * page + t % page) * h_k + g) * d;
        const auto v = bf16_values(rng, d, 0.1f);
        for (int x = 0; x < d; ++x) cache[base + x] = float_to_bf16(v[x]), keyf[base + x] = v[x];
      }
  const auto qv = bf16_values(rng, size_t(b) * s_q * h_q * d, 0.5f);
  std::vector<uint16_t> q(qv.size());
  for (size_t x = 0; x < qv.size(); ++x) q[x] = float_to_bf16(qv[x]);

  for (bool causal : {false, true}) {
    DenseDecodeParams p;
    p.b = b, p.s_q = s_q, p.h_q = h_q, p.h_k = h_k, p.d_qk = d;
    p.page_block_size = page, p.num_blocks = num_pages, p.max_blocks_per_seq = max_blocks;
    p.softmax_scale = 1.f / 24.f;
    p.causal = causal;
    p.q = q.data();
    p.q_stride_b = s_q * h_q * d, p.q_stride_s = h_q * d, p.q_stride_h = d;
    p.k_cache = cache.data();
    p.k_stride_block = page * h_k * d, p.k_stride_token = h_k * d, p.k_stride_head = d;
    p.block_table = table.data();
    p.block_table_stride = max_blocks;
    p.seqlens_k = lens.data();
    std::vector<uint16_t> out(size_t(b) * s_q * h_q * kHeadDimV);
    std::vector<float> lse(size_t(b) * s_q * h_q);
    p.o.out = out.data();
    p.o.out_stride_b = s_q * h_q * kHeadDimV, p.o.out_stride_s = h_q * kHeadDimV, p.o.out_stride_h = kHeadDimV;
    p.o.lse = lse.data();
    p.o.lse_stride_b = s_q * h_q, p.o.lse_stride_s = h_q, p.o.lse_stride_h = 1;
    Split split;
    p.split.num_sm_parts = num_sm_parts;
    plan_into(split, dense_plan_params(p), s_q, h_q);
    p.split = split.view;
    reference::dense_decode(p);

    for (int i = 0; i < b; ++i)
      for (int s = 0; s < s_q; ++s)
        for (int h = 0; h < h_q; ++h) {
          const int g = h / (h_q / h_k);
          const int limit = causal ? s + lens[i] - s_q : lens[i] - 1;
          std::vector<const float*> keys;
          for (int t = 0; t <= std::min(limit, lens[i] - 1); ++t)
            keys.push_back(&keyf[((size_t(table[i * max_blocks + t / page]) * page + t % page) * h_k + g) * d]);
          const Expected e = attend(keys, &qv[((size_t(i) * s_q + s) * h_q + h) * d], 1.0 / 24, d, -kInfD);
          const size_t row = (size_t(i) * s_q + s) * h_q + h;
          expect_close(lse[row], e.lse, 1e-5, 1e-5, "lse");
          for (int x = 0; x < kHeadDimV; ++x)
            expect_close(bf16_to_float(out[row * kHeadDimV + x]), e.out[x], 1e-4, 1.0 / 128, "out");
        }
  }
}

INSTANTIATE_TEST_SUITE_P(PlanSizes, DenseDecode, ::testing::Values(1, 2, 5, 17, 64));

class SparseDecode : public ::testing::TestWithParam<std::tuple<KvFormat, int>> {};

TEST_P(SparseDecode, MatchesBruteForce) {
  const KvFormat f = std::get<0>(GetParam());
  const int num_sm_parts = std::get<1>(GetParam());
  std::mt19937 rng(20 + num_sm_parts + int(f));
  const int b = 3, s_q = 2, h_q = 5, d = head_dim_qk(f), bytes = bytes_per_token(f);
  const int page = 7, num_pages = 40, extra_page = 3, extra_pages = 50;
  const int topk = 150, extra_topk = 70;
  auto make_cache = [&](int pages, int pg) {
    return std::vector<uint8_t>(size_t(pages) * pg * bytes, 0xff);  // NaN bytes and NaN scales everywhere
  };
  std::vector<uint8_t> kv = make_cache(num_pages, page), extra = make_cache(extra_pages, extra_page);
  std::vector<int32_t> idx(size_t(b) * s_q * topk), extra_idx(size_t(b) * s_q * extra_topk);
  const std::vector<int32_t> topk_len = {150, 0, 97}, extra_len = {13, 70, 0};
  // Indices: mostly valid, some -1, some out of range, some duplicates.
  auto fill = [&](std::vector<int32_t>& ix, int k, int tokens) {
    for (auto& v : ix) {
      const int r = int(rng() % 20);
      v = r == 0 ? -1 : r == 1 ? tokens + int(rng() % 1000) : r == 2 ? -int(rng() % 100000) - 2 : int(rng() % tokens);
    }
    for (size_t row = 0; row < ix.size() / k; ++row) ix[row * k + k - 1] = ix[row * k];  // a duplicate per row
  };
  fill(idx, topk, num_pages * page);
  fill(extra_idx, extra_topk, extra_pages * extra_page);
  // Quantise every referenced token (slots within the lengths) and keep its dequantised keys.
  std::vector<float> keys_main(size_t(num_pages) * page * d), keys_extra(size_t(extra_pages) * extra_page * d);
  auto reference_token = [&](std::vector<uint8_t>& cache, std::vector<float>& keys, int pg, int tok) {
    const auto v = bf16_values(rng, d, 0.1f);
    std::vector<uint16_t> in(d);
    for (int x = 0; x < d; ++x) in[x] = float_to_bf16(v[x]);
    uint8_t* block = cache.data() + size_t(tok / pg) * pg * bytes;
    quantize_token(f, in.data(), block, pg, tok % pg);
  };
  for (int i = 0; i < b; ++i)
    for (int s = 0; s < s_q; ++s) {
      for (int k = 0; k < topk_len[i]; ++k) {
        const int tok = idx[(i * s_q + s) * topk + k];
        if (tok >= 0 && tok < num_pages * page) reference_token(kv, keys_main, page, tok);
      }
      for (int k = 0; k < extra_len[i]; ++k) {
        const int tok = extra_idx[(i * s_q + s) * extra_topk + k];
        if (tok >= 0 && tok < extra_pages * extra_page) reference_token(extra, keys_extra, extra_page, tok);
      }
    }
  // Dequantise after all writes (a MODEL1 block interleaves tokens).
  for (int tok = 0; tok < num_pages * page; ++tok)
    dequantize_token(f, kv.data() + size_t(tok / page) * page * bytes, page, tok % page, &keys_main[size_t(tok) * d]);
  for (int tok = 0; tok < extra_pages * extra_page; ++tok)
    dequantize_token(f, extra.data() + size_t(tok / extra_page) * extra_page * bytes, extra_page, tok % extra_page,
                     &keys_extra[size_t(tok) * d]);

  const auto qv = bf16_values(rng, size_t(b) * s_q * h_q * d, 0.5f);
  std::vector<uint16_t> q(qv.size());
  for (size_t x = 0; x < qv.size(); ++x) q[x] = float_to_bf16(qv[x]);
  const std::vector<float> sink = {0.3f, INFINITY, -INFINITY, -1.5f, 2.f};
  const double scale = std::pow(double(d), -0.55);

  SparseDecodeParams p;
  p.b = b, p.s_q = s_q, p.h_q = h_q, p.d_qk = d, p.format = f;
  p.softmax_scale = float(scale);
  p.q = q.data();
  p.q_stride_b = s_q * h_q * d, p.q_stride_s = h_q * d, p.q_stride_h = d;
  p.kv = {kv.data(), num_pages, page, int64_t(page) * bytes};
  p.topk = topk;
  p.indices = idx.data();
  p.indices_stride_b = s_q * topk, p.indices_stride_s = topk;
  p.topk_length = topk_len.data();
  p.extra_kv = {extra.data(), extra_pages, extra_page, int64_t(extra_page) * bytes};
  p.extra_topk = extra_topk;
  p.extra_indices = extra_idx.data();
  p.extra_indices_stride_b = s_q * extra_topk, p.extra_indices_stride_s = extra_topk;
  p.extra_topk_length = extra_len.data();
  p.attn_sink = sink.data();
  std::vector<uint16_t> out(size_t(b) * s_q * h_q * kHeadDimV);
  std::vector<float> lse(size_t(b) * s_q * h_q);
  p.o.out = out.data();
  p.o.out_stride_b = s_q * h_q * kHeadDimV, p.o.out_stride_s = h_q * kHeadDimV, p.o.out_stride_h = kHeadDimV;
  p.o.lse = lse.data();
  p.o.lse_stride_b = s_q * h_q, p.o.lse_stride_s = h_q, p.o.lse_stride_h = 1;
  Split split;
  p.split.num_sm_parts = num_sm_parts;
  plan_into(split, sparse_plan_params(p), s_q, h_q);
  p.split = split.view;
  reference::sparse_decode(p);

  for (int i = 0; i < b; ++i)
    for (int s = 0; s < s_q; ++s) {
      std::vector<const float*> keys;
      for (int k = 0; k < topk_len[i]; ++k) {
        const int tok = idx[(i * s_q + s) * topk + k];
        if (tok >= 0 && tok < num_pages * page) keys.push_back(&keys_main[size_t(tok) * d]);
      }
      for (int k = 0; k < extra_len[i]; ++k) {
        const int tok = extra_idx[(i * s_q + s) * extra_topk + k];
        if (tok >= 0 && tok < extra_pages * extra_page) keys.push_back(&keys_extra[size_t(tok) * d]);
      }
      for (int h = 0; h < h_q; ++h) {
        const Expected e = attend(keys, &qv[((size_t(i) * s_q + s) * h_q + h) * d], scale, d, sink[h]);
        const size_t row = (size_t(i) * s_q + s) * h_q + h;
        expect_close(lse[row], e.lse, 1e-5, 1e-5, "lse");
        for (int x = 0; x < kHeadDimV; ++x)
          expect_close(bf16_to_float(out[row * kHeadDimV + x]), e.out[x], 1e-4, 1.0 / 128, "out");
      }
    }
}

INSTANTIATE_TEST_SUITE_P(FormatsAndPlanSizes, SparseDecode,
                         ::testing::Combine(::testing::Values(KvFormat::kV32, KvFormat::kModel1),
                                            ::testing::Values(1, 3, 16)));

TEST(SparsePrefill, MatchesBruteForceInBothLogBases) {
  std::mt19937 rng(30);
  const int s_q = 9, s_kv = 90, h_q = 3, d = 512, topk = 100;
  const auto kvf = bf16_values(rng, size_t(s_kv) * d, 0.1f);
  const auto qv = bf16_values(rng, size_t(s_q) * h_q * d, 0.5f);
  std::vector<uint16_t> kv(kvf.size()), q(qv.size());
  for (size_t x = 0; x < kvf.size(); ++x) kv[x] = float_to_bf16(kvf[x]);
  for (size_t x = 0; x < qv.size(); ++x) q[x] = float_to_bf16(qv[x]);
  std::vector<int32_t> idx(size_t(s_q) * topk);
  for (auto& v : idx) v = int(rng() % (s_kv + 20)) - 10;  // some negative, some >= s_kv
  for (int k = 0; k < topk; ++k) idx[3 * topk + k] = -1;  // row 3: nothing valid
  const std::vector<int32_t> topk_len = {100, 0, 50, 100, 1, 99, 64, 65, 100};
  const std::vector<float> sink = {0.5f, -INFINITY, INFINITY};
  for (bool log2_stats : {true, false}) {
    SparsePrefillParams p;
    p.s_q = s_q, p.s_kv = s_kv, p.h_q = h_q, p.topk = topk, p.d_qk = d;
    p.softmax_scale = 0.5f;
    p.log2_stats = log2_stats;
    p.q = q.data(), p.q_stride_s = h_q * d, p.q_stride_h = d;
    p.kv = kv.data(), p.kv_stride_s = d;
    p.indices = idx.data(), p.indices_stride_s = topk;
    p.topk_length = topk_len.data();
    p.attn_sink = sink.data();
    std::vector<uint16_t> out(size_t(s_q) * h_q * kHeadDimV);
    std::vector<float> ml(s_q * h_q), lse(s_q * h_q);
    p.out = out.data(), p.max_logits = ml.data(), p.lse = lse.data();
    reference::sparse_prefill(p);
    const double unit = log2_stats ? 1.0 / std::log(2.0) : 1.0;
    for (int s = 0; s < s_q; ++s) {
      std::vector<const float*> keys;
      for (int k = 0; k < topk_len[s]; ++k)
        if (idx[s * topk + k] >= 0 && idx[s * topk + k] < s_kv) keys.push_back(&kvf[size_t(idx[s * topk + k]) * d]);
      for (int h = 0; h < h_q; ++h) {
        const float* qh = &qv[(size_t(s) * h_q + h) * d];
        const Expected e = attend(keys, qh, 0.5, d, sink[h]);
        double mx = -kInfD;
        for (const float* k : keys) {
          double acc = 0;
          for (int x = 0; x < d; ++x) acc += double(qh[x]) * k[x];
          mx = std::max(mx, acc * 0.5);
        }
        const int row = s * h_q + h;
        expect_close(lse[row], std::isinf(e.lse) ? e.lse : e.lse * unit, 1e-5, 1e-5, "lse");
        expect_close(ml[row], std::isinf(mx) ? mx : mx * unit, 1e-5, 1e-5, "max_logits");
        for (int x = 0; x < kHeadDimV; ++x)
          expect_close(bf16_to_float(out[size_t(row) * kHeadDimV + x]), e.out[x], 1e-4, 1.0 / 128, "out");
      }
    }
  }
}

}  // namespace
}  // namespace mla
