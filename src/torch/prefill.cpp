// Sparse prefill and the FP8 cache format helpers.
#include "checks.h"
#include "device.h"
#include "mla/formats.h"
#include "mla/reference.h"
#include "mla/validate.h"
#include "ops.h"

namespace mla::torch_ops {

std::vector<Tensor> sparse_prefill_fwd(const Tensor& q, const Tensor& kv, const Tensor& indices, double sm_scale,
                                       int64_t d_v, const OptTensor& attn_sink, const OptTensor& topk_length) {
  const char* op = "sparse_prefill_fwd";
  ArgChecker c(op, device_of(op, q, "q"));
  c.tensor(q, "q", 3, {at::kBFloat16});
  c.tensor(kv, "kv", 3, {at::kBFloat16});
  c.tensor(indices, "indices", 3, {at::kInt});
  const int s_q = int(q.size(0)), h_q = int(q.size(1)), d_qk = int(q.size(2));
  check_rows(op, q, int64_t(s_q) * h_q);
  const int d_v32 = narrow_int(op, d_v, "d_v");
  MLA_TORCH_CHECK(kv.size(1) == 1, op, ": kv must have h_kv = 1 (dim 1), got ", kv.size(1));
  MLA_TORCH_CHECK(kv.size(2) == d_qk, op, ": kv head dim (dim 2) must equal q's (", d_qk, "), got ", kv.size(2));
  MLA_TORCH_CHECK(indices.size(0) == s_q && indices.size(1) == 1, op, ": indices must have shape [s_q, h_kv, topk] = [",
              s_q, ", 1, topk], got ", indices.sizes());
  c.opt_tensor(attn_sink, "attn_sink", 1, {at::kFloat});
  if (attn_sink) {
    c.contiguous(*attn_sink, "attn_sink");
    c.shape(*attn_sink, "attn_sink", {h_q}, "[h_q]");
  }
  c.opt_tensor(topk_length, "topk_length", 1, {at::kInt});
  if (topk_length) {
    c.contiguous(*topk_length, "topk_length");
    c.shape(*topk_length, "topk_length", {s_q}, "[s_q]");
  }

  Tensor out = at::empty({s_q, h_q, kHeadDimV}, q.options());
  Tensor max_logits = at::empty({s_q, h_q}, q.options().dtype(at::kFloat));
  Tensor lse = at::empty({s_q, h_q}, q.options().dtype(at::kFloat));

  SparsePrefillParams p;
  p.s_q = s_q, p.s_kv = int(kv.size(0)), p.h_q = h_q, p.topk = int(indices.size(2));
  p.d_qk = d_qk, p.d_v = d_v32;
  p.softmax_scale = float(sm_scale);
  p.log2_stats = true;  // sgl-kernel's convention; the Python API converts for lse_base="e"
  p.q = static_cast<const uint16_t*>(q.data_ptr());
  p.q_stride_s = q.stride(0), p.q_stride_h = q.stride(1);
  p.kv = static_cast<const uint16_t*>(kv.data_ptr());
  p.kv_stride_s = kv.stride(0);
  p.indices = indices.data_ptr<int32_t>();
  p.indices_stride_s = indices.stride(0);
  p.topk_length = topk_length ? topk_length->data_ptr<int32_t>() : nullptr;
  p.attn_sink = attn_sink ? attn_sink->data_ptr<float>() : nullptr;
  p.out = static_cast<uint16_t*>(out.data_ptr());
  p.max_logits = max_logits.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  run_core(op, [&] { validate(p); });
  if (q.is_cuda()) {
    c.cuda_alignment(kv, "kv", 16, 1);
    const DeviceContext ctx(op, q.device());
    run_core(op, [&] { ctx.check(cuda_sparse_prefill(p, ctx.stream()), "the attention kernel"); });
  } else {
    run_core(op, [&] { reference::sparse_prefill(p); });
  }
  return {out, max_logits, lse};
}

namespace {

KvFormat parse_format(const char* op, c10::string_view fmt) {
  if (fmt == "v32") return KvFormat::kV32;
  if (fmt == "model1") return KvFormat::kModel1;
  TORCH_CHECK(false, ::mla::detail::concat(op, ": fmt must be \"v32\" or \"model1\", got \"", std::string(fmt), "\""));
}

}  // namespace

Tensor quantize_kv_fp8(const Tensor& kv, c10::string_view fmt) {
  const char* op = "quantize_kv_fp8";
  const KvFormat f = parse_format(op, fmt);
  ArgChecker c(op, device_of(op, kv, "kv"));
  MLA_TORCH_CHECK(kv.device().is_cpu(), op, ": ", kv.device(), " tensors have no kernel in this build");
  c.tensor(kv, "kv", 4, {at::kBFloat16});
  MLA_TORCH_CHECK(kv.size(2) == 1, op, ": kv must have h_k = 1 (dim 2), got ", kv.size(2));
  MLA_TORCH_CHECK(kv.size(3) == head_dim_qk(f), op, ": kv head dim (dim 3) must be ", head_dim_qk(f), " for fmt \"",
              std::string(fmt), "\", got ", kv.size(3));
  const Tensor src = kv.contiguous();
  const int64_t num_blocks = src.size(0), page = src.size(1), bytes = bytes_per_token(f);
  Tensor out = at::empty({num_blocks, page, 1, bytes}, kv.options().dtype(at::kByte));
  const auto* in = static_cast<const uint16_t*>(src.data_ptr());
  auto* dst = out.data_ptr<uint8_t>();
  reference::parallel_for(int(num_blocks), [&](int n) {
    for (int t = 0; t < page; ++t)
      quantize_token(f, in + (n * page + t) * head_dim_qk(f), dst + n * page * bytes, int(page), t);
  });
  return out;
}

Tensor dequantize_kv_fp8(const Tensor& kv, c10::string_view fmt) {
  const char* op = "dequantize_kv_fp8";
  const KvFormat f = parse_format(op, fmt);
  ArgChecker c(op, device_of(op, kv, "kv"));
  MLA_TORCH_CHECK(kv.device().is_cpu(), op, ": ", kv.device(), " tensors have no kernel in this build");
  c.tensor(kv, "kv", 4, {at::kByte, at::kChar, at::kFloat8_e4m3fn});
  const int bytes = bytes_per_token(f);
  MLA_TORCH_CHECK(kv.size(2) == 1, op, ": kv must have h_k = 1 (dim 2), got ", kv.size(2));
  MLA_TORCH_CHECK(kv.size(3) == bytes, op, ": kv must have ", bytes, " bytes per token (dim 3) for fmt \"",
              std::string(fmt), "\", got ", kv.size(3));
  MLA_TORCH_CHECK(kv.size(1) <= 1 || kv.stride(1) == bytes, op,
              ": kv must store the tokens of a page block contiguously (stride(1) == ", bytes, "), got ",
              kv.stride(1));
  MLA_TORCH_CHECK(kv.size(0) <= 1 || kv.stride(0) >= kv.size(1) * bytes, op,
              ": kv page blocks must not overlap (stride(0) >= page_block_size * ", bytes, " = ", kv.size(1) * bytes,
              "), got stride(0) ", kv.stride(0));
  const int64_t num_blocks = kv.size(0), page = kv.size(1), d = head_dim_qk(f);
  Tensor out = at::empty({num_blocks, page, 1, d}, kv.options().dtype(at::kBFloat16));
  const auto* src = static_cast<const uint8_t*>(kv.data_ptr());
  auto* dst = static_cast<uint16_t*>(out.data_ptr());
  reference::parallel_for(int(num_blocks), [&](int n) {
    std::vector<float> tok(d);
    for (int t = 0; t < page; ++t) {
      dequantize_token(f, src + n * kv.stride(0), int(page), t, tok.data());
      for (int64_t j = 0; j < d; ++j) dst[(n * page + t) * d + j] = float_to_bf16(tok[j]);
    }
  });
  return out;
}

}  // namespace mla::torch_ops
