// The CUDA entry points of the C++ API. Each takes a params struct whose pointers are device
// pointers and a stream; none synchronises with the host, so all are safe inside CUDA-graph capture.
#pragma once

#include <cuda_runtime_api.h>

#include "mla/dispatch.h"
#include "mla/params.h"
#include "mla/plan.h"

namespace mla::cuda {

// Plans a decode call on the device: fills params.tile_scheduler_metadata [num_sm_parts, 8] and
// params.num_splits [b + 1] exactly as plan_decode_host would. Negative lengths count as 0.
cudaError_t plan_decode(const DecodePlanParams& params, cudaStream_t stream);

// Merges the split partials of a decode call into out / lse, applying the attention sink; launched
// with programmatic dependent launch when `pdl` is set (sm90+), so it overlaps the attention tail.
// It releases the next programmatic dependent on the stream as it starts (see dense_decode).
cudaError_t combine(const CombineParams& params, cudaStream_t stream, bool pdl = false);

// Name of the implementation a call of `op` with `features` would run on the current device
// (honours MLA_KERNELS_IMPL); throws mla::Error when none supports it.
const char* implementation_name(OpKind op, uint32_t features);

// Decode attention, then the split combine, on `stream`. params.split must hold a plan for these
// lengths (plan_decode) and a workspace of decode_workspace_bytes(); pointers are device pointers.
// The implementation comes from the dispatch table (mla/dispatch.h); a call no implementation
// supports throws mla::Error naming the missing features. The params are checked first (mla/validate.h:
// sizes, dtypes, formats, null pointers, the plan and split workspace), each bad one an mla::Error
// naming it; device data (lengths, indices, block tables) cannot be checked without a host sync.
// Alignment: q, caches and their strides at 16 bytes; out at 4 bytes with even strides (an error
// naming out otherwise; rows on 16 bytes take the sm90 kernels' wider stores).
// On sm90 the call's last kernel may release a kernel launched after it as a programmatic dependent
// (cudaLaunchAttributeProgrammaticStreamSerialization) before it ends: such a kernel must call
// cudaGridDependencySynchronize() before it reads out or lse, as the programmatic launch requires.
cudaError_t dense_decode(const DenseDecodeParams& params, cudaStream_t stream);
cudaError_t sparse_decode(const SparseDecodeParams& params, cudaStream_t stream);

// Sparse prefill on `stream` (no split).
cudaError_t sparse_prefill(const SparsePrefillParams& params, cudaStream_t stream);

}  // namespace mla::cuda
