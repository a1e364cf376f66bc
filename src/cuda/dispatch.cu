// The implementation table and the CUDA entry points of the C++ API: each call runs the first
// implementation (fastest first) that supports the GPU and the call's features, or the one
// MLA_KERNELS_IMPL names.
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "common/plan_block.cuh"
#include "implementations.h"
#include "mla/dispatch.h"
#include "mla/validate.h"

namespace mla::cuda {

namespace {

template <typename Params>
struct Implementation {
  ImplementationInfo info;
  cudaError_t (*run)(const Params&, cudaStream_t);
  bool plans_itself = false;  // makes a fresh plan (split.plan_fresh) in its attention kernel
};

constexpr int kAnyNewer = 1000;
constexpr uint32_t kAnyRows = kFeatHeadsOver16 | kFeatHeadsOver32 | kFeatHeadsOver64;
constexpr uint32_t kDenseAll = kFeatBF16 | kFeatFP16 | kFeatFP8 | kFeatHeadDim576 | kFeatHeadDim512 | kFeatCausal |
                               kFeatPageSize64 | kFeatOtherPageSize | kAnyRows;
constexpr uint32_t kSparseAll = kFeatBF16 | kFeatHeadDim576 | kFeatHeadDim512 | kFeatV32Format | kFeatModel1Format |
                                kFeatAttnSink | kFeatTopkLength | kFeatExtraCache | kFeatExtraTopkLength | kAnyRows;
constexpr uint32_t kPrefillAll = kFeatBF16 | kFeatHeadDim576 | kFeatHeadDim512 | kFeatAttnSink | kFeatTopkLength |
                                 kAnyRows;

// BF16/FP16 caches with 64-token pages (TMA boxes of one page); FP8 and other page sizes fall
// through to the portable kernel. Every row count runs the two-warpgroup 64-row kernel: at 16 rows
// per KV head (h_q = 128 under tensor parallelism 8) it is level with the small-rows kernel (rows
// as wgmma's N, no padding) or ahead (H200, plan reused, each with its own plan's fixed cost:
// b=128 s_k=8192 293.8 against 301.3 us, b=1 s_k=8192 16.9 against 20.3, b=128 s_k=1024 varlen
// 55.9 against 57.4; b=8..64 within 1%). The small-rows kernel stays selectable (sm90_small).
constexpr uint32_t kDenseSm90Small =
    kFeatBF16 | kFeatFP16 | kFeatHeadDim576 | kFeatHeadDim512 | kFeatCausal | kFeatPageSize64 | kFeatHeadsOver16;
constexpr uint32_t kDenseSm90 = kDenseSm90Small | kAnyRows;
// Every sparse feature: at most 32 heads with the heads as wgmma's N, more in 64-head tiles.
constexpr uint32_t kSparseSm90Small = kSparseAll & ~(kFeatHeadsOver32 | kFeatHeadsOver64);
// The V3.2 format only, at most 16 heads. Selectable
// (MLA_KERNELS_IMPL=sm90_frag), never chosen: after sm90_small, which is faster (H200, b=128
// h_q=16 topk 2048, plan reused: 75.0-76.3 against 109.5-111.6 us; sparse_decode_frag.cu says why).
constexpr uint32_t kSparseSm90Frag = kSparseSm90Small & ~(kFeatModel1Format | kFeatHeadDim512 | kFeatHeadsOver16);

const std::vector<Implementation<DenseDecodeParams>> kDense = {
#if defined(MLA_KERNELS_WITH_SM90A)
    {{"sm90", OpKind::kDenseDecode, 90, 90, kDenseSm90}, sm90_dense_decode, true},
    {{"sm90_small", OpKind::kDenseDecode, 90, 90, kDenseSm90Small}, sm90_dense_decode_small, true},
#endif
    {{"portable", OpKind::kDenseDecode, 80, kAnyNewer, kDenseAll}, portable_dense_decode},
};
const std::vector<Implementation<SparseDecodeParams>> kSparse = {
#if defined(MLA_KERNELS_WITH_SM90A)
    {{"sm90_small", OpKind::kSparseDecode, 90, 90, kSparseSm90Small}, sm90_sparse_decode_small, true},
    {{"sm90_frag", OpKind::kSparseDecode, 90, 90, kSparseSm90Frag}, sm90_sparse_decode_frag, true},
    {{"sm90", OpKind::kSparseDecode, 90, 90, kSparseAll}, sm90_sparse_decode, true},
#endif
    {{"portable", OpKind::kSparseDecode, 80, kAnyNewer, kSparseAll}, portable_sparse_decode},
};
const std::vector<Implementation<SparsePrefillParams>> kPrefill = {
    {{"portable", OpKind::kSparsePrefill, 80, kAnyNewer, kPrefillAll}, portable_sparse_prefill},
};

}  // namespace

namespace {

// read(dev) for the current device, read once per device and kept in `cache` (0: not read yet, or
// unreadable, and read again); 0 where the current device is unknown.
template <typename Read>
int once_per_device(std::mutex& mutex, std::vector<int>& cache, const Read& read) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (int(cache.size()) <= dev) cache.resize(dev + 1, 0);
  if (cache[dev] == 0) cache[dev] = read(dev);
  return cache[dev];
}

}  // namespace

int device_arch() {
  static std::mutex mutex;
  static std::vector<int> archs;
  return once_per_device(mutex, archs, [](int dev) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return major * 10 + minor;
  });
}

int device_sm_count() {
  static std::mutex mutex;
  static std::vector<int> counts;
  return once_per_device(mutex, counts, [](int dev) {
    int n = 0;
    return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess ? n : 0;
  });
}

bool programmatic_launch() {
  if (device_arch() < 90) return false;
  const char* env = std::getenv("MLA_KERNELS_PDL");
  return !(env && std::string(env) == "0");
}

bool cluster_merge() {
  const char* env = std::getenv("MLA_KERNELS_CLUSTER_MERGE");
  return !(env && std::string(env) == "0");
}

namespace {

std::string forced_implementation() {
  const char* env = std::getenv("MLA_KERNELS_IMPL");
  return env ? env : "";
}

template <typename Params>
std::vector<ImplementationInfo> infos_of(const std::vector<Implementation<Params>>& table) {
  std::vector<ImplementationInfo> infos;
  for (const auto& impl : table) infos.push_back(impl.info);
  return infos;
}

// A decode call that brought no plan gets one from the planner kernel first (and then has one),
// unless its implementation plans in its attention kernel (no kernel boundary between planning and
// work): those kernels keep the planner's part costs in a key buffer, which holds them for up to
// kPlanMaxPartsIn64KB parts (far more than SMs).
cudaError_t plan_if_fresh(DecodeSplit& split, const DecodePlanParams& pp, cudaStream_t stream) {
  if (!split.plan_fresh) return cudaSuccess;
  split.plan_fresh = false;
  return plan_decode(pp, stream);
}
cudaError_t plan_if_fresh(DenseDecodeParams& p, cudaStream_t stream) {
  return plan_if_fresh(p.split, dense_plan_params(p), stream);
}
cudaError_t plan_if_fresh(SparseDecodeParams& p, cudaStream_t stream) {
  return plan_if_fresh(p.split, sparse_plan_params(p), stream);
}
cudaError_t plan_if_fresh(SparsePrefillParams&, cudaStream_t) { return cudaSuccess; }
int parts_of(const DenseDecodeParams& p) { return p.split.num_sm_parts; }
int parts_of(const SparseDecodeParams& p) { return p.split.num_sm_parts; }
int parts_of(const SparsePrefillParams&) { return 0; }

// The host-side checks of the C++ API (mla::Error naming the argument), before anything launches.
void validate_call(const DenseDecodeParams& p) {
  validate(p), validate_split(p.split), validate_device_output(p.o, p.b, p.s_q, p.h_q);
}
void validate_call(const SparseDecodeParams& p) {
  validate(p), validate_split(p.split), validate_device_output(p.o, p.b, p.s_q, p.h_q);
}
void validate_call(const SparsePrefillParams& p) { validate(p); }

template <typename Params>
cudaError_t run(const std::vector<Implementation<Params>>& table, OpKind op, const Params& p, cudaStream_t stream) {
  validate_call(p);
  static const std::vector<ImplementationInfo> infos = infos_of(table);
  const int i = select_implementation(infos, op, device_arch(), required_features(p), forced_implementation());
  Params call = p;
  if (!table[i].plans_itself || parts_of(call) > kPlanMaxPartsIn64KB) {
    const cudaError_t err = plan_if_fresh(call, stream);
    if (err != cudaSuccess) return err;
  }
  return table[i].run(call, stream);
}

}  // namespace

const char* implementation_name(OpKind op, uint32_t features) {
  static const std::vector<ImplementationInfo> infos = [] {
    std::vector<ImplementationInfo> all;
    for (const auto& part : {infos_of(kDense), infos_of(kSparse), infos_of(kPrefill)})
      all.insert(all.end(), part.begin(), part.end());
    return all;
  }();
  return infos[select_implementation(infos, op, device_arch(), features, forced_implementation())].name;
}

cudaError_t dense_decode(const DenseDecodeParams& p, cudaStream_t stream) {
  return run(kDense, OpKind::kDenseDecode, p, stream);
}
cudaError_t sparse_decode(const SparseDecodeParams& p, cudaStream_t stream) {
  return run(kSparse, OpKind::kSparseDecode, p, stream);
}
cudaError_t sparse_prefill(const SparsePrefillParams& p, cudaStream_t stream) {
  return run(kPrefill, OpKind::kSparsePrefill, p, stream);
}

}  // namespace mla::cuda
