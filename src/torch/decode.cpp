// Decode ops: metadata (planning), dense BF16/FP16/FP8 decode, sparse FP8 decode.
#include <cmath>

#include "checks.h"
#include "device.h"
#include "mla/formats.h"
#include "mla/plan.h"
#include "mla/reference.h"
#include "mla/validate.h"
#include "ops.h"

namespace mla::torch_ops {

namespace {

constexpr auto kInt32 = at::kInt;
constexpr auto kFloat = at::kFloat;

struct Plan {
  Tensor tile_scheduler_metadata;  // [num_sm_parts, 8]
  Tensor num_splits;               // [b + 1]
  bool fresh = false;              // planned by this call
};

// Uses the caller's plan, or allocates one of `num_sm_parts` rows for the planner to fill.
Plan take_plan(const ArgChecker& c, int b, int num_sm_parts, const OptTensor& tsm, const OptTensor& ns,
               c10::Device device) {
  Plan plan;
  MLA_TORCH_CHECK(tsm.has_value() == ns.has_value(), c.op(),
              ": tile_scheduler_metadata and num_splits must be given together (or both None to plan now)");
  if (tsm.has_value()) {
    c.tensor(*tsm, "tile_scheduler_metadata", 2, {kInt32});
    c.contiguous(*tsm, "tile_scheduler_metadata");
    MLA_TORCH_CHECK(tsm->size(0) >= 1 && tsm->size(1) == kPlanRowInts, c.op(),
                ": tile_scheduler_metadata must have shape [num_sm_parts, 8] with num_sm_parts >= 1, got ",
                tsm->sizes());
    c.tensor(*ns, "num_splits", 1, {kInt32});
    c.contiguous(*ns, "num_splits");
    c.shape(*ns, "num_splits", {b + 1}, "[b + 1]");
    plan.tile_scheduler_metadata = *tsm;
    plan.num_splits = *ns;
  } else {
    auto opts = at::TensorOptions().dtype(kInt32).device(device);
    plan.tile_scheduler_metadata = at::empty({num_sm_parts, kPlanRowInts}, opts);
    plan.num_splits = at::empty({b + 1}, opts);
    plan.fresh = true;
  }
  return plan;
}

void fill_plan(DecodePlanParams& pp, const Plan& plan) {
  pp.num_sm_parts = int(plan.tile_scheduler_metadata.size(0));
  pp.tile_scheduler_metadata = plan.tile_scheduler_metadata.data_ptr<int32_t>();
  pp.num_splits = plan.num_splits.data_ptr<int32_t>();
}

// Split workspace for a plan; o_accum and lse_accum are sized for the worst case b + num_sm_parts.
struct Workspace {
  Tensor o_accum, lse_accum;
};

Workspace make_workspace(int b, int s_q, int h_q, const Plan& plan, c10::Device device, DecodeSplit& split) {
  const int64_t parts = plan.tile_scheduler_metadata.size(0);
  auto opts = at::TensorOptions().dtype(kFloat).device(device);
  Workspace ws{at::empty({b + parts, s_q, h_q, kHeadDimV}, opts), at::empty({b + parts, s_q, h_q}, opts)};
  split.num_sm_parts = int(parts);
  split.tile_scheduler_metadata = plan.tile_scheduler_metadata.data_ptr<int32_t>();
  split.num_splits = plan.num_splits.data_ptr<int32_t>();
  split.o_accum = ws.o_accum.data_ptr<float>();
  split.lse_accum = ws.lse_accum.data_ptr<float>();
  return ws;
}

DecodePlanParams plan_params_of(const DenseDecodeParams& p) { return dense_plan_params(p); }
DecodePlanParams plan_params_of(const SparseDecodeParams& p) { return sparse_plan_params(p); }

// Validates the params, plans when the call brought no plan (on the device, no host sync),
// allocates the split workspace and runs the op's kernel on q's device and current stream.
template <typename Params, typename CpuKernel, typename CudaKernel>
void plan_and_run(const char* op, Params& p, const Plan& plan, c10::Device device, CpuKernel&& cpu_kernel,
                  CudaKernel&& cuda_kernel) {
  run_core(op, [&] { validate(p); });
  DecodePlanParams pp = plan_params_of(p);
  fill_plan(pp, plan);
  if (device.is_cuda()) {
    const DeviceContext ctx(op, device);
    Workspace ws = make_workspace(p.b, p.s_q, p.h_q, plan, device, p.split);
    // Planned by the call: by the planner kernel, or inside the attention kernel where it can.
    p.split.plan_fresh = plan.fresh;
    run_core(op, [&] { ctx.check(cuda_kernel(p, ctx.stream()), "the attention kernel"); });
    return;
  }
  run_core(op, [&] {
    if (plan.fresh) plan_decode_host(pp);
    Workspace ws = make_workspace(p.b, p.s_q, p.h_q, plan, device, p.split);
    cpu_kernel(p);
  });
}

void fill_output(DecodeOutput& o, const Tensor& out, const Tensor& lse_bsh) {
  o.out = out.data_ptr();
  o.out_dtype = out.scalar_type() == at::kHalf ? DType::kFP16 : DType::kBF16;
  o.out_stride_b = out.stride(0), o.out_stride_s = out.stride(1), o.out_stride_h = out.stride(2);
  o.lse = lse_bsh.data_ptr<float>();
  o.lse_stride_b = lse_bsh.stride(0), o.lse_stride_s = lse_bsh.stride(1), o.lse_stride_h = lse_bsh.stride(2);
}

DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::kFP16;
    case at::kFloat8_e4m3fn: return DType::kFP8E4M3;
    default: return DType::kBF16;
  }
}

struct DenseArgs {
  const Tensor& q;
  const Tensor& kcache;
  int64_t head_size_v;
  const Tensor& seqlens_k;
  const Tensor& block_table;
  double softmax_scale;
  bool is_causal;
  const OptTensor& tile_scheduler_metadata;
  const OptTensor& num_splits;
  const OptTensor& descale_q;
  const OptTensor& descale_k;
};

// Dense decode shared by dense_decode_fwd, fwd_kvcache_mla and fwd_kvcache_mla_fp8; `kcache`: the
// op's name for the cache (fwd_kvcache_mla's is kv_cache).
DecodeResult dense_decode(const char* op, const char* kcache, const DenseArgs& a, bool fp8) {
  ArgChecker c(op, device_of(op, a.q, "q"));
  if (fp8) {
    c.tensor(a.q, "q", 4, {at::kFloat8_e4m3fn});
  } else {
    c.tensor(a.q, "q", 4, {at::kBFloat16, at::kHalf});
  }
  c.tensor(a.kcache, kcache, 4, {a.q.scalar_type()});  // q's dtype
  c.tensor(a.seqlens_k, "seqlens_k", 1, {kInt32});
  c.contiguous(a.seqlens_k, "seqlens_k");
  c.tensor(a.block_table, "block_table", 2, {kInt32});

  const int b = int(a.q.size(0)), s_q = int(a.q.size(1)), h_q = int(a.q.size(2)), d_qk = int(a.q.size(3));
  const int h_k = int(a.kcache.size(2));
  check_rows(op, a.q, int64_t(b) * s_q * h_q);
  const int d_v = narrow_int(op, a.head_size_v, "head_size_v");
  MLA_TORCH_CHECK(d_v == kHeadDimV, op, ": head_size_v must be ", kHeadDimV, ", got ", d_v);
  MLA_TORCH_CHECK(std::isfinite(a.softmax_scale), op, ": softmax_scale must be finite, got ", a.softmax_scale);
  MLA_TORCH_CHECK(h_k > 0, op, ": ", kcache, " h_k (dim 2) must be > 0, got ", h_k);
  MLA_TORCH_CHECK(a.kcache.size(1) > 0, op, ": ", kcache, " page_block_size (dim 1) must be > 0, got ",
                  a.kcache.size(1));
  MLA_TORCH_CHECK(a.kcache.size(3) == d_qk, op, ": ", kcache, " head dim (dim 3) must equal q's (", d_qk, "), got ",
              a.kcache.size(3));
  c.shape(a.seqlens_k, "seqlens_k", {b}, "[b]");
  MLA_TORCH_CHECK(a.block_table.size(0) == b, op, ": block_table must have b = ", b, " rows, got shape ",
              a.block_table.sizes());

  Tensor descale_q, descale_k;
  if (fp8) {
    auto opts = at::TensorOptions().dtype(kFloat).device(a.q.device());
    descale_q = a.descale_q.has_value() ? *a.descale_q : at::ones({1}, opts);
    descale_k = a.descale_k.has_value() ? *a.descale_k : at::ones({1}, opts);
    for (auto [t, name] : {std::pair{&descale_q, "descale_q"}, {&descale_k, "descale_k"}}) {
      c.tensor(*t, name, 1, {kFloat});
      c.contiguous(*t, name);
      MLA_TORCH_CHECK(t->size(0) == 1 || t->size(0) == b, op, ": ", name, " must have shape [1] or [b] = [", b,
                  "], got ", t->sizes());
    }
    MLA_TORCH_CHECK(descale_q.size(0) == descale_k.size(0), op, ": descale_q and descale_k must have the same shape, got ",
                descale_q.sizes(), " and ", descale_k.sizes());
  }

  const Tensor seqlens = a.seqlens_k;
  const int parts_if_planned = num_sm_parts_dense(num_sms(a.q.device()), s_q, h_q, h_k);
  Plan plan = take_plan(c, b, parts_if_planned, a.tile_scheduler_metadata, a.num_splits, a.q.device());

  auto out_dtype = fp8 ? at::kBFloat16 : a.q.scalar_type();
  Tensor out = at::empty({b, s_q, h_q, kHeadDimV}, a.q.options().dtype(out_dtype));
  Tensor lse = at::empty({b, h_q, s_q}, a.q.options().dtype(kFloat));

  DenseDecodeParams p;
  p.b = b, p.s_q = s_q, p.h_q = h_q, p.h_k = h_k, p.d_qk = d_qk, p.d_v = d_v;
  p.page_block_size = int(a.kcache.size(1)), p.num_blocks = int(a.kcache.size(0));
  p.max_blocks_per_seq = int(a.block_table.size(1));
  p.dtype = dtype_of(a.q);
  p.softmax_scale = float(a.softmax_scale);
  p.causal = a.is_causal;
  p.q = a.q.data_ptr();
  p.q_stride_b = a.q.stride(0), p.q_stride_s = a.q.stride(1), p.q_stride_h = a.q.stride(2);
  p.k_cache = a.kcache.data_ptr();
  p.k_stride_block = a.kcache.stride(0), p.k_stride_token = a.kcache.stride(1), p.k_stride_head = a.kcache.stride(2);
  p.block_table = a.block_table.data_ptr<int32_t>();
  p.block_table_stride = a.block_table.stride(0);
  p.seqlens_k = seqlens.data_ptr<int32_t>();
  if (fp8) {
    p.descale_q = descale_q.data_ptr<float>();
    p.descale_k = descale_k.data_ptr<float>();
    p.descale_per_request = descale_q.size(0) == b && b > 1;
  }
  fill_output(p.o, out, lse.transpose(1, 2));

  if (a.q.is_cuda()) c.cuda_alignment(a.kcache, kcache, 16, 3);
  plan_and_run(op, p, plan, a.q.device(), reference::dense_decode, cuda_dense_decode);
  if (plan.fresh) return {out, lse, plan.tile_scheduler_metadata, plan.num_splits};
  return {out, lse, std::nullopt, std::nullopt};
}

void check_sparse_cache(const ArgChecker& c, const Tensor& kv, const char* name, int bytes) {
  c.tensor(kv, name, 4, {at::kByte, at::kChar, at::kFloat8_e4m3fn});
  MLA_TORCH_CHECK(kv.size(2) == 1, c.op(), ": ", name, " must have h_kv = 1 (dim 2; sparse decode is MQA), got ",
              kv.size(2));
  MLA_TORCH_CHECK(kv.size(3) == bytes, c.op(), ": ", name, " must have ", bytes,
              " bytes per token (dim 3) for this head dim, got ", kv.size(3));
  MLA_TORCH_CHECK(kv.size(1) <= 1 || kv.stride(1) == bytes, c.op(), ": ", name,
              " must store the tokens of a page block contiguously (stride(1) == ", bytes, "), got stride(1) = ",
              kv.stride(1));
}

SparseKvCache sparse_cache(const Tensor& kv) {
  SparseKvCache cache;
  cache.data = static_cast<const uint8_t*>(kv.data_ptr());
  cache.num_blocks = int(kv.size(0));
  cache.page_block_size = int(kv.size(1));
  cache.stride_block = kv.stride(0);
  return cache;
}

}  // namespace

namespace {

// The metadata ops' names for the query rows per KV head and the KV heads:
// get_mla_decoding_metadata's or get_mla_decoding_metadata_dense_fp8's, so that a message names
// what the caller passed.
struct MetadataNames {
  const char* op;
  const char* rows_per_head_k;
  const char* h_k;
};

std::vector<Tensor> plan_metadata(const MetadataNames& n, const Tensor& seqlens_k, int64_t num_q_tokens_per_head_k,
                                  int64_t h_k, std::optional<int64_t> h_q, bool is_fp8_kvcache,
                                  std::optional<int64_t> topk) {
  const char* op = n.op;
  ArgChecker c(op, device_of(op, seqlens_k, "seqlens_k"));
  c.tensor(seqlens_k, "seqlens_k", 1, {kInt32});
  c.contiguous(seqlens_k, "seqlens_k");
  const int b = int(seqlens_k.size(0));
  MLA_TORCH_CHECK(b > 0, op, ": seqlens_k must have b > 0 entries, got ", b);
  MLA_TORCH_CHECK(h_k > 0 && h_k <= INT32_MAX, op, ": ", n.h_k, " must be in [1, 2^31), got ", h_k);
  MLA_TORCH_CHECK(num_q_tokens_per_head_k > 0 && num_q_tokens_per_head_k <= INT32_MAX, op, ": ", n.rows_per_head_k,
                  " must be in [1, 2^31), got ", num_q_tokens_per_head_k);
  const Tensor seqlens = seqlens_k;
  DecodePlanParams pp;
  pp.b = b;
  if (topk.has_value()) {
    MLA_TORCH_CHECK(h_q.has_value(), op, ": num_heads_q (h_q) is required when topk is given");
    MLA_TORCH_CHECK(is_fp8_kvcache, op, ": sparse decode (topk given) needs is_fp8_kvcache=True");
    MLA_TORCH_CHECK(*topk > 0 && *topk <= INT32_MAX, op, ": topk must be in [1, 2^31), got ", *topk);
    MLA_TORCH_CHECK(*h_q > 0 && *h_q <= kMaxHeadsQ, op, ": num_heads_q must be in [1, ", kMaxHeadsQ, "], got ", *h_q);
    MLA_TORCH_CHECK(h_k == 1, op, ": sparse decode needs h_k = 1, got ", h_k);
    MLA_TORCH_CHECK(num_q_tokens_per_head_k % *h_q == 0, op, ": num_q_tokens_per_head_k (", num_q_tokens_per_head_k,
                ") must be s_q * num_heads_q (num_heads_q = ", *h_q, ")");
    const int s_q = int(num_q_tokens_per_head_k / *h_q);
    pp.num_sm_parts = num_sm_parts_sparse(num_sms(seqlens.device()), s_q, int(*h_q));
    pp.topk = int(*topk);  // every request attends topk slots: the legacy plan ignores seqlens
    pp.fixed_cost = plan_fixed_for_heads(*h_q);
  } else {
    MLA_TORCH_CHECK(!is_fp8_kvcache, op,
                ": dense FP8 decode plans with get_mla_decoding_metadata_dense_fp8 (is_fp8_kvcache=True needs topk)");
    pp.num_sm_parts = std::max<int>(num_sms(seqlens.device()) / int(h_k) / ceil_div(int(num_q_tokens_per_head_k), 64), 1);
    pp.seqlens_k = seqlens.data_ptr<int32_t>();
    pp.fixed_cost = plan_fixed_dense();
  }
  auto opts = seqlens.options().dtype(kInt32);
  Tensor tsm = at::empty({pp.num_sm_parts, kPlanRowInts}, opts);
  Tensor ns = at::empty({b + 1}, opts);
  pp.tile_scheduler_metadata = tsm.data_ptr<int32_t>();
  pp.num_splits = ns.data_ptr<int32_t>();
  if (seqlens.is_cuda()) {
    const DeviceContext ctx(op, seqlens.device());
    ctx.check(cuda_plan_decode(pp, ctx.stream()), "the planner");
  } else {
    run_core(op, [&] { plan_decode_host(pp); });
  }
  return {tsm, ns};
}

}  // namespace

std::vector<Tensor> get_mla_decoding_metadata(const Tensor& seqlens_k, int64_t num_q_tokens_per_head_k, int64_t h_k,
                                              std::optional<int64_t> h_q, bool is_fp8_kvcache,
                                              std::optional<int64_t> topk) {
  return plan_metadata({"get_mla_decoding_metadata", "num_q_tokens_per_head_k", "h_k"}, seqlens_k,
                       num_q_tokens_per_head_k, h_k, h_q, is_fp8_kvcache, topk);
}

std::vector<Tensor> get_mla_decoding_metadata_dense_fp8(const Tensor& seqlens_k, int64_t num_heads_per_head_k,
                                                        int64_t num_heads_k) {
  return plan_metadata({"get_mla_decoding_metadata_dense_fp8", "num_heads_per_head_k", "num_heads_k"}, seqlens_k,
                       num_heads_per_head_k, num_heads_k, std::nullopt, false, std::nullopt);
}

DecodeResult dense_decode_fwd(const Tensor& q, const Tensor& kcache, int64_t head_size_v, const Tensor& seqlens_k,
                              const Tensor& block_table, double softmax_scale, bool is_causal,
                              const OptTensor& tile_scheduler_metadata, const OptTensor& num_splits) {
  const OptTensor none;
  return dense_decode("dense_decode_fwd", "kcache",
                      {q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal,
                       tile_scheduler_metadata, num_splits, none, none},
                      false);
}

std::vector<Tensor> fwd_kvcache_mla_fp8(const Tensor& q, const Tensor& kcache, int64_t head_size_v,
                                        const Tensor& seqlens_k, const Tensor& block_table, double softmax_scale,
                                        bool is_causal, const Tensor& tile_scheduler_metadata,
                                        const Tensor& num_splits, const OptTensor& descale_q,
                                        const OptTensor& descale_k) {
  auto r = dense_decode("fwd_kvcache_mla_fp8", "kcache",
                        {q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal,
                         tile_scheduler_metadata, num_splits, descale_q, descale_k},
                        true);
  return {std::get<0>(r), std::get<1>(r)};
}

namespace {

// Sparse decode's arguments as the caller named them: sparse_decode_fwd's own names, or
// fwd_kvcache_mla's (which runs a call with indices here), so that a message names what was passed.
struct SparseNames {
  const char* op;
  const char* kv;
  const char* extra_kv;
  const char* extra_indices;
  const char* d_v;
  const char* scale;
};

DecodeResult sparse_decode(const SparseNames& n, const Tensor& q, const Tensor& kv, const Tensor& indices,
                           const OptTensor& topk_length, const OptTensor& attn_sink,
                           const OptTensor& tile_scheduler_metadata, const OptTensor& num_splits,
                           const OptTensor& extra_kv, const OptTensor& extra_indices,
                           const OptTensor& extra_topk_length, int64_t d_v, double sm_scale) {
  const char* op = n.op;
  ArgChecker c(op, device_of(op, q, "q"));
  c.tensor(q, "q", 4, {at::kBFloat16});
  const int b = int(q.size(0)), s_q = int(q.size(1)), h_q = int(q.size(2)), d_qk = int(q.size(3));
  check_rows(op, q, int64_t(b) * s_q * h_q);
  const int d_v32 = narrow_int(op, d_v, n.d_v);
  MLA_TORCH_CHECK(d_v32 == kHeadDimV, op, ": ", n.d_v, " must be ", kHeadDimV, ", got ", d_v32);
  MLA_TORCH_CHECK(std::isfinite(sm_scale), op, ": ", n.scale, " must be finite, got ", sm_scale);
  MLA_TORCH_CHECK(d_qk == kHeadDimV32 || d_qk == kHeadDimModel1, op,
              ": q head dim (dim 3) must be 576 (V3.2 cache) or 512 (MODEL1 cache), got ", d_qk);
  const KvFormat format = d_qk == kHeadDimV32 ? KvFormat::kV32 : KvFormat::kModel1;
  const int bytes = bytes_per_token(format);
  check_sparse_cache(c, kv, n.kv, bytes);
  c.tensor(indices, "indices", 3, {kInt32});
  MLA_TORCH_CHECK(indices.size(0) == b && indices.size(1) == s_q, op, ": indices must have shape [b, s_q, topk] = [", b,
              ", ", s_q, ", topk], got ", indices.sizes());
  c.opt_tensor(topk_length, "topk_length", 1, {kInt32});
  if (topk_length) {
    c.contiguous(*topk_length, "topk_length");
    c.shape(*topk_length, "topk_length", {b}, "[b]");
  }
  c.opt_tensor(attn_sink, "attn_sink", 1, {kFloat});
  if (attn_sink) {
    c.contiguous(*attn_sink, "attn_sink");
    c.shape(*attn_sink, "attn_sink", {h_q}, "[h_q]");
  }
  MLA_TORCH_CHECK(extra_kv.has_value() == extra_indices.has_value(), op, ": ", n.extra_kv, " and ", n.extra_indices,
              " must be given together, got ", extra_kv ? n.extra_kv : n.extra_indices, " alone");
  MLA_TORCH_CHECK(!extra_topk_length || extra_kv, op, ": extra_topk_length needs ", n.extra_kv, " and ",
                  n.extra_indices);
  if (extra_kv) {
    check_sparse_cache(c, *extra_kv, n.extra_kv, bytes);
    c.tensor(*extra_indices, n.extra_indices, 3, {kInt32});
    MLA_TORCH_CHECK(extra_indices->size(0) == b && extra_indices->size(1) == s_q, op, ": ", n.extra_indices,
                " must have shape [b, s_q, extra_topk] = [", b, ", ", s_q, ", extra_topk], got ",
                extra_indices->sizes());
    c.opt_tensor(extra_topk_length, "extra_topk_length", 1, {kInt32});
    if (extra_topk_length) {
      c.contiguous(*extra_topk_length, "extra_topk_length");
      c.shape(*extra_topk_length, "extra_topk_length", {b}, "[b]");
    }
  }

  const int parts_if_planned = num_sm_parts_sparse(num_sms(q.device()), s_q, h_q);
  Plan plan = take_plan(c, b, parts_if_planned, tile_scheduler_metadata, num_splits, q.device());
  Tensor out = at::empty({b, s_q, h_q, kHeadDimV}, q.options());
  Tensor lse = at::empty({b, s_q, h_q}, q.options().dtype(kFloat));

  SparseDecodeParams p;
  p.b = b, p.s_q = s_q, p.h_q = h_q, p.d_qk = d_qk, p.d_v = d_v32;
  p.format = format;
  p.softmax_scale = float(sm_scale);
  p.q = static_cast<const uint16_t*>(q.data_ptr());
  p.q_stride_b = q.stride(0), p.q_stride_s = q.stride(1), p.q_stride_h = q.stride(2);
  p.kv = sparse_cache(kv);
  p.topk = int(indices.size(2));
  p.indices = indices.data_ptr<int32_t>();
  p.indices_stride_b = indices.stride(0), p.indices_stride_s = indices.stride(1);
  p.topk_length = topk_length ? topk_length->data_ptr<int32_t>() : nullptr;
  // An extra cache of no page blocks (its pointer may be null) is passed on as it is: the plan gives
  // it no slots (has_extra_cache), so the call runs as the one without it.
  if (extra_kv) {
    p.extra_kv = sparse_cache(*extra_kv);
    p.extra_topk = int(extra_indices->size(2));
    p.extra_indices = extra_indices->data_ptr<int32_t>();
    p.extra_indices_stride_b = extra_indices->stride(0), p.extra_indices_stride_s = extra_indices->stride(1);
    p.extra_topk_length = extra_topk_length ? extra_topk_length->data_ptr<int32_t>() : nullptr;
  }
  p.attn_sink = attn_sink ? attn_sink->data_ptr<float>() : nullptr;
  fill_output(p.o, out, lse);

  if (q.is_cuda()) {
    // V3.2 token records are read in 16-byte pieces; MODEL1's (block-interleaved) in 8-byte pieces.
    const int align = format == KvFormat::kV32 ? 16 : 8;
    c.cuda_alignment(kv, n.kv, align, 1);
    if (extra_kv) c.cuda_alignment(*extra_kv, n.extra_kv, align, 1);
  }
  plan_and_run(op, p, plan, q.device(), reference::sparse_decode, cuda_sparse_decode);
  if (plan.fresh) return {out, lse.transpose(1, 2), plan.tile_scheduler_metadata, plan.num_splits};
  return {out, lse.transpose(1, 2), std::nullopt, std::nullopt};
}

}  // namespace

DecodeResult sparse_decode_fwd(const Tensor& q, const Tensor& kv, const Tensor& indices, const OptTensor& topk_length,
                               const OptTensor& attn_sink, const OptTensor& tile_scheduler_metadata,
                               const OptTensor& num_splits, const OptTensor& extra_kv,
                               const OptTensor& extra_indices, const OptTensor& extra_topk_length, int64_t d_v,
                               double sm_scale) {
  return sparse_decode({"sparse_decode_fwd", "kv", "extra_kv", "extra_indices", "d_v", "sm_scale"}, q, kv, indices,
                       topk_length, attn_sink, tile_scheduler_metadata, num_splits, extra_kv, extra_indices,
                       extra_topk_length, d_v, sm_scale);
}

std::vector<Tensor> fwd_kvcache_mla(const Tensor& q, const Tensor& kv_cache, int64_t head_size_v,
                                    const Tensor& seqlens_k, const Tensor& block_table, double softmax_scale,
                                    bool is_causal, const Tensor& tile_scheduler_metadata, const Tensor& num_splits,
                                    bool is_fp8, const OptTensor& indices, const OptTensor& attn_sink,
                                    const OptTensor& extra_k_cache, const OptTensor& extra_indices_in_kvcache,
                                    const OptTensor& topk_length, const OptTensor& extra_topk_length) {
  const char* op = "fwd_kvcache_mla";
  if (indices.has_value()) {
    MLA_TORCH_CHECK(is_fp8, op, ": sparse decode (indices given) needs an FP8 cache and is_fp8=True");
    MLA_TORCH_CHECK(!is_causal, op, ": sparse decode (indices given) does not take is_causal=True");
    const SparseNames names{op, "kv_cache", "extra_k_cache", "extra_indices_in_kvcache", "head_size_v", "softmax_scale"};
    auto r = sparse_decode(names, q, kv_cache, *indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits,
                           extra_k_cache, extra_indices_in_kvcache, extra_topk_length, head_size_v, softmax_scale);
    return {std::get<0>(r), std::get<1>(r)};
  }
  MLA_TORCH_CHECK(!is_fp8, op,
                  ": is_fp8 must be False without indices (dense FP8 decode is fwd_kvcache_mla_fp8), got True");
  for (auto [t, name] : {std::pair{&attn_sink, "attn_sink"}, {&extra_k_cache, "extra_k_cache"},
                         {&extra_indices_in_kvcache, "extra_indices_in_kvcache"}, {&topk_length, "topk_length"},
                         {&extra_topk_length, "extra_topk_length"}})
    MLA_TORCH_CHECK(!t->has_value(), op, ": ", name, " is only for sparse decode (indices given); got it without indices");
  auto r = dense_decode(op, "kv_cache",
                        {q, kv_cache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal,
                         tile_scheduler_metadata, num_splits, std::nullopt, std::nullopt},
                        false);
  return {std::get<0>(r), std::get<1>(r)};
}

}  // namespace mla::torch_ops
