// Host side: raising a kernel's dynamic shared-memory limit, once per device (64 devices at most)
// rather than on every launch, with a clear error where the GPU allows less than the kernel needs.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "mla/types.h"

namespace mla::cuda {

// `Kernel` is the __global__ function; `what` names it in the error (e.g. "the portable kernel"),
// `hint` follows the numbers (may be empty).
template <auto Kernel>
cudaError_t raise_smem_limit_once(int bytes, const char* what, const char* hint = "") {
  static std::atomic<uint64_t> configured{0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (configured.load(std::memory_order_acquire) & bit) return cudaSuccess;
  int allowed = 0;
  err = cudaDeviceGetAttribute(&allowed, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return err;
  MLA_CHECK(bytes <= allowed, what, " needs ", bytes / 1024, " KB of shared memory per block and this GPU allows ",
            allowed / 1024, " KB", hint);
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  configured.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

}  // namespace mla::cuda
