// What a proxy fence costs a thread that has global loads in flight: the Hopper kernels that store
// keys into shared memory for wgmma (the sparse producers) order those stores before the tensor
// cores' reads with fence.proxy.async.shared::cta, which the compiler emits as MEMBAR.ALL.CTA plus
// FENCE.VIEW.ASYNC.S. If the MEMBAR waits for the thread's outstanding loads, every fence costs a
// full memory latency whenever records are in flight behind it. On an H200 it does not: about 230
// cycles, against the whole load latency for fence.cta (bench/RESULTS.md, seventeenth session).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -cudart static \
//        -o build/fence_cost bench/fence_cost.cu
//   build/fence_cost
//
// Each thread issues eight 16-byte loads from lines no cache holds, stores 16 bytes to shared
// memory, then times (clock64) one of: nothing, fence.proxy.async.shared::cta, fence.cta.acq_rel,
// and the loads' first use. Printed: the median over threads of each.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"

namespace {

constexpr int kLoads = 8;
constexpr int kThreads = 256;
constexpr int kBlocks = 132;
constexpr int kModes = 4;
const char* const kNames[kModes] = {"nothing", "fence.proxy.async.shared::cta", "fence.cta.acq_rel",
                                    "first use of the loads"};

__global__ void fence_cost(const uint4* src, size_t stride, int mode, long long* cycles, uint4* sink) {
  __shared__ uint4 buf[kThreads];
  const int tid = threadIdx.x, g = blockIdx.x * kThreads + tid;
  uint4 v[kLoads];
#pragma unroll
  for (int j = 0; j < kLoads; ++j) {
    const uint4* a = src + (size_t(g) + size_t(j) * kBlocks * kThreads) * stride;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                 : "l"(a)
                 : "memory");
  }
  buf[tid] = make_uint4(tid, tid, tid, tid);
  const long long t0 = clock_now();
  if (mode == 1) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  if (mode == 2) asm volatile("fence.cta.acq_rel;\n" ::: "memory");
  uint32_t x = 0;
  if (mode == 3) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) x ^= v[j].x ^ v[j].w;
    asm volatile("" : "+r"(x)::"memory");
  }
  const long long t1 = clock_now();
#pragma unroll
  for (int j = 0; j < kLoads; ++j) x ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  __syncthreads();
  sink[g] = make_uint4(x, buf[(tid + 1) % kThreads].x, 0, 0);
  cycles[g] = t1 - t0;
}

}  // namespace

int main() {
  // 256-byte stride: every load its own line, 8 x 132 x 256 x 256 B = 69 MB, beyond the 50 MB L2.
  constexpr size_t kStride = 16;
  const size_t n = size_t(kLoads) * kBlocks * kThreads * kStride;
  uint4 *src = nullptr, *sink = nullptr;
  long long* cycles = nullptr;
  CHECK(cudaMalloc(&src, n * sizeof(uint4)));
  CHECK(cudaMemset(src, 1, n * sizeof(uint4)));
  CHECK(cudaMalloc(&sink, size_t(kBlocks) * kThreads * sizeof(uint4)));
  CHECK(cudaMalloc(&cycles, size_t(kBlocks) * kThreads * sizeof(long long)));
  std::vector<long long> host(size_t(kBlocks) * kThreads);
  for (int rep = 0; rep < 2; ++rep)
    for (int mode = 0; mode < kModes; ++mode) {
      // Evict src from L2 between runs by touching another 128 MB.
      void* flush = nullptr;
      CHECK(cudaMalloc(&flush, size_t(128) << 20));
      CHECK(cudaMemset(flush, 0, size_t(128) << 20));
      CHECK(cudaFree(flush));
      fence_cost<<<kBlocks, kThreads>>>(src, kStride, mode, cycles, sink);
      CHECK(cudaGetLastError());
      CHECK(cudaMemcpy(host.data(), cycles, host.size() * sizeof(long long), cudaMemcpyDeviceToHost));
      std::nth_element(host.begin(), host.begin() + host.size() / 2, host.end());
      if (rep == 1) std::printf("%-34s median %6lld cycles\n", kNames[mode], host[host.size() / 2]);
    }
  CHECK(cudaFree(src));
  CHECK(cudaFree(sink));
  CHECK(cudaFree(cycles));
  return 0;
}
