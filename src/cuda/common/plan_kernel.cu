// Device planner: one warp. The lanes add up the cost of every request, then lane 0 runs the
// greedy fill shared with the host planner (plan.h), so device and host plans are identical.
// Cost: O(b + num_sm_parts) on one thread, a few microseconds at b = 128; no shared memory, so
// there is no limit on b.
#include <cuda_runtime.h>

#include "mla/mla.h"

namespace mla::cuda {

namespace {

constexpr int kWarpSize = 32;

__global__ void __launch_bounds__(kWarpSize) plan_decode_kernel(DecodePlanParams p) {
  long long total = 0;
  for (int i = threadIdx.x; i < p.b; i += kWarpSize) total += plan_blocks(p, i) + kPlanFixedOverheadBlocks;
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  if (threadIdx.x == 0) plan_fill(p, total);
}

}  // namespace

cudaError_t plan_decode(const DecodePlanParams& params, cudaStream_t stream) {
  if (params.b <= 0 || params.num_sm_parts <= 0) return cudaErrorInvalidValue;
  plan_decode_kernel<<<1, kWarpSize, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mla::cuda
