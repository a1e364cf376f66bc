// The gather ceiling of a sparse decode: how fast the GPU reads the FP8 records a call attends
// (V3.2, 656 bytes per token, in 64-token pages) when it does nothing else with them, against
// reading the same number of bytes in order. The sparse kernels' memory-bound cases are judged
// against it (bench/RESULTS.md); the copy ceiling of ANCHORS.md is the in-order figure.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o build/gather_ceiling bench/gather_ceiling.cu
//   build/gather_ceiling [b] [s_k] [topk]        (defaults 128 4096 2048: sparse_v32_b128_h16_topk2048)
//
// The indices are drawn as the benchmark draws them: per request, topk distinct positions of its
// s_k tokens, whose pages are a random permutation of the cache's. Each kernel is timed over 20
// launches back to back, alternating two caches so that none finds the other's records in L2.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_check.h"

namespace {

constexpr int kRecordBytes = 656;
constexpr int kChunks = kRecordBytes / 16;
constexpr int kPage = 64;


// kParts threads per token, each reading every kParts-th 16-byte chunk of kTokens tokens (all
// loads issued before any is used); the XOR of everything keeps the loads alive.
template <int kParts, int kTokens>
__global__ void gather(const uint8_t* __restrict__ cache, const int* __restrict__ idx, int n, uint32_t* sink) {
  constexpr int kPerThread = (kChunks + kParts - 1) / kParts;
  const int part = threadIdx.x % kParts;
  const int stride = gridDim.x * blockDim.x / kParts;
  uint32_t acc = 0;
  for (int i0 = (blockIdx.x * blockDim.x + threadIdx.x) / kParts; i0 < n; i0 += stride * kTokens) {
    uint4 v[kTokens][kPerThread];
#pragma unroll
    for (int u = 0; u < kTokens; ++u) {
      const int i = i0 + u * stride;
      const uint8_t* rec = cache + int64_t(i < n ? idx[i] : 0) * kRecordBytes;
#pragma unroll
      for (int c = 0; c < kPerThread; ++c) {
        const int chunk = c * kParts + part;
        v[u][c] = i < n && chunk < kChunks ? __ldg(reinterpret_cast<const uint4*>(rec + chunk * 16)) : uint4{};
      }
    }
#pragma unroll
    for (int u = 0; u < kTokens; ++u)
#pragma unroll
      for (int c = 0; c < kPerThread; ++c) acc ^= v[u][c].x ^ v[u][c].y ^ v[u][c].z ^ v[u][c].w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // never true for the fill below; the compiler cannot tell
}

// The same bytes in order, eight 16-byte loads per thread in flight.
__global__ void read_in_order(const uint4* __restrict__ data, int64_t n16, uint32_t* sink) {
  constexpr int kLoads = 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16; i += stride * kLoads) {
    uint4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) v[u] = i + u * stride < n16 ? __ldg(data + i + u * stride) : uint4{};
#pragma unroll
    for (int u = 0; u < kLoads; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const int b = argc > 1 ? std::atoi(argv[1]) : 128;
  const int s_k = argc > 2 ? std::atoi(argv[2]) : 4096;
  const int topk = argc > 3 ? std::atoi(argv[3]) : 2048;
  if (b < 1 || s_k < kPage || s_k % kPage != 0 || topk < 1 || topk > s_k) {
    std::fprintf(stderr, "usage: %s [b >= 1] [s_k, a multiple of %d] [topk in 1..s_k]\n", argv[0], kPage);
    return 2;
  }
  const int pages_per_req = s_k / kPage, pages = b * pages_per_req;
  const size_t cache_bytes = size_t(pages) * kPage * kRecordBytes;

  std::mt19937 rng(1);
  std::vector<int> page_of(pages);
  for (int i = 0; i < pages; ++i) page_of[i] = i;
  std::shuffle(page_of.begin(), page_of.end(), rng);
  std::vector<int> idx, in_order, pos(s_k);
  for (int r = 0; r < b; ++r) {
    for (int i = 0; i < s_k; ++i) pos[i] = i;
    std::shuffle(pos.begin(), pos.end(), rng);
    for (int k = 0; k < topk; ++k) idx.push_back(page_of[r * pages_per_req + pos[k] / kPage] * kPage + pos[k] % kPage);
  }
  const int n = int(idx.size());
  for (int i = 0; i < n; ++i) in_order.push_back(i);

  uint8_t* cache[2];
  int *d_idx, *d_in_order;
  uint32_t* sink;
  for (int c = 0; c < 2; ++c) {
    CHECK(cudaMalloc(&cache[c], cache_bytes));
    CHECK(cudaMemset(cache[c], 1 + c, cache_bytes));
  }
  CHECK(cudaMalloc(&d_idx, n * sizeof(int)));
  CHECK(cudaMalloc(&d_in_order, n * sizeof(int)));
  CHECK(cudaMalloc(&sink, sizeof(uint32_t)));
  CHECK(cudaMemcpy(d_idx, idx.data(), n * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_in_order, in_order.data(), n * sizeof(int), cudaMemcpyHostToDevice));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));

  const double bytes = double(n) * kRecordBytes;
  std::printf("b=%d s_k=%d topk=%d: %d records, %.1f MB read, caches of %.1f MB\n", b, s_k, topk, n, bytes / 1e6,
              cache_bytes / 1e6);
  auto time = [&](const char* name, int ctas, auto launch) {
    constexpr int kReps = 20;
    for (int r = 0; r < 4; ++r) launch(cache[r & 1]);
    CHECK(cudaEventRecord(t0));
    for (int r = 0; r < kReps; ++r) launch(cache[r & 1]);
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    CHECK(cudaGetLastError());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    const double us = 1e3 * ms / kReps;
    std::printf("%-34s %5d CTAs %8.1f us %7.0f GB/s\n", name, ctas, us, bytes / us / 1e3);
  };
  for (int ctas : {264, 528, 1056}) {
    time("gather, 4 threads/token", ctas, [&](const uint8_t* c) { gather<4, 1><<<ctas, 256>>>(c, d_idx, n, sink); });
    time("gather, 8 threads/token", ctas, [&](const uint8_t* c) { gather<8, 1><<<ctas, 256>>>(c, d_idx, n, sink); });
    time("gather, 4 threads x 4 tokens", ctas, [&](const uint8_t* c) { gather<4, 4><<<ctas, 256>>>(c, d_idx, n, sink); });
    time("gather, 8 threads x 2 tokens", ctas, [&](const uint8_t* c) { gather<8, 2><<<ctas, 256>>>(c, d_idx, n, sink); });
    time("records in order, 4 x 4", ctas,
         [&](const uint8_t* c) { gather<4, 4><<<ctas, 256>>>(c, d_in_order, n, sink); });
    time("bytes in order", ctas, [&](const uint8_t* c) {
      read_in_order<<<ctas, 256>>>(reinterpret_cast<const uint4*>(c), int64_t(n) * kChunks, sink);
    });
  }
  return 0;
}
