// Every CUDA implementation of every op, declared for the dispatch table (dispatch.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "mla/mla.h"

namespace mla::cuda {

// Compute capability x 10 of the current device (read once per device).
int device_arch();
// The current device's SM count (read once per device), 0 where it cannot be read.
int device_sm_count();

// Whether kernels may be launched as programmatic dependents of the kernel before them (sm90+,
// unless MLA_KERNELS_PDL=0, read at each call: every kernel then starts after its predecessor
// ends, for debugging and for measuring what the overlap is worth).
bool programmatic_launch();

// Whether the Hopper small-heads sparse kernel may merge an even split's two pieces in a cluster
// instead of launching the combine (unless MLA_KERNELS_CLUSTER_MERGE=0, read at each call: for
// measuring what the merge is worth).
bool cluster_merge();

// The combine of a decode call's split pieces (sink: the sparse call's attention sink, or null),
// which every decode implementation launches after its attention kernel (the Hopper sparse ones
// not where their own plan keeps every request whole: combine_sparse).
inline CombineParams combine_params(int b, int s_q, int h_q, const DecodeSplit& split, const DecodeOutput& o,
                                    const float* sink) {
  CombineParams c;
  c.b = b, c.s_q = s_q, c.h_q = h_q;
  c.split = split;
  c.o = o;
  c.attn_sink = sink;
  return c;
}

// The combine after a Hopper sparse attention kernel, unless that kernel made the call's plan
// itself and the plan keeps every request whole: a call whose requests all have the same blocks
// (the usual V3.2 call), whose plan follows from its shape (plan_uniform_choice, the planner's own
// test). Every piece then wrote out / lse, and the combine would only wait for the attention kernel
// to end and find no split. A plan made before the call may be any plan: the combine runs.
// fresh_uniform_choice: what the call's own plan does where the call plans for itself (nothing known
// otherwise); a launcher that already asked passes its answer.
inline PlanUniformChoice fresh_uniform_choice(const SparseDecodeParams& p) {
  return p.split.plan_fresh ? plan_uniform_choice(sparse_plan_params(p)) : PlanUniformChoice{};
}
inline cudaError_t combine_sparse(const SparseDecodeParams& p, cudaStream_t stream, const PlanUniformChoice& fresh) {
  if (fresh.whole) return cudaSuccess;
  return combine(combine_params(p.b, p.s_q, p.h_q, p.split, p.o, p.attn_sink), stream, /*pdl=*/true);
}
inline cudaError_t combine_sparse(const SparseDecodeParams& p, cudaStream_t stream) {
  return combine_sparse(p, stream, fresh_uniform_choice(p));
}

// Portable kernels (sm80+): the whole envelope of SPEC §6.
cudaError_t portable_dense_decode(const DenseDecodeParams& params, cudaStream_t stream);
cudaError_t portable_sparse_decode(const SparseDecodeParams& params, cudaStream_t stream);
cudaError_t portable_sparse_prefill(const SparsePrefillParams& params, cudaStream_t stream);

// Hopper kernels (sm_90a builds only): wgmma, TMA, warpgroup specialisation.
cudaError_t sm90_dense_decode(const DenseDecodeParams& params, cudaStream_t stream);
// At most 32 query rows per KV head (s_q * h_q / h_k <= 32).
cudaError_t sm90_dense_decode_small(const DenseDecodeParams& params, cudaStream_t stream);
// At most 32 heads, both FP8 formats, every sparse feature.
cudaError_t sm90_sparse_decode_small(const SparseDecodeParams& params, cudaStream_t stream);
// At most 16 heads of the V3.2 format, every sparse feature; the keys dequantised into wgmma's
// register operands.
cudaError_t sm90_sparse_decode_frag(const SparseDecodeParams& params, cudaStream_t stream);
// Any number of heads (64 per CTA), both FP8 formats, every sparse feature.
cudaError_t sm90_sparse_decode(const SparseDecodeParams& params, cudaStream_t stream);

}  // namespace mla::cuda
