// What the Hopper kernels share: a dense plan piece's bounds as warp-uniform values, the
// page of a key block (invalid entries as an out-of-bounds block, which TMA loads as zeros), Q
// staged into swizzled shared-memory tiles, and the launch as a programmatic dependent.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "../common/decode_io.cuh"
#include "../common/plan_block.cuh"
#include "../implementations.h"
#include "mla/params.h"
#include "mla/plan.h"
#include "ptx_sm90.cuh"

namespace mla::cuda::sm90 {

// A dense Hopper kernel's arguments: the cache as a tensor map ([num_blocks, page 64, h_k, D]
// elements, 64 x 64 boxes), the queries as one where their rows allow it, and the call.
struct DenseArgs {
  CUtensorMap kmap;
  CUtensorMap qmap;       // the queries, where q_by_tma (kv_tensor_map.h)
  bool q_by_tma = false;  // else the kernel copies Q's rows itself (stage_q)
  // Each CTA releases its dependent (the combine) at the start of its last piece rather than at its
  // exit (launch() in dense_decode.cu says when).
  bool release_early = false;
  DenseDecodeParams p;
};

#if defined(MLA_SM90A_DEVICE)
// What a decode kernel of kThreads threads does once its barriers are initialised and the CTA is
// synchronised: it waits for the work before it on the stream (it is launched as a programmatic
// dependent, so everything above overlapped that work's tail; the plan and the inputs are read only
// after this) and, when the call brought no plan, makes it: every CTA its own part's row and
// num_splits (all of it, or in the closed form the entries it reads: writes_split; the same values
// wherever two CTAs write one), with two of its key buffers (empty until the first
// loads) as the planner's scratch, before anything reads the plan. No planner kernel runs first.
// The planner waits itself, as late as it can (plan_block.cuh): a closed-form plan is made before
// the wait, under the previous kernel's tail, and only stored after it.
template <int kThreads, typename Buffer>
__device__ __forceinline__ void wait_then_plan(const DecodeSplit& split, const DecodePlanParams& plan, int part,
                                               Buffer& scratch, Buffer& costs) {
  if (split.plan_fresh) {
    static_assert(sizeof(typename BlockPlanner<kThreads>::Scratch) <= sizeof(Buffer), "scratch fits a buffer");
    BlockPlanner<kThreads>::run_in(plan, part, scratch, costs);
    __syncthreads();
  } else {
    wait_for_prior_grids();
  }
}

// Tiles [t0, t1) (64 columns each) of the 64-key block in page `page` of KV head `group`, by TMA
// into tiles[t], each completing on full[t]. One thread issues, so the loop stays rolled: unrolled,
// each TMA (with the loop that makes its operands uniform) is 200 bytes of code at every call site.
__device__ __forceinline__ void issue_key_tiles(uint8_t (*tiles)[64 * 128], uint64_t* full, const CUtensorMap* map,
                                                int page, int group, int t0, int t1, uint64_t policy) {
#pragma unroll 1
  for (int t = t0; t < t1; ++t) {
    mbar_expect_tx(&full[t], 64 * 128);
    tma_load_4d(tiles[t], map, &full[t], t * 64, group, 0, page, policy);
  }
}
#endif  // MLA_SM90A_DEVICE

// A plan piece of a dense call, clamped to the request's blocks. Every field is the same in all
// threads and goes through a shuffle, so the compiler knows it warp-uniform (a wgmma under a branch
// it cannot prove uniform gets serialised).
struct DensePiece {
  int req, len, block_begin, n_blocks;
  bool is_split;
  int split_index;
};

__device__ __forceinline__ DensePiece dense_piece(const DenseDecodeParams& p, const DecodePlanParams& plan, int part,
                                                  int k, int block_keys) {
  const PlanPiece pc = decode_io::piece(p.split, plan, part, k);
  DensePiece d;
  d.req = __shfl_sync(0xffffffffu, pc.req, 0);
  d.len = __shfl_sync(0xffffffffu, dense_len(plan, d.req), 0);
  const int block_end = min(pc.block_end, ceil_div(d.len, block_keys));
  d.block_begin = __shfl_sync(0xffffffffu, min(pc.block_begin, block_end), 0);
  d.n_blocks = __shfl_sync(0xffffffffu, block_end - min(pc.block_begin, block_end), 0);
  d.is_split = pc.is_split;
  d.split_index = pc.split_index;
  return d;
}

// Page of key block kb given the request's block-table row, or num_blocks (out of bounds) when the
// entry is invalid.
__device__ __forceinline__ int dense_page(const DenseDecodeParams& p, const int32_t* table_row, int kb) {
  if (kb >= p.max_blocks_per_seq) return p.num_blocks;
  const int pg = table_row[kb];
  return pg < 0 || pg >= p.num_blocks ? p.num_blocks : pg;
}

using decode_io::rows_16b_aligned;  // stage_rows' 16-byte copies need it of Q

// kRows rows of D elements into kRows x 64 tiles (tile t at q_tiles + t * kRows * 128, 128-byte
// swizzle) by the kThreads threads [0, kThreads): row_src(r) is row r's first element, or nullptr
// for a row past the call's rows (zero); row 0 is always live. Each row belongs to kThreads / kRows
// threads, which take its 16-byte chunks in turn, so that row_src (a division by the heads per group
// in the dense kernels) runs once per thread rather than once per chunk.
// vec: every row 16-byte aligned. issued() runs in every thread once its copies are in flight,
// before it waits for them (loads the caller wants queued right behind Q's); without vec the
// copies are plain loads and stores, and issued() runs before them. Ends with the proxy fence; the
// caller synchronises the threads that wrote. kWait = false leaves the copies in flight: the
// caller runs staged_rows_landed() in the same threads before it synchronises them.
struct NothingMore {
  __device__ void operator()() const {}
};
template <typename T, int D, int kRows, int kThreads, bool kWait = true, typename RowSrc, typename Issued = NothingMore>
__device__ __forceinline__ void stage_rows(const RowSrc& row_src, bool vec, uint8_t* q_tiles, int tid,
                                           const Issued& issued = {}) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kPerRow = kThreads / kRows;
  static_assert(kThreads % kRows == 0 && kChunks % kPerRow == 0, "whole rows per thread group");
  const int r = tid / kPerRow;
  const T* src = row_src(r);
  uint8_t* row = q_tiles + r * 128;
  const int sw = r % 8;
  if (vec) {
    // Every chunk's copy in flight at once (a load-then-store loop would expose the latency of
    // each). A dead row reads nothing (source size 0) but still names a valid address: row 0's,
    // which every staged tile has.
    const T* from = src ? src : row_src(0);
    const uint32_t bytes = src ? 16u : 0u;
#pragma unroll 6
    for (int ch = tid % kPerRow; ch < kChunks; ch += kPerRow)
      cp_async_16(row + (ch / 8) * kRows * 128 + (((ch % 8) ^ sw) << 4), from + ch * 8, bytes);
    issued();
    if constexpr (!kWait) return;
    cp_async_wait_all();
  } else {
    issued();
    for (int ch = tid % kPerRow; ch < kChunks; ch += kPerRow) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (src) {
        const uint16_t* e16 = reinterpret_cast<const uint16_t*>(src + ch * 8);
        uint16_t e[8];
        for (int j = 0; j < 8; ++j) e[j] = e16[j];
        v = make_uint4(e[0] | uint32_t(e[1]) << 16, e[2] | uint32_t(e[3]) << 16, e[4] | uint32_t(e[5]) << 16,
                       e[6] | uint32_t(e[7]) << 16);
      }
      *reinterpret_cast<uint4*>(row + (ch / 8) * kRows * 128 + (((ch % 8) ^ sw) << 4)) = v;
    }
  }
  if constexpr (kWait) fence_proxy_async();
}
// The end of stage_rows<..., kWait = false>: its copies landed and visible to wgmma.
__device__ __forceinline__ void staged_rows_landed() {
  cp_async_wait_all();
  fence_proxy_async();
}

// Query rows [row_base, row_base + kRows) of KV head `group` of request req (row r: token
// r / (h_q / h_k), head group * h_q / h_k + r % (h_q / h_k)), staged as stage_rows does.
template <typename T, int D, int kRows, int kThreads, bool kWait = true, typename Issued = NothingMore>
__device__ __forceinline__ void stage_q(const DenseDecodeParams& p, int req, int group, int row_base, uint8_t* q_tiles,
                                        int tid, const Issued& issued = {}) {
  const int hpg = p.h_q / p.h_k, num_rows = p.s_q * hpg;
  const T* q = static_cast<const T*>(p.q);
  const bool vec = rows_16b_aligned(q, p.q_stride_b, p.q_stride_s, p.q_stride_h);
  stage_rows<T, D, kRows, kThreads, kWait>(
      [&](int r) -> const T* {
        const int row = row_base + r;
        if (row >= num_rows) return nullptr;
        return q + req * p.q_stride_b + (row / hpg) * p.q_stride_s + (group * hpg + row % hpg) * p.q_stride_h;
      },
      vec, q_tiles, tid, issued);
}

// Launches kernel<<<grid, threads, smem, stream>>>(args) as a programmatic dependent of the work
// before it on the stream (the kernel waits with griddepcontrol.wait before reading its inputs;
// unless programmatic_launch() is off), in clusters of `cluster` CTAs where that is more than one.
template <typename Args>
cudaError_t launch_dependent(void (*kernel)(Args), dim3 grid, int threads, int smem, cudaStream_t stream,
                             const Args& args, dim3 cluster = dim3(1, 1, 1)) {
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (programmatic_launch()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(smem);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, args);
}

// How many clusters of `cluster` CTAs of Kernel (threads, dynamic shared memory smem) the current
// device holds at once, asked once per device (64 devices at most); 0 where it cannot say.
template <auto Kernel>
int clusters_resident(int threads, int smem, dim3 cluster) {
  static std::atomic<int> known[64];  // the count + 1, 0 until asked
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  std::atomic<int>& slot = known[dev & 63];
  if (const int v = slot.load(std::memory_order_acquire)) return v - 1;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster.x, attr.val.clusterDim.y = cluster.y, attr.val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config = {};
  config.gridDim = cluster;
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(smem);
  config.attrs = &attr;
  config.numAttrs = 1;
  int count = 0;
  if (cudaOccupancyMaxActiveClusters(&count, Kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: the call goes on without clusters
    count = 0;
  }
  slot.store(count + 1, std::memory_order_release);
  return count;
}

}  // namespace mla::cuda::sm90
