// Portable MLA attention kernel (sm80+): tensor cores through mma.sync, cp.async loads, no
// Hopper-only instructions. One kernel template serves dense decode (BF16/FP16/FP8 caches), sparse
// decode (FP8 V3.2 / MODEL1) and sparse prefill; a Problem policy (problems.cuh) says where the
// query rows and the keys come from and where results go.
//
// Schedule (256 threads = 8 warps, one CTA per (16-row query tile, key group, plan part)):
//   * a persistent loop over the part's work items (plan pieces; one item for prefill);
//   * per item, Q (16 rows x D) goes through shared memory into registers: warp w keeps the
//     A fragments of head-dim quarter w % 4;
//   * keys stream in stages of 32 (half a plan block), 3 stages deep, 8 threads per key:
//     cp.async for BF16/FP16 rows; FP8 rows are loaded into registers two stages ahead and
//     dequantised into shared memory after the current stage's P V, so their latency hides behind
//     the matrix work (invalid rows are zeroed);
//   * S = Q K^T: warp w multiplies keys [16 (w / 4), +16) over head-dim quarter w % 4 (two
//     interleaved accumulator chains); the four partial S tiles are summed through shared memory;
//     256 threads run the online softmax (log2 domain, 16 threads per row), write P (bf16/fp16)
//     and the per-row rescale factor;
//   * O += P V: warp w owns output columns [64 w, 64 w + 64) in registers (16 x 64 fp32);
//   * epilogue: whole pieces write out/lse (attention sink applied), split pieces write fp32
//     partials for the combine kernel.
// Tile sizes: 16 query rows, 32 keys per stage, 3 stages, rows padded by 8 elements (16 bytes) so
// ldmatrix rows fall in distinct banks. Shared memory: 142 KB at D = 576 (one CTA per SM).
// Reached on an H200 (bench/RESULTS.md, commit 50814c1): dense h_q=16 s_k=8192 2651 GB/s (62% of
// the copy ceiling); dense h_q=128 s_k=4096 85 TFLOPS; sparse V3.2 h_q=128 topk 2048 56 TFLOPS.
// Bounded by the latency of one CTA's three barriers per stage; h_q = 128 reads every key into
// shared memory once per 16-row tile.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/ptx.cuh"
#include "../common/smem_limit.h"
#include "mla/params.h"
#include "mla/plan.h"

namespace mla::cuda::portable {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 16;        // query rows per CTA: one mma M
constexpr int kStageKeys = 32;   // keys per pipeline stage
constexpr int kStages = 3;       // stages in flight
constexpr int kPad = 8;          // elements of padding per shared-memory row (16 bytes)
constexpr int kDv = kHeadDimV;   // 512
constexpr int kKeyLanes = kThreads / kStageKeys;  // 8 threads load each key of a stage
// S = Q K^T: warp w multiplies keys [16 * (w / 4), +16) over head-dim quarter w % 4.
constexpr int kDimQuarters = 4;
constexpr int kKeyHalves = kWarps / kDimQuarters;
constexpr int kColsPerWarp = kDv / kWarps;  // 64 output columns per warp
constexpr int kNTilesO = kColsPerWarp / 8;  // 8 mma n-tiles of O per warp
constexpr int kSoftmaxLanes = kThreads / kRows;              // 16 threads per softmax row
constexpr int kSoftmaxKeys = kStageKeys / kSoftmaxLanes;     // 2 keys per thread
constexpr int kSPad = 4;                    // fp32 padding of the partial-S rows
static_assert(kPlanBlockSize % kStageKeys == 0, "a plan block is a whole number of stages");
static_assert(kKeyHalves * 16 == kStageKeys, "the key halves of the S warps cover a stage");
static_assert(kSoftmaxKeys == 2, "the softmax writes P as one pair of keys per thread");
static_assert(kDv % (kWarps * 16) == 0, "each warp owns whole 16-column pairs of O");

template <int D, typename T>
struct SharedStorage {
  static_assert(D % (kDimQuarters * 16) == 0, "each S warp owns whole k16 steps of the head dim");
  T k[kStages][kStageKeys][D + kPad];  // keys of 3 stages; V is the first 512 dims
  T q[kRows][D + kPad];
  float s_part[kDimQuarters][kRows][kStageKeys + kSPad];
  T p[kRows][kStageKeys + kPad];
  float row_m[kRows];      // running max, log2 domain
  float row_l[kRows];      // running sum
  float row_alpha[kRows];  // rescale factor of the current stage
  int key_pos[kStages][kStageKeys];  // position of each key (token index or slot) for row masks
  uint8_t key_valid[kStages][kStageKeys];
};

// A unit of work of one CTA: request `req`, stages [stage_begin, stage_end) of its key space.
struct WorkItem {
  int req;
  int stage_begin, stage_end;
  bool is_split;
  int split_index;
};

template <class Problem>
__global__ void __launch_bounds__(kThreads, 1) attention_kernel(const __grid_constant__ typename Problem::Params params) {
  using T = typename Problem::MmaT;
  constexpr int D = Problem::kHeadDim;
  constexpr int kDimsPerWarp = D / kDimQuarters;
  constexpr int kKSteps = kDimsPerWarp / 16;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<SharedStorage<D, T>*>(smem_raw);

  const Problem pb(params);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int dq = warp % kDimQuarters, kh = warp / kDimQuarters;  // this warp's share of S
  int m_tile, group, part;
  pb.coords(m_tile, group, part);
  const int row0 = m_tile * kRows;
  const int num_rows = pb.rows();

  const int num_items = pb.num_items(part);
  for (int item_idx = 0; item_idx < num_items; ++item_idx) {
    const WorkItem item = pb.item(part, item_idx);
    __syncthreads();  // the previous item is done with every buffer

    // ---- Q: global -> shared -> registers ------------------------------------------------
    for (int c = tid; c < kRows * D / 8; c += kThreads) {
      const int r = c / (D / 8), col = (c % (D / 8)) * 8;
      pb.load_q8(item.req, group, row0 + r, col, row0 + r < num_rows, &sm.q[r][col]);
    }
    if (tid < kRows) {
      sm.row_m[tid] = -INFINITY;
      sm.row_l[tid] = 0.f;
    }
    __syncthreads();
    uint32_t qf[kKSteps][4];
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      ptx::ldmatrix_x4(qf[ks], &sm.q[lane % 16][dq * kDimsPerWarp + ks * 16 + (lane / 16) * 8]);

    float acc[kNTilesO][4];
#pragma unroll
    for (int n = 0; n < kNTilesO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    const float score_scale = pb.score_scale(item.req);
    // The last key position each of this thread's softmax row may see (causal masks).
    const int softmax_row = tid / kSoftmaxLanes;
    const int row_limit = pb.row_key_limit(item.req, group, row0 + softmax_row);
    const bool softmax_row_live = row0 + softmax_row < num_rows;

    // ---- key stages ----------------------------------------------------------------------
    const int n_stages = item.stage_end - item.stage_begin;
#pragma unroll
    for (int k = 0; k < kStages - 1; ++k) {
      if (k < n_stages) {
        typename Problem::Prefetch f;
        pb.fetch(item, item.stage_begin + k, f, sm.k[k], sm.key_valid[k], sm.key_pos[k]);
        pb.commit(f, sm.k[k]);
      }
      ptx::cp_async_commit();
    }
    for (int st = 0; st < n_stages; ++st) {
      const int buf = st % kStages;
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();  // stage st has landed; every warp is done with stage st - 1
      // Loads of stage st + 2 go out now and land while this stage computes: cp.async straight into
      // shared memory, or global -> registers, converted into shared memory after P V below.
      const int next = st + kStages - 1;
      const bool has_next = next < n_stages;
      typename Problem::Prefetch prefetch;
      if (has_next)
        pb.fetch(item, item.stage_begin + next, prefetch, sm.k[next % kStages], sm.key_valid[next % kStages],
                 sm.key_pos[next % kStages]);
      ptx::cp_async_commit();

      // S partial = Q[:, my dims] K[my keys, my dims]^T, 16 x 16, as two interleaved accumulator
      // chains (even and odd k-steps) so consecutive mma do not wait on each other.
      float s[2][2][4];
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int n = 0; n < 2; ++n) s[c][n][0] = s[c][n][1] = s[c][n][2] = s[c][n][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const int col = dq * kDimsPerWarp + ks * 16 + ((lane / 8) % 2) * 8;
        uint32_t b[4];
        ptx::ldmatrix_x4(b, &sm.k[buf][kh * 16 + (lane % 8) + (lane / 16) * 8][col]);
        ptx::mma_16816<T>(s[ks % 2][0], qf[ks], b[0], b[1]);
        ptx::mma_16816<T>(s[ks % 2][1], qf[ks], b[2], b[3]);
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int c = kh * 16 + n * 8 + 2 * t4;
        *reinterpret_cast<float2*>(&sm.s_part[dq][g][c]) = make_float2(s[0][n][0] + s[1][n][0], s[0][n][1] + s[1][n][1]);
        *reinterpret_cast<float2*>(&sm.s_part[dq][g + 8][c]) =
            make_float2(s[0][n][2] + s[1][n][2], s[0][n][3] + s[1][n][3]);
      }
      __syncthreads();

      // Online softmax: thread -> row tid / 16, keys (tid % 16) * 2 and + 1.
      {
        const int r = softmax_row, c0 = (tid % kSoftmaxLanes) * kSoftmaxKeys;
        float z[kSoftmaxKeys];
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < kSoftmaxKeys; ++j) {
          const int c = c0 + j;
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < kDimQuarters; ++w) v += sm.s_part[w][r][c];
          const bool valid = softmax_row_live && sm.key_valid[buf][c] && sm.key_pos[buf][c] <= row_limit;
          z[j] = valid ? v * score_scale : -INFINITY;
          mx = fmaxf(mx, z[j]);
        }
#pragma unroll
        for (int o = 1; o < kSoftmaxLanes; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_old = sm.row_m[r];
        const float m_new = fmaxf(m_old, mx);
        const bool any = m_new != -INFINITY;
        const float alpha = any ? exp2f(m_old - m_new) : 1.f;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kSoftmaxKeys; ++j) {
          const float pj = any && z[j] != -INFINITY ? exp2f(z[j] - m_new) : 0.f;
          sum += pj;
          z[j] = pj;
        }
#pragma unroll
        for (int o = 1; o < kSoftmaxLanes; o *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        *reinterpret_cast<uint32_t*>(&sm.p[r][c0]) = ptx::pack2<T>(z[0], z[1]);
        if (tid % kSoftmaxLanes == 0) {
          sm.row_m[r] = m_new;
          sm.row_l[r] = sm.row_l[r] * alpha + sum;
          sm.row_alpha[r] = alpha;
        }
      }
      __syncthreads();

      // O = O * alpha + P V over my 128 columns.
      const float a_lo = sm.row_alpha[g], a_hi = sm.row_alpha[g + 8];
#pragma unroll
      for (int n = 0; n < kNTilesO; ++n) {
        acc[n][0] *= a_lo, acc[n][1] *= a_lo;
        acc[n][2] *= a_hi, acc[n][3] *= a_hi;
      }
#pragma unroll
      for (int ks = 0; ks < kStageKeys / 16; ++ks) {
        uint32_t pa[4];
        ptx::ldmatrix_x4(pa, &sm.p[lane % 16][ks * 16 + (lane / 16) * 8]);
#pragma unroll
        for (int j = 0; j < kNTilesO / 2; ++j) {
          uint32_t b[4];
          ptx::ldmatrix_x4_trans(
              b, &sm.k[buf][ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8][warp * kColsPerWarp + j * 16 + (lane / 16) * 8]);
          ptx::mma_16816<T>(acc[2 * j], pa, b[0], b[1]);
          ptx::mma_16816<T>(acc[2 * j + 1], pa, b[2], b[3]);
        }
      }
      // Buffer (st + 2) % 3 held stage st - 1, which every warp finished before this iteration's
      // first barrier, so the prefetched registers can land there now.
      if (has_next) pb.commit(prefetch, sm.k[next % kStages]);
    }
    ptx::cp_async_wait<0>();
    __syncthreads();

    // ---- epilogue ------------------------------------------------------------------------
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = g + half * 8;
      if (row0 + r >= num_rows) continue;
      const float m = sm.row_m[r], l = sm.row_l[r];
      float vals[kNTilesO * 2];
#pragma unroll
      for (int n = 0; n < kNTilesO; ++n) vals[2 * n] = acc[n][half * 2], vals[2 * n + 1] = acc[n][half * 2 + 1];
      pb.store_row(item, group, row0 + r, warp * kColsPerWarp, t4, vals, m, l, warp == 0 && t4 == 0);
    }
  }
}

// Shared memory a Problem's kernel needs.
template <class Problem>
constexpr size_t shared_bytes() {
  return sizeof(SharedStorage<Problem::kHeadDim, typename Problem::MmaT>);
}

template <class Problem>
cudaError_t launch(const typename Problem::Params& params, dim3 grid, cudaStream_t stream) {
  const size_t smem = shared_bytes<Problem>();
  // sm86 / sm89 (Ampere consumer cards, Ada) allow 99 KB per block: not enough for three stages.
  const cudaError_t err = raise_smem_limit_once<attention_kernel<Problem>>(
      int(smem), "the portable kernel", " (sm_80 and sm_90 have enough; sm_86 and sm_89 are not supported yet)");
  if (err != cudaSuccess) return err;
  attention_kernel<Problem><<<grid, kThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mla::cuda::portable
