// Where a torch op runs: the device of q, its current stream, and the CUDA entry points behind a
// CUDA-free interface (this header compiles without the CUDA toolkit).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>

#include "mla/params.h"
#include "mla/plan.h"

namespace mla::torch_ops {

// SMs a plan for `device` spreads its work over (CPU: the CPU backend's virtual SMs).
int num_sms(c10::Device device);

// Makes `device` current for the call's lifetime (whatever device was current) and gives its
// current stream.
class DeviceContext {
 public:
  DeviceContext(const char* op, c10::Device device);
  void* stream() const { return stream_.native_handle(); }
  // Raises a torch error naming the op when a CUDA call failed (err is a cudaError_t).
  void check(int err, const char* what) const;

 private:
  const char* op_;
  c10::DeviceGuard guard_;
  c10::Stream stream_;
};

// The CUDA entry points of mla.h; each returns a cudaError_t. In a build without CUDA kernels they
// raise an error saying so.
int cuda_plan_decode(const DecodePlanParams& params, void* stream);
int cuda_dense_decode(const DenseDecodeParams& params, void* stream);
int cuda_sparse_decode(const SparseDecodeParams& params, void* stream);
int cuda_sparse_prefill(const SparsePrefillParams& params, void* stream);

}  // namespace mla::torch_ops
