#include "device.h"

#include "checks.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <vector>

#include "mla/reference.h"

#if defined(MLA_KERNELS_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "mla/mla.h"
#endif

namespace mla::torch_ops {

namespace {

c10::Stream current_stream(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

[[noreturn]] void no_cuda() {
  TORCH_CHECK(false, "mla_kernels: this build has no CUDA kernels; reinstall on a machine with nvcc "
                     "(tools/setup.sh builds them when a GPU is present)");
}

}  // namespace

DeviceContext::DeviceContext(const char* op, c10::Device device)
    : op_(op), guard_(device), stream_(current_stream(device)) {}

int num_sms(c10::Device device) {
  if (!device.is_cuda()) return reference::kVirtualSms;
#if defined(MLA_KERNELS_WITH_CUDA)
  // Read once per device; the count never changes.
  static std::mutex mutex;
  static std::vector<int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  const int index = device.index() < 0 ? 0 : device.index();
  if (int(counts.size()) <= index) counts.resize(index + 1, 0);
  if (counts[index] == 0) {
    const cudaError_t err = cudaDeviceGetAttribute(&counts[index], cudaDevAttrMultiProcessorCount, index);
    MLA_TORCH_CHECK(err == cudaSuccess, "mla_kernels: cannot read the SM count of ", device, ": ",
                cudaGetErrorString(err));
  }
  return counts[index];
#else
  no_cuda();
#endif
}

#if defined(MLA_KERNELS_WITH_CUDA)

void DeviceContext::check(int err, const char* what) const {
  MLA_TORCH_CHECK(err == cudaSuccess, op_, ": ", what, " failed to launch: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

int cuda_plan_decode(const DecodePlanParams& p, void* stream) {
  return cuda::plan_decode(p, static_cast<cudaStream_t>(stream));
}
int cuda_dense_decode(const DenseDecodeParams& p, void* stream) {
  return cuda::dense_decode(p, static_cast<cudaStream_t>(stream));
}
int cuda_sparse_decode(const SparseDecodeParams& p, void* stream) {
  return cuda::sparse_decode(p, static_cast<cudaStream_t>(stream));
}
int cuda_sparse_prefill(const SparsePrefillParams& p, void* stream) {
  return cuda::sparse_prefill(p, static_cast<cudaStream_t>(stream));
}

#else

void DeviceContext::check(int, const char*) const { no_cuda(); }
int cuda_plan_decode(const DecodePlanParams&, void*) { no_cuda(); }
int cuda_dense_decode(const DenseDecodeParams&, void*) { no_cuda(); }
int cuda_sparse_decode(const SparseDecodeParams&, void*) { no_cuda(); }
int cuda_sparse_prefill(const SparsePrefillParams&, void*) { no_cuda(); }

#endif

}  // namespace mla::torch_ops
