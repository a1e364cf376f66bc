// Op schemas (sgl-kernel's, argument for argument) and their CPU and CUDA kernels. Fake kernels, for
// torch.compile, are registered in python/mla_kernels/_ops.py.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(mla_kernels, m) {
  m.def(
      "get_mla_decoding_metadata(Tensor seqlens_k, int num_q_tokens_per_head_k, int h_k, int? h_q=None, "
      "bool is_fp8_kvcache=False, int? topk=None) -> Tensor[]");
  m.def(
      "get_mla_decoding_metadata_dense_fp8(Tensor seqlens_k, int num_heads_per_head_k, int num_heads_k) "
      "-> Tensor[]");
  m.def(
      "fwd_kvcache_mla(Tensor q, Tensor kv_cache, int head_size_v, Tensor seqlens_k, Tensor block_table, "
      "float softmax_scale, bool is_causal, Tensor tile_scheduler_metadata, Tensor num_splits, bool is_fp8, "
      "Tensor? indices=None, Tensor? attn_sink=None, Tensor? extra_k_cache=None, "
      "Tensor? extra_indices_in_kvcache=None, Tensor? topk_length=None, Tensor? extra_topk_length=None) "
      "-> Tensor[]");
  m.def(
      "fwd_kvcache_mla_fp8(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, Tensor block_table, "
      "float softmax_scale, bool is_causal, Tensor tile_scheduler_metadata, Tensor num_splits, "
      "Tensor? descale_q=None, Tensor? descale_k=None) -> Tensor[]");
  m.def(
      "dense_decode_fwd(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, Tensor block_table, "
      "float softmax_scale, bool is_causal, Tensor? tile_scheduler_metadata, Tensor? num_splits) "
      "-> (Tensor, Tensor, Tensor?, Tensor?)");
  m.def(
      "sparse_decode_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
      "Tensor? tile_scheduler_metadata, Tensor? num_splits, Tensor? extra_kv, Tensor? extra_indices, "
      "Tensor? extra_topk_length, int d_v, float sm_scale) -> (Tensor, Tensor, Tensor?, Tensor?)");
  m.def(
      "sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? attn_sink=None, "
      "Tensor? topk_length=None) -> Tensor[]");
  m.def("quantize_kv_fp8(Tensor kv, str fmt) -> Tensor");
  m.def("dequantize_kv_fp8(Tensor kv, str fmt) -> Tensor");
}

namespace {

// The op functions are device-generic: they run on q's device and its current stream.
void register_attention_ops(torch::Library& m) {
  using namespace mla::torch_ops;
  m.impl("get_mla_decoding_metadata", &get_mla_decoding_metadata);
  m.impl("get_mla_decoding_metadata_dense_fp8", &get_mla_decoding_metadata_dense_fp8);
  m.impl("fwd_kvcache_mla", &fwd_kvcache_mla);
  m.impl("fwd_kvcache_mla_fp8", &fwd_kvcache_mla_fp8);
  m.impl("dense_decode_fwd", &dense_decode_fwd);
  m.impl("sparse_decode_fwd", &sparse_decode_fwd);
  m.impl("sparse_prefill_fwd", &sparse_prefill_fwd);
}

}  // namespace

TORCH_LIBRARY_IMPL(mla_kernels, CPU, m) {
  register_attention_ops(m);
  m.impl("quantize_kv_fp8", &mla::torch_ops::quantize_kv_fp8);
  m.impl("dequantize_kv_fp8", &mla::torch_ops::dequantize_kv_fp8);
}

#if defined(MLA_KERNELS_WITH_CUDA)
TORCH_LIBRARY_IMPL(mla_kernels, CUDA, m) { register_attention_ops(m); }
#endif
