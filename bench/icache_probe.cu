// How the cost of an instruction grows with the size of the code a warp loops over: the
// instruction-cache capacity behind the dense kernel's code-size question (bench/RESULTS.md,
// twenty-seventh session: its code is 229 KB against FlashMLA's 117 KB, hot loops alike, and the
// two attention kernels are level from cold caches but not warm).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -cudart static \
//        -o build/icache_probe bench/icache_probe.cu
//   build/icache_probe
//
// One CTA per SM runs a loop whose body is kInstrs straight-line FFMAs (16 bytes each) over four
// independent accumulators per thread; clock64 times `kReps` passes. Two layouts:
//   same code: eight warps (two per scheduler, as in the dense kernel), all running one body;
//   two codes: warps 0-3 run one body and warps 4-7 another of the same size (the dense kernel's
//     two warpgroups run different code), so the SM fetches twice the bytes.
// Printed: code bytes per warp, the bytes the SM runs in all, and cycles per instruction per warp
// (median over warps; four independent chains of FFMA issue at about one per cycle while the code
// comes from the nearest cache). A step up marks a cache level the loop no longer fits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda_check.h"

namespace {

constexpr int kThreads = 256;
constexpr int kReps = 64;

// kGroups groups of four FFMAs; kVariant changes the operand order, so that two variants are two
// different instruction streams.
template <int kGroups, int kVariant>
__device__ __forceinline__ void body(float (&a)[4], float x, float y) {
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    if constexpr (kVariant == 0)
      asm volatile(
          "fma.rn.f32 %0, %0, %4, %5;\n\tfma.rn.f32 %1, %1, %4, %5;\n\t"
          "fma.rn.f32 %2, %2, %4, %5;\n\tfma.rn.f32 %3, %3, %4, %5;\n"
          : "+f"(a[0]), "+f"(a[1]), "+f"(a[2]), "+f"(a[3])
          : "f"(x), "f"(y));
    else
      asm volatile(
          "fma.rn.f32 %0, %4, %0, %5;\n\tfma.rn.f32 %1, %4, %1, %5;\n\t"
          "fma.rn.f32 %2, %4, %2, %5;\n\tfma.rn.f32 %3, %4, %3, %5;\n"
          : "+f"(a[0]), "+f"(a[1]), "+f"(a[2]), "+f"(a[3])
          : "f"(x), "f"(y));
  }
}

template <int kInstrs, bool kTwoCodes>
__global__ void __launch_bounds__(kThreads, 1) probe(float x, float y, long long* cycles, float* sink) {
  const int warp = threadIdx.x / 32;
  float a[4] = {float(threadIdx.x), 1.f, 2.f, 3.f};
  const bool second = kTwoCodes && warp >= 4;
  __syncthreads();
  const long long t0 = clock_now();
#pragma unroll 1
  for (int r = 0; r < kReps; ++r) {
    if (second) body<kInstrs / 4, 1>(a, x, y);
    else body<kInstrs / 4, 0>(a, x, y);
  }
  const long long t1 = clock_now();
  if (threadIdx.x % 32 == 0) cycles[blockIdx.x * (kThreads / 32) + warp] = t1 - t0;
  if (a[0] + a[1] + a[2] + a[3] == 12345.f) sink[threadIdx.x] = a[0];  // keeps the chains live
}

template <int kInstrs, bool kTwoCodes>
void run(int sms, long long* d_cycles, float* d_sink) {
  const int warps = sms * (kThreads / 32);
  probe<kInstrs, kTwoCodes><<<sms, kThreads>>>(1.0001f, 0.5f, d_cycles, d_sink);  // warms L2
  probe<kInstrs, kTwoCodes><<<sms, kThreads>>>(1.0001f, 0.5f, d_cycles, d_sink);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(warps);
  CHECK(cudaMemcpy(c.data(), d_cycles, warps * sizeof(long long), cudaMemcpyDeviceToHost));
  std::nth_element(c.begin(), c.begin() + warps / 2, c.end());
  const double per_instr = double(c[warps / 2]) / (double(kReps) * kInstrs);
  const int kb = kInstrs * 16 / 1024;
  std::printf("%-10s %6d KB per warp %6d KB in all %8.2f cycles per instruction\n",
              kTwoCodes ? "two codes" : "same code", kb, kTwoCodes ? 2 * kb : kb, per_instr);
}

template <bool kTwoCodes>
void sweep(int sms, long long* d_cycles, float* d_sink) {
  run<512, kTwoCodes>(sms, d_cycles, d_sink);    // 8 KB
  run<1024, kTwoCodes>(sms, d_cycles, d_sink);   // 16 KB
  run<2048, kTwoCodes>(sms, d_cycles, d_sink);   // 32 KB
  run<3072, kTwoCodes>(sms, d_cycles, d_sink);   // 48 KB
  run<4096, kTwoCodes>(sms, d_cycles, d_sink);   // 64 KB
  run<6144, kTwoCodes>(sms, d_cycles, d_sink);   // 96 KB
  run<8192, kTwoCodes>(sms, d_cycles, d_sink);   // 128 KB
  run<10240, kTwoCodes>(sms, d_cycles, d_sink);  // 160 KB
  run<12288, kTwoCodes>(sms, d_cycles, d_sink);  // 192 KB
  run<16384, kTwoCodes>(sms, d_cycles, d_sink);  // 256 KB
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs, one CTA of %d threads per SM, %d passes a launch\n", prop.name, sms, kThreads, kReps);
  long long* d_cycles = nullptr;
  float* d_sink = nullptr;
  CHECK(cudaMalloc(&d_cycles, size_t(sms) * (kThreads / 32) * sizeof(long long)));
  CHECK(cudaMalloc(&d_sink, kThreads * sizeof(float)));
  sweep<false>(sms, d_cycles, d_sink);
  sweep<true>(sms, d_cycles, d_sink);
  CHECK(cudaFree(d_cycles));
  CHECK(cudaFree(d_sink));
  return 0;
}
