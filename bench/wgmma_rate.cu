// How many cycles the warpgroup MMA shapes of the sm90 kernels take on one SM, issued back to back
// by one warpgroup with both operands in shared memory, as the small-heads sparse kernel issues
// them (S^T = K Q^T: 36 m64n16k16 into one accumulator; O^T = V^T P^T: 8 accumulators x 4 k-steps),
// beside the wider shapes the 64-row kernels use. It answers whether a product of the small-heads
// kernel is bound by the tensor cores' arithmetic rate, by its operand reads from shared memory,
// or by a cost per instruction (bench/RESULTS.md).
//
//   nvcc -O3 -std=c++17 -I src -gencode arch=compute_90a,code=sm_90a -cudart static \
//        -o build/wgmma_rate bench/wgmma_rate.cu
//   build/wgmma_rate
//
// Each chain is timed with clock64 from its first issue to the wait for its last result, 64 times
// per CTA after a warm-up; one CTA per SM on every SM (so the SM has no other work). Printed: the
// median over CTAs of each CTA's mean, and of each CTA's fastest chain. The operands are zeros: the rate of the tensor
// cores does not depend on the values.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/sm90/ptx_sm90.cuh"
#include "cuda_check.h"

namespace {

using namespace mla::cuda::sm90;
using bf16 = __nv_bfloat16;

constexpr int kReps = 64;
constexpr int kSmemA = 9 * 8192;   // nine 64 x 128-byte tiles: 64 keys x 576 bf16
constexpr int kSmemB = 9 * 8192;   // room for every B operand below (at most 64 x 576 bf16)
constexpr int kSmem = kSmemA + kSmemB + 1024;

enum Shape { kSmallS16, kSmallO16, kSmallS32, kWideS64, kWideO256, kShapes };
const char* const kNames[kShapes] = {
    "S^T m64n16k16 x36, one accumulator (small-heads S)",
    "O^T m64n16k16 x32, 8 accumulators x 4 (small-heads O)",
    "S^T m64n32k16 x36, one accumulator",
    "S   m64n64k16 x36, one accumulator (64-row S)",
    "O   m64n256k16 x8, 2 accumulators x 4 (64-row O, half of d_v)",
};
constexpr int kInstructions[kShapes] = {36, 32, 36, 36, 8};
constexpr double kFlops[kShapes] = {36.0 * 2 * 64 * 16 * 16, 32.0 * 2 * 64 * 16 * 16, 36.0 * 2 * 64 * 32 * 16,
                                    36.0 * 2 * 64 * 64 * 16, 8.0 * 2 * 64 * 256 * 16};

// S^T of a small-heads block: 36 m64nNk16 products into one accumulator, A the 576-dim key tile
// (8 KB per 64 dims), B the N-row Q tile (N * 128 bytes per 64 dims).
template <int N>
__device__ __forceinline__ void small_s_chain(float (&acc)[128], uint64_t da, uint64_t db) {
  float(&d)[N / 2] = reinterpret_cast<float(&)[N / 2]>(acc[0]);
#pragma unroll
  for (int i = 0; i < 36; ++i)
    wgmma_ss_small<bf16, N, 0>(d, desc_offset(da, (i / 4) * 8192 + (i % 4) * 32),
                               desc_offset(db, (i / 4) * (N * 128) + (i % 4) * 32), 1);
}

template <int kShape>
__global__ void __launch_bounds__(128, 1) rate(long long* cycles, float* sink) {
#if defined(MLA_SM90A_DEVICE)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  for (int i = threadIdx.x; i < (kSmemA + kSmemB) / 16; i += 128) reinterpret_cast<uint4*>(base)[i] = uint4{};
  __syncthreads();
  fence_proxy_async();
  const uint64_t da = smem_desc(base, 0, 1024), db = smem_desc(base + kSmemA, 0, 1024);
  const uint64_t dv = smem_desc(base + kSmemA, 8192, 1024);  // MN-major: 64-column tiles 8 KB apart
  float acc[128] = {};
  long long best = 1ll << 62, total = 0;
  for (int r = -4; r < kReps; ++r) {
    wgmma_fence();
    const long long t0 = clock64();
    if constexpr (kShape == kSmallS16) {
      small_s_chain<16>(acc, da, db);
    } else if constexpr (kShape == kSmallO16) {
#pragma unroll
      for (int mt = 0; mt < 8; ++mt)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_ss_small<bf16, 16, 1>(reinterpret_cast<float(&)[8]>(acc[mt * 8]),
                                      desc_offset(da, mt * 8192 + kk * 2048), desc_offset(db, kk * 32), 1);
    } else if constexpr (kShape == kSmallS32) {
      small_s_chain<32>(acc, da, db);
    } else if constexpr (kShape == kWideS64) {
      float(&d)[32] = reinterpret_cast<float(&)[32]>(acc[0]);
#pragma unroll
      for (int i = 0; i < 36; ++i)
        wgmma_ss_k<bf16>(d, desc_offset(da, (i / 4) * 8192 + (i % 4) * 32), desc_offset(db, (i / 4) * 8192 + (i % 4) * 32),
                         1);
    } else {
      float(&d)[128] = reinterpret_cast<float(&)[128]>(acc[0]);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) wgmma_ss_v<bf16>(d, desc_offset(da, (kk % 4) * 32), desc_offset(dv, kk * 2048), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    const long long t1 = clock64();
    if (r >= 0) best = min(best, t1 - t0), total += t1 - t0;
  }
  if (threadIdx.x == 0) cycles[2 * blockIdx.x] = best, cycles[2 * blockIdx.x + 1] = total / kReps;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) s += acc[i];
  if (s != 0.f) sink[threadIdx.x] = s;  // never true: zeros in, zeros out; keeps the products
#endif
}

template <int kShape>
void run(int sms, long long* d_cycles, float* d_sink) {
  CHECK(cudaFuncSetAttribute(rate<kShape>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  rate<kShape><<<sms, 128, kSmem>>>(d_cycles, d_sink);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(2 * sms), best(sms), mean(sms);
  CHECK(cudaMemcpy(c.data(), d_cycles, 2 * sms * sizeof(long long), cudaMemcpyDeviceToHost));
  for (int i = 0; i < sms; ++i) best[i] = c[2 * i], mean[i] = c[2 * i + 1];
  std::sort(best.begin(), best.end());
  std::sort(mean.begin(), mean.end());
  const double med = double(mean[sms / 2]);
  // Against Hopper's dense bf16 rate: 4096 FLOPs per cycle per SM (989 TFLOPS at 1830 MHz, 132 SMs).
  std::printf("%-62s %7.0f cycles (fastest %lld)  %6.1f per instruction  %5.1f%% of the SM's bf16 rate\n",
              kNames[kShape], med, best[sms / 2], med / kInstructions[kShape], 100.0 * kFlops[kShape] / med / 4096.0);
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  long long* d_cycles = nullptr;
  float* d_sink = nullptr;
  CHECK(cudaMalloc(&d_cycles, 2 * sms * sizeof(long long)));
  CHECK(cudaMalloc(&d_sink, 128 * sizeof(float)));
  std::printf("one warpgroup per SM, %d SMs, cycles of a chain from first issue to last result\n", sms);
  run<kSmallS16>(sms, d_cycles, d_sink);
  run<kSmallO16>(sms, d_cycles, d_sink);
  run<kSmallS32>(sms, d_cycles, d_sink);
  run<kWideS64>(sms, d_cycles, d_sink);
  run<kWideO256>(sms, d_cycles, d_sink);
  return 0;
}
