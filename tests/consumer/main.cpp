// Uses the installed C++ API without PyTorch: plans a decode call, then runs a sparse prefill on
// the CPU backend and checks one row against a direct computation. Exits non-zero on a mismatch.
#include <mla/formats.h>
#include <mla/plan.h>
#include <mla/reference.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  // Plan: FlashMLA's worked example must come out as 2, 1, 1, 6 pieces.
  const std::vector<int32_t> lens = {1000, 64, 0, 4096};
  std::vector<int32_t> rows(8 * mla::kPlanRowInts), num_splits(5);
  mla::DecodePlanParams plan;
  plan.b = 4, plan.num_sm_parts = 8, plan.seqlens_k = lens.data();
  plan.tile_scheduler_metadata = rows.data(), plan.num_splits = num_splits.data();
  mla::plan_decode_host(plan);
  if (num_splits != std::vector<int32_t>{0, 2, 3, 4, 10}) {
    std::printf("consumer: unexpected plan\n");
    return 1;
  }

  // Sparse prefill, one query row, one head, two valid keys out of three slots.
  const int d = 512, s_kv = 3;
  std::vector<uint16_t> q(d), kv(size_t(s_kv) * d), out(mla::kHeadDimV);
  for (int i = 0; i < d; ++i) q[i] = mla::float_to_bf16(0.01f * float(i % 7));
  for (int t = 0; t < s_kv; ++t)
    for (int i = 0; i < d; ++i) kv[size_t(t) * d + i] = mla::float_to_bf16(0.1f * float((t + i) % 5) - 0.2f);
  const std::vector<int32_t> indices = {2, -1, 0};
  float max_logits = 0.f, lse = 0.f;
  mla::SparsePrefillParams p;
  p.s_q = 1, p.s_kv = s_kv, p.h_q = 1, p.topk = 3, p.d_qk = d;
  p.softmax_scale = 0.5f;
  p.log2_stats = false;
  p.q = q.data(), p.q_stride_s = d, p.q_stride_h = d;
  p.kv = kv.data(), p.kv_stride_s = d;
  p.indices = indices.data(), p.indices_stride_s = 3;
  p.out = out.data(), p.max_logits = &max_logits, p.lse = &lse;
  mla::reference::sparse_prefill(p);

  double z[2];
  const int keys[2] = {2, 0};
  for (int j = 0; j < 2; ++j) {
    double acc = 0;
    for (int i = 0; i < d; ++i) acc += double(mla::bf16_to_float(q[i])) * mla::bf16_to_float(kv[size_t(keys[j]) * d + i]);
    z[j] = 0.5 * acc;
  }
  const double want = std::log(std::exp(z[0]) + std::exp(z[1]));
  if (std::fabs(lse - want) > 1e-4 * std::fabs(want) + 1e-5) {
    std::printf("consumer: lse %f, expected %f\n", lse, want);
    return 1;
  }
  std::printf("consumer: the installed C++ API plans and attends (lse %.6f)\n", lse);
  return 0;
}
