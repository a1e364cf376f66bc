// The portable kernels as implementations: pick the instantiation for a call, launch it on the
// caller's stream, then the split combine (programmatic dependent launch).
#include "../implementations.h"
#include "launch.cuh"

MLA_PORTABLE_VARIANTS(MLA_PORTABLE_DECLARE)

namespace mla::cuda {

namespace {

using portable::DenseProblem;
using portable::PrefillProblem;
using portable::SparseProblem;

template <class Problem>
cudaError_t launch_dense(const DenseDecodeParams& p, cudaStream_t stream) {
  const int rows = p.s_q * (p.h_q / p.h_k);
  const dim3 grid(unsigned(ceil_div(rows, portable::kRows)), unsigned(p.h_k), unsigned(p.split.num_sm_parts));
  return portable::launch<Problem>(p, grid, stream);
}

template <int D>
cudaError_t dense_for_dim(const DenseDecodeParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBF16: return launch_dense<DenseProblem<__nv_bfloat16, D>>(p, stream);
    case DType::kFP16: return launch_dense<DenseProblem<__half, D>>(p, stream);
    case DType::kFP8E4M3: return launch_dense<DenseProblem<__nv_fp8_e4m3, D>>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t portable_dense_decode(const DenseDecodeParams& p, cudaStream_t stream) {
  cudaError_t err = p.d_qk == kHeadDimV32 ? dense_for_dim<576>(p, stream) : dense_for_dim<512>(p, stream);
  if (err != cudaSuccess) return err;
  return combine(combine_params(p.b, p.s_q, p.h_q, p.split, p.o, nullptr), stream, /*pdl=*/device_arch() >= 90);
}

cudaError_t portable_sparse_decode(const SparseDecodeParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(ceil_div(p.h_q, portable::kRows)), unsigned(p.s_q), unsigned(p.split.num_sm_parts));
  cudaError_t err = p.format == KvFormat::kV32 ? portable::launch<SparseProblem<KvFormat::kV32>>(p, grid, stream)
                                               : portable::launch<SparseProblem<KvFormat::kModel1>>(p, grid, stream);
  if (err != cudaSuccess) return err;
  return combine(combine_params(p.b, p.s_q, p.h_q, p.split, p.o, p.attn_sink), stream, /*pdl=*/device_arch() >= 90);
}

cudaError_t portable_sparse_prefill(const SparsePrefillParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.s_q) * unsigned(ceil_div(p.h_q, portable::kRows)), 1, 1);
  return p.d_qk == kHeadDimV32 ? portable::launch<PrefillProblem<576>>(p, grid, stream)
                               : portable::launch<PrefillProblem<512>>(p, grid, stream);
}

}  // namespace mla::cuda
