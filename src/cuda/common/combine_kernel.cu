// Split combine: merges the fp32 partials of every split request into out / lse
// (reference/flashmla-semantics.md §5.3), folding the attention sink into the normaliser.
//
// Grid (b * s_q, ceil(h_q / 4), 1, 2 or 4), 128 threads: one warp per (request, query row, head)
// and one, two or all four quarters of the 512 output columns, so that a batch of a few long
// requests (b = 1, 128 heads, 132 splits: 35 MB of partials) still spreads its reads over every SM
// while a large batch does not launch four times the CTAs. Each lane owns one float4 of each of
// the warp's quarters.
//
// A warp's work is a short chain of memory latencies (the split range, the split lse values, the
// partial rows, the store), and in a large batch most requests have two or three splits: the chain,
// not the bytes, sets the time. So the warp loads its first batch of partial rows (eight float4 per
// lane: every quarter of two splits, or one quarter of eight) before it reduces the lse values,
// which do not gate the loads, and a batch covers the warp's quarters of a split together. The
// lanes reduce the lse values of any number of splits (no compiled maximum); lane k holds the
// weight of split k in every 32. Partials are accumulated in split order. Requests with a single
// piece were written by the attention kernel and are skipped.
//
// H200, plan reused: before this order (one quarter after another, the lse read first) the combine
// took 17.8 us under ncu on dense b=128 h_q=128 s_k=4096 varlen (FlashMLA's 11.4) and 14.8 on
// sparse MODEL1 b=128 h_q=128 (9.0); with it the API calls went 254 -> 245 us and 84.5 -> 77.8.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../implementations.h"
#include "decode_io.cuh"
#include "mla/mla.h"

namespace mla::cuda {

namespace {

constexpr int kWarpSize = 32;
constexpr int kHeadsPerCta = 4;
constexpr int kThreads = kHeadsPerCta * kWarpSize;
constexpr int kColumnGroups = kHeadDimV / (4 * kWarpSize);  // a warp's lanes own one float4 each
static_assert(kColumnGroups == 4 && kHeadDimV % (4 * kWarpSize) == 0, "d_v is four quarters of one float4 per lane");
constexpr int kLoadsInFlight = 8;  // float4 loads per lane in one batch of partial rows
constexpr int kMinCtasPerSm = 8;   // 64 registers: 32 warps per SM keep their chains in flight

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

template <typename OutT, int kQuarters>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) combine_kernel(CombineParams p) {
  constexpr int kBatch = kLoadsInFlight / kQuarters;  // splits per batch of loads
  static_assert(kBatch * kQuarters == kLoadsInFlight && kWarpSize % kBatch == 0, "a batch never crosses a 32-split round");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The next kernel on the stream, where it is a programmatic dependent (the next call's attention
  // kernel), launches once every CTA here has started: its CTAs take SMs as these drain, and wait
  // for this grid to end before they read anything.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int i = blockIdx.x / p.s_q, s = blockIdx.x % p.s_q;
  const int h = blockIdx.y * kHeadsPerCta + warp;
  if (h >= p.h_q) return;
  // A fresh plan's num_splits is the attention kernel's output: read after the wait. A plan made
  // before this call is complete before this kernel can launch (every attention CTA passes its own
  // dependency wait before it releases this kernel): read first, so that the CTAs of whole requests
  // (all of this CTA's warps have one request) leave without waiting, while the attention kernel
  // still runs where it released this kernel early.
  auto wait_for_partials = [] {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cudaGridDependencySynchronize();  // the attention kernel's partials are complete
#endif
  };
  const bool plan_fresh = p.split.plan_fresh;
  if (plan_fresh) wait_for_partials();
  const int first = p.split.num_splits[i];
  const int n = p.split.num_splits[i + 1] - first;
  // Split rows live in [0, b + num_sm_parts): a foreign num_splits must not read outside them.
  if (n <= 1 || first < 0 || first + n > p.b + p.split.num_sm_parts) return;
  if (!plan_fresh) wait_for_partials();
  auto row = [&](int k) { return (int64_t(first + k) * p.s_q + s) * p.h_q + h; };
  // This warp's quarters are blockIdx.z, blockIdx.z + gridDim.z, ... (gridDim.z * kQuarters == kColumnGroups).
  int col[kQuarters];
#pragma unroll
  for (int q = 0; q < kQuarters; ++q) col[q] = ((blockIdx.z + q * gridDim.z) * kWarpSize + lane) * 4;
  float4 v[kBatch][kQuarters];
  auto load_batch = [&](int k0) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (k0 + u < n) {
        const float* src = p.split.o_accum + row(k0 + u) * kHeadDimV;
#pragma unroll
        for (int q = 0; q < kQuarters; ++q) v[u][q] = __ldcs(reinterpret_cast<const float4*>(src + col[q]));
      }
    }
  };
  load_batch(0);  // in flight while the lse values are read and reduced

  const float lse0 = lane < n ? p.split.lse_accum[row(lane)] : -INFINITY;
  float m = lse0;
  for (int k = lane + kWarpSize; k < n; k += kWarpSize) m = fmaxf(m, p.split.lse_accum[row(k)]);
  m = warp_max(m);
  if (m == -INFINITY) m = 0.f;
  float sum = lane < n ? exp2f(lse0 - m) : 0.f;
  for (int k = lane + kWarpSize; k < n; k += kWarpSize) sum += exp2f(p.split.lse_accum[row(k)] - m);
  sum = warp_sum(sum);
  float g = sum == 0.f ? INFINITY : log2f(sum) + m;
  if (lane == 0 && blockIdx.z == 0) p.o.lse[i * p.o.lse_stride_b + s * p.o.lse_stride_s + h * p.o.lse_stride_h] = g * kLn2;
  // Fold the sink into the normaliser: g = log2(2^g + 2^sink2).
  const float sink2 = p.attn_sink ? p.attn_sink[h] * kLog2e : -INFINITY;
  g = decode_io::fold_sink(g, sink2);

  float4 acc[kQuarters];
#pragma unroll
  for (int q = 0; q < kQuarters; ++q) acc[q] = make_float4(0.f, 0.f, 0.f, 0.f);
  float lane_w = lane < n ? exp2f(lse0 - g) : 0.f;
  for (int k0 = 0; k0 < n; k0 += kBatch) {
    if (k0 != 0) {
      if (k0 % kWarpSize == 0) lane_w = k0 + lane < n ? exp2f(p.split.lse_accum[row(k0 + lane)] - g) : 0.f;
      load_batch(k0);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const float w = __shfl_sync(0xffffffffu, lane_w, (k0 + u) % kWarpSize);
      // A split of weight 0 (no key, lse -inf) adds nothing, whatever its partial row holds.
      if (k0 + u < n && w != 0.f) {
#pragma unroll
        for (int q = 0; q < kQuarters; ++q)
          acc[q].x += w * v[u][q].x, acc[q].y += w * v[u][q].y, acc[q].z += w * v[u][q].z, acc[q].w += w * v[u][q].w;
      }
    }
  }
  OutT* out = static_cast<OutT*>(p.o.out) + i * p.o.out_stride_b + s * p.o.out_stride_s + h * p.o.out_stride_h;
#pragma unroll
  for (int q = 0; q < kQuarters; ++q) store4(out + col[q], acc[q]);
}

}  // namespace

cudaError_t combine(const CombineParams& p, cudaStream_t stream, bool pdl) {
  if (p.b <= 0 || p.s_q <= 0 || p.h_q <= 0 || p.d_v != kHeadDimV) return cudaErrorInvalidValue;
  cudaLaunchConfig_t config = {};
  // The column quarters go to separate warps (and CTAs) while the grid stays within one resident
  // wave of warps (kMinCtasPerSm CTAs per SM): a few long requests spread their partials over every
  // SM, and a large batch, most of whose CTAs find their request whole and return, does not launch
  // four times the CTAs (b = 128, 128 heads: 4096 CTAs rather than 16384). The earlier bound, 8192
  // warps (two waves on 132 SMs), was slower in every shape timed where the two differ, rows from a
  // quarter of a wave to about one wave (H100, plan reused: sparse b=64 h_q=32 57.2 / 57.7 -> 56.0 /
  // 55.6 us, b=128 h_q=16 81.4 / 81.1 -> 80.3 / 80.5; dense h_q=128 b=16 s_k=8192 varlen 87.6 ->
  // 85.6, b=32 s_k=4096 74.3 -> 73.4).
  const int sms = device_sm_count();
  const long long wave = (long long)(sms > 0 ? sms : 132) * kMinCtasPerSm * kHeadsPerCta;
  const long long rows = (long long)p.b * p.s_q * p.h_q;
  const unsigned groups = rows * 4 <= wave ? 4u : rows * 2 <= wave ? 2u : 1u;
  config.gridDim = dim3(unsigned(p.b) * unsigned(p.s_q), unsigned((p.h_q + kHeadsPerCta - 1) / kHeadsPerCta), groups);
  config.blockDim = dim3(kThreads, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl && programmatic_launch() ? 1 : 0;
  const bool fp16 = p.o.out_dtype == DType::kFP16;
  const unsigned quarters = kColumnGroups / groups;  // per warp: the kernel's kQuarters
  switch (quarters) {
    case 1: return cudaLaunchKernelEx(&config, fp16 ? combine_kernel<__half, 1> : combine_kernel<__nv_bfloat16, 1>, p);
    case 2: return cudaLaunchKernelEx(&config, fp16 ? combine_kernel<__half, 2> : combine_kernel<__nv_bfloat16, 2>, p);
    default: return cudaLaunchKernelEx(&config, fp16 ? combine_kernel<__half, 4> : combine_kernel<__nv_bfloat16, 4>, p);
  }
}

}  // namespace mla::cuda
