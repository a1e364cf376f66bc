// Explicit instantiation of the portable kernel for one Problem; each instantiations/*.cu file
// holds one, so the variants compile in parallel.
#pragma once

#include "problems.cuh"

// Every instantiation the entry points use; entry.cu declares them extern.
#define MLA_PORTABLE_VARIANTS(X)                                                              \
  X(DenseProblem<__nv_bfloat16, 576>) X(DenseProblem<__nv_bfloat16, 512>)                     \
  X(DenseProblem<__half, 576>) X(DenseProblem<__half, 512>)                                   \
  X(DenseProblem<__nv_fp8_e4m3, 576>) X(DenseProblem<__nv_fp8_e4m3, 512>)                     \
  X(SparseProblem<mla::KvFormat::kV32>) X(SparseProblem<mla::KvFormat::kModel1>)              \
  X(PrefillProblem<576>) X(PrefillProblem<512>)

#define MLA_PORTABLE_DECLARE(...)                                                                                \
  extern template cudaError_t mla::cuda::portable::launch<mla::cuda::portable::__VA_ARGS__>(                      \
      const typename mla::cuda::portable::__VA_ARGS__::Params&, dim3, cudaStream_t);

#define MLA_PORTABLE_INSTANTIATE(...)                                                                      \
  template cudaError_t mla::cuda::portable::launch<__VA_ARGS__>(const typename __VA_ARGS__::Params&, dim3, \
                                                                cudaStream_t);
