// Split combine: merges the fp32 partials of every split request into out / lse
// (reference/flashmla-semantics.md §5.3), folding the attention sink into the normaliser.
//
// Grid (b * s_q, ceil(h_q / 4), 1, 2 or 4), 128 threads: one warp per (request, query row, head)
// and one, two or all four quarters of the 512 output columns, so that a batch of a few long
// requests (b = 1, 128 heads, 132 splits: 35 MB of partials) still spreads its reads over every SM
// while a large batch does not launch four times the CTAs. The lanes reduce the split lse values
// (any number of splits: no compiled maximum) and each lane computes the weight of one split in
// every 32; then each lane owns one float4 of a quarter and accumulates the weighted partials,
// eight splits' loads in flight at a time, in split order. Requests with a single piece were
// written by the attention kernel and are skipped.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../implementations.h"
#include "mla/mla.h"

namespace mla::cuda {

namespace {

constexpr int kWarpSize = 32;
constexpr int kHeadsPerCta = 4;
constexpr int kThreads = kHeadsPerCta * kWarpSize;
constexpr int kColumnGroups = kHeadDimV / (4 * kWarpSize);  // a warp's lanes own one float4 each
static_assert(kHeadDimV % (4 * kWarpSize) == 0, "each lane owns whole float4 columns of d_v");
constexpr long long kSpreadWarps = 8192;  // warps up to which the quarters go to separate warps
constexpr int kSplitsInFlight = 8;  // partial rows loaded before the first is accumulated
static_assert(kWarpSize % kSplitsInFlight == 0, "a batch of loads never crosses a 32-split round");

__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ void store4(__nv_bfloat16* dst, float4 v) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  reinterpret_cast<__nv_bfloat162*>(dst)[0] = lo;
  reinterpret_cast<__nv_bfloat162*>(dst)[1] = hi;
}
__device__ __forceinline__ void store4(__half* dst, float4 v) {
  reinterpret_cast<__half2*>(dst)[0] = __floats2half2_rn(v.x, v.y);
  reinterpret_cast<__half2*>(dst)[1] = __floats2half2_rn(v.z, v.w);
}

template <typename OutT>
__global__ void __launch_bounds__(kThreads) combine_kernel(CombineParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // the attention kernel's partials are complete
#endif
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int i = blockIdx.x / p.s_q, s = blockIdx.x % p.s_q;
  const int h = blockIdx.y * kHeadsPerCta + warp;
  if (h >= p.h_q) return;
  const int first = p.split.num_splits[i];
  const int n = p.split.num_splits[i + 1] - first;
  // Split rows live in [0, b + num_sm_parts): a foreign num_splits must not read outside them.
  if (n <= 1 || first < 0 || first + n > p.b + p.split.num_sm_parts) return;
  auto row = [&](int k) { return (int64_t(first + k) * p.s_q + s) * p.h_q + h; };

  float m = -INFINITY;
  for (int k = lane; k < n; k += kWarpSize) m = fmaxf(m, p.split.lse_accum[row(k)]);
  m = warp_max(m);
  if (m == -INFINITY) m = 0.f;
  float sum = 0.f;
  for (int k = lane; k < n; k += kWarpSize) sum += exp2f(p.split.lse_accum[row(k)] - m);
  sum = warp_sum(sum);
  float g = sum == 0.f ? INFINITY : log2f(sum) + m;
  if (lane == 0 && blockIdx.z == 0) p.o.lse[i * p.o.lse_stride_b + s * p.o.lse_stride_s + h * p.o.lse_stride_h] = g * kLn2;
  // Fold the sink into the normaliser: g = log2(2^g + 2^sink2).
  const float sink2 = p.attn_sink ? p.attn_sink[h] * kLog2e : -INFINITY;
  g = g != INFINITY ? g + log2f(1.f + exp2f(sink2 - g)) : (sink2 == -INFINITY ? INFINITY : sink2);

  for (int group = blockIdx.z; group < kColumnGroups; group += gridDim.z) {
    const int col = (group * kWarpSize + lane) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int base = 0; base < n; base += kWarpSize) {
      const int count = min(n - base, kWarpSize);
      const float lane_w = lane < count ? exp2f(p.split.lse_accum[row(base + lane)] - g) : 0.f;
      for (int k0 = 0; k0 < count; k0 += kSplitsInFlight) {
        float4 v[kSplitsInFlight];
#pragma unroll
        for (int u = 0; u < kSplitsInFlight; ++u)
          if (k0 + u < count) v[u] = *reinterpret_cast<const float4*>(p.split.o_accum + row(base + k0 + u) * kHeadDimV + col);
#pragma unroll
        for (int u = 0; u < kSplitsInFlight; ++u) {
          const float w = __shfl_sync(0xffffffffu, lane_w, k0 + u);
          // A split of weight 0 (no key, lse -inf) adds nothing, whatever its partial row holds.
          if (k0 + u < count && w != 0.f) acc.x += w * v[u].x, acc.y += w * v[u].y, acc.z += w * v[u].z, acc.w += w * v[u].w;
        }
      }
    }
    OutT* out = static_cast<OutT*>(p.o.out) + i * p.o.out_stride_b + s * p.o.out_stride_s + h * p.o.out_stride_h;
    store4(out + col, acc);
  }
}

}  // namespace

cudaError_t combine(const CombineParams& p, cudaStream_t stream, bool pdl) {
  if (p.b <= 0 || p.s_q <= 0 || p.h_q <= 0 || p.d_v != kHeadDimV) return cudaErrorInvalidValue;
  cudaLaunchConfig_t config = {};
  // The column quarters go to separate warps (and CTAs) while the grid stays within about two
  // resident waves of warps on an H200 (132 SMs): a few long requests spread their partials over
  // every SM, and a large batch, most of whose CTAs find their request whole and return, does not
  // launch four times the CTAs (b = 128, 128 heads: 4096 CTAs rather than 16384).
  const long long rows = (long long)p.b * p.s_q * p.h_q;
  const unsigned groups = rows * 4 <= kSpreadWarps ? 4u : rows * 2 <= kSpreadWarps ? 2u : 1u;
  config.gridDim = dim3(unsigned(p.b) * unsigned(p.s_q), unsigned((p.h_q + kHeadsPerCta - 1) / kHeadsPerCta), groups);
  config.blockDim = dim3(kThreads, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl && programmatic_launch() ? 1 : 0;
  if (p.o.out_dtype == DType::kFP16) return cudaLaunchKernelEx(&config, combine_kernel<__half>, p);
  return cudaLaunchKernelEx(&config, combine_kernel<__nv_bfloat16>, p);
}

}  // namespace mla::cuda
