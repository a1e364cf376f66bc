// The CUDA entry points of the C++ API. Each takes a params struct whose pointers are device
// pointers and a stream; none synchronises with the host, so all are safe inside CUDA-graph capture.
#pragma once

#include <cuda_runtime_api.h>

#include "mla/params.h"
#include "mla/plan.h"

namespace mla::cuda {

// Plans a decode call on the device: fills params.tile_scheduler_metadata [num_sm_parts, 8] and
// params.num_splits [b + 1] exactly as plan_decode_host would. Negative lengths count as 0.
cudaError_t plan_decode(const DecodePlanParams& params, cudaStream_t stream);

// Merges the split partials of a decode call into out / lse, applying the attention sink; launched
// with programmatic dependent launch when `pdl` is set (sm90+), so it overlaps the attention tail.
cudaError_t combine(const CombineParams& params, cudaStream_t stream, bool pdl = false);

}  // namespace mla::cuda
