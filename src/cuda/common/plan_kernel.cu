// Device planner: one warp. The lanes read every request's length once, in parallel, stage its
// block count in shared memory and add up the costs; then lane 0 runs the greedy fill shared with
// the host planner (plan.h: PlanFill), so device and host plans are identical. The fill keeps its
// state in registers and reads each count one request ahead, so a request costs a few dependent
// integer steps and a part one row store. Batches too large for the staging buffer (more than
// 12288 requests) read the counts from global memory instead. The decode kernel that follows is a
// programmatic dependent: its CTAs may start their prologue now; they wait for this grid to finish
// before they read the plan.
#include <cuda_runtime.h>

#include "mla/mla.h"

namespace mla::cuda {

namespace {

constexpr int kWarpSize = 32;

constexpr int kMaxStagedRequests = 48 * 1024 / int(sizeof(int));  // the default dynamic shared-memory limit

__global__ void __launch_bounds__(kWarpSize) plan_decode_kernel(DecodePlanParams p, bool staged) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  extern __shared__ int blocks_of[];
  long long total = 0;
  for (int i = threadIdx.x; i < p.b; i += kWarpSize) {
    const int n = request_blocks(p, i);
    if (staged) blocks_of[i] = n;
    total += (n > 0 ? n : 1) + kPlanFixedOverheadBlocks;
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  __syncwarp();
  if (threadIdx.x != 0) return;
  PlanFill fill(p, total);
  if (staged) {
    int n = blocks_of[0];
    for (int i = 0; i < p.b; ++i) {
      const int next = i + 1 < p.b ? blocks_of[i + 1] : 0;  // loaded while request i is placed
      fill.add(i, n);
      n = next;
    }
  } else {
    for (int i = 0; i < p.b; ++i) fill.add(i, request_blocks(p, i));
  }
  fill.finish();
}

}  // namespace

cudaError_t plan_decode(const DecodePlanParams& params, cudaStream_t stream) {
  if (params.b <= 0 || params.num_sm_parts <= 0) return cudaErrorInvalidValue;
  const bool staged = params.b <= kMaxStagedRequests;
  const size_t smem = staged ? size_t(params.b) * sizeof(int) : 0;
  plan_decode_kernel<<<1, kWarpSize, smem, stream>>>(params, staged);
  return cudaGetLastError();
}

}  // namespace mla::cuda
