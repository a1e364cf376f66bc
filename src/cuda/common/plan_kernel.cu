// Device planner: one CTA runs BlockPlanner (plan_block.cuh) over every row. The decode kernel that
// follows is a programmatic dependent: its CTAs may start their prologue now and wait for this
// grid before they read the plan.
#include <cuda_runtime.h>

#include "mla/mla.h"
#include "plan_block.cuh"

namespace mla::cuda {

namespace {

constexpr int kThreads = 256;
using Planner = BlockPlanner<kThreads>;

__global__ void __launch_bounds__(kThreads) plan_decode_kernel(DecodePlanParams p) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  __shared__ Planner::Scratch scratch;
  extern __shared__ unsigned long long part_cost[];
  Planner::plan(p, -1, scratch, part_cost);
}

}  // namespace

cudaError_t plan_decode(const DecodePlanParams& params, cudaStream_t stream) {
  if (params.b <= 0 || params.num_sm_parts <= 0) return cudaErrorInvalidValue;
  const size_t smem = Planner::part_cost_bytes(params.num_sm_parts);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;  // num_sm_parts is at most the SM count
  plan_decode_kernel<<<1, kThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mla::cuda
