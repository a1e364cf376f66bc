// The torch front-end: tensor checks, outputs, params structs, then a backend call. Op schemas
// are sgl-kernel's (SPEC §3); registration is in ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace mla::torch_ops {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using DecodeResult = std::tuple<Tensor, Tensor, OptTensor, OptTensor>;

std::vector<Tensor> get_mla_decoding_metadata(const Tensor& seqlens_k, int64_t num_q_tokens_per_head_k, int64_t h_k,
                                              std::optional<int64_t> h_q, bool is_fp8_kvcache,
                                              std::optional<int64_t> topk);

std::vector<Tensor> get_mla_decoding_metadata_dense_fp8(const Tensor& seqlens_k, int64_t num_heads_per_head_k,
                                                        int64_t num_heads_k);

DecodeResult dense_decode_fwd(const Tensor& q, const Tensor& kcache, int64_t head_size_v, const Tensor& seqlens_k,
                              const Tensor& block_table, double softmax_scale, bool is_causal,
                              const OptTensor& tile_scheduler_metadata, const OptTensor& num_splits);

std::vector<Tensor> fwd_kvcache_mla_fp8(const Tensor& q, const Tensor& kcache, int64_t head_size_v,
                                        const Tensor& seqlens_k, const Tensor& block_table, double softmax_scale,
                                        bool is_causal, const Tensor& tile_scheduler_metadata,
                                        const Tensor& num_splits, const OptTensor& descale_q,
                                        const OptTensor& descale_k);

DecodeResult sparse_decode_fwd(const Tensor& q, const Tensor& kv, const Tensor& indices, const OptTensor& topk_length,
                               const OptTensor& attn_sink, const OptTensor& tile_scheduler_metadata,
                               const OptTensor& num_splits, const OptTensor& extra_kv,
                               const OptTensor& extra_indices, const OptTensor& extra_topk_length, int64_t d_v,
                               double sm_scale);

std::vector<Tensor> fwd_kvcache_mla(const Tensor& q, const Tensor& kv_cache, int64_t head_size_v,
                                    const Tensor& seqlens_k, const Tensor& block_table, double softmax_scale,
                                    bool is_causal, const Tensor& tile_scheduler_metadata, const Tensor& num_splits,
                                    bool is_fp8, const OptTensor& indices, const OptTensor& attn_sink,
                                    const OptTensor& extra_k_cache, const OptTensor& extra_indices_in_kvcache,
                                    const OptTensor& topk_length, const OptTensor& extra_topk_length);

std::vector<Tensor> sparse_prefill_fwd(const Tensor& q, const Tensor& kv, const Tensor& indices, double sm_scale,
                                       int64_t d_v, const OptTensor& attn_sink, const OptTensor& topk_length);

Tensor quantize_kv_fp8(const Tensor& kv, c10::string_view fmt);
Tensor dequantize_kv_fp8(const Tensor& kv, c10::string_view fmt);

}  // namespace mla::torch_ops
