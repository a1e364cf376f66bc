// Hopper (sm_90a) dense MLA decode for few query rows per KV head (s_q x h_q / h_k <= 32: DeepSeek's
// 128 heads under tensor parallelism 4-8, or MTP with 16 heads), where padding the rows to wgmma's
// M = 64 would quadruple the tensor work of a memory-bound problem. BF16/FP16 caches with 64-token
// pages, d_qk 576 or 512, d_v 512, causal for s_q > 1. Selected with MLA_KERNELS_IMPL=sm90_small:
// the default runs the 64-row kernel for every row count, which planned with FlashMLA's fixed cost
// is level or ahead (dispatch.cu).
//
// Schedule (128 threads = one warpgroup, one CTA per (KV head, plan part), persistent over the
// part's pieces): the rows become wgmma's N instead of its M:
//   * S^T (64 keys x N rows) = K Q^T: m64nNk16 with K (the 64 x 64 TMA tile) as A and Q (N x D, in
//     shared memory once per piece) as B;
//   * the softmax runs down the columns of S^T: a row's max and sum are reduced over the 8 lanes
//     that share it and the 4 warps (through shared memory);
//   * P (N x 64) goes to shared memory; O^T (512 x N) += V^T P^T: m64nNk16 with V read
//     transposed (MN-major) from the key tile as A, eight 64-dim tiles, O^T in registers;
//   * keys arrive through TMA in 64-token blocks, 64 x 64 tiles on one mbarrier each, in two
//     buffers: while one block is multiplied the next is in flight, and a buffer's RoPE tile is
//     reloaded right after S, its V tiles right after O (the compute of a block is a fraction of
//     its transfer, so the loads stay in flight);
//   * the V tail of a request's last page is zeroed before use; invalid block-table entries load as
//     zeros (out-of-bounds TMA box) and are masked;
//   * epilogue: O^T / l to out / lse, or fp32 partials for the combine kernel (programmatic
//     dependent launch);
//   * with a fresh plan every CTA first plans its own part (plan_block.cuh; no planner kernel).
// Tile sizes: 64-key blocks, N = 16 or 32 rows, two key buffers (144 KB at D = 576) + Q (18 / 36 KB).
// Reached on an H200 (bench/RESULTS.md, tenth session, FlashMLA alternated in one run): b=128
// h_q=16 s_k=8192 305.4 us whole (92.9% of copy; FlashMLA 318.8, 1.04x), 301.3 with the plan
// reused. The 64-row kernel, run with the rows padded, later reached 291.5-293.0 us (96.8-97.3%)
// and became the default. Limit (ncu): the two-buffer key stream alone reads at 4.10 TB/s (294.9
// us). Measured slower: refilling each V tile as its products end (318.0 against 305.0), three key
// buffers (321.7), one ring of 25 key tiles (~470).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/decode_io.cuh"
#include "../common/plan_block.cuh"
#include "../common/smem_limit.h"
#include "../implementations.h"
#include "common.cuh"
#include "kv_tensor_map.h"
#include "ptx_sm90.cuh"
#include "small_n.cuh"

namespace mla::cuda {

namespace sm90_small {

using namespace sm90;

constexpr int kThreads = 128;
constexpr int kBlockN = 64;    // keys per block = page size = plan block = wgmma M of S^T
constexpr int kTileCols = 64;  // 64 x 64 tiles of 16-bit elements: 128-byte rows
constexpr int kTileBytes = kBlockN * 128;
[[maybe_unused]] constexpr int kVTiles = 8;  // d_v 512 = 8 tiles = 8 wgmma M tiles of O^T
static_assert(kBlockN == kPlanBlockSize, "one key block per plan block");

template <int D, int N>
struct Smem {
  static constexpr int kTiles = D / kTileCols;  // 9 or 8
  static constexpr int kRowTileBytes = N * 128;  // an N-row tile of Q or P (whole 1 KB swizzle atoms)
  static_assert(N % 8 == 0 && kRowTileBytes % 1024 == 0, "Q and P tiles are whole 8-row swizzle atoms");
  uint8_t k[2][kTiles][kTileBytes];
  uint8_t q[kTiles][kRowTileBytes];
  uint8_t p[kRowTileBytes];         // P [row][key], K-major
  float warp_max[4][N];             // per-warp column maxima of S^T
  float warp_sum[4][N];             // per-warp row sums (epilogue)
  uint64_t full[2][kTiles];
};


template <typename T, int D, int N>
__global__ void __launch_bounds__(kThreads, 1) dense_decode_small_kernel(const __grid_constant__ DenseArgs args) {
#if defined(MLA_SM90A_DEVICE)
  using SmemT = Smem<D, N>;
  constexpr int kTiles = SmemT::kTiles;
  constexpr int kNT = N / 8;  // n8 tiles of a thread's accumulators
  const DenseDecodeParams& p = args.p;
  extern __shared__ uint8_t smem_raw[];
  // Tiles 1024-byte aligned; offsetting smem_raw (not rebuilding the pointer from an integer) keeps
  // the accesses in the shared address space (STS/LDS rather than generic stores and loads).
  SmemT& sm = *reinterpret_cast<SmemT*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));

  const int tid = threadIdx.x, warp = __shfl_sync(0xffffffffu, tid / 32, 0), lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int group = blockIdx.y, part = blockIdx.z;
  const int hpg = p.h_q / p.h_k, num_rows = p.s_q * hpg;
  const DecodePlanParams plan = dense_plan_params(p);
  const float scale_log2 = p.softmax_scale * kLog2e;
  const uint64_t policy = evict_first_policy();
  // Tiles [t0, t1) of the 64-key block in `page` into key buffer `buf` (one thread issues).
  auto load_tiles = [&](int buf, int page, int t0, int t1) {
    issue_key_tiles(sm.k[buf], sm.full[buf], &args.kmap, page, group, t0, t1, policy);
  };
  // This thread's accumulator coordinates: keys (S^T) or dims within a 64-dim tile (O^T)
  // 16 warp + g and + 8; rows (columns) 8 n + 2 t4 and + 1 for n < kNT.
  const int key_lo = warp * 16 + g;

  if (tid == 0) {
    for (int b = 0; b < 2; ++b)
      for (int t = 0; t < kTiles; ++t) mbar_init(&sm.full[b][t], 1);
    fence_barrier_init();
  }
  __syncthreads();
  wait_then_plan<kThreads>(p.split, plan, part, sm.k[0], sm.k[1]);

  uint32_t rounds[2] = {0, 0};  // loads issued into each buffer so far (mbarrier phases)
  const int num_pieces = decode_io::num_pieces(p.split, p.b, part);
  for (int k = 0; k < num_pieces; ++k) {
    const DensePiece pc = dense_piece(p, plan, part, k, kBlockN);
    const int i = pc.req, len = pc.len, block_begin = pc.block_begin, n_blocks = pc.n_blocks;
    const int32_t* table = p.block_table + int64_t(i) * p.block_table_stride;
    auto page_of = [&](int kb) { return dense_page(p, table, kb); };
    __syncthreads();  // the previous piece is done with Q, P and both buffers

    // Both buffers are free: the first two blocks' loads go out before Q is staged.
    if (tid == 0) {
      if (n_blocks > 0) load_tiles(0, page_of(block_begin), 0, kTiles);
      if (n_blocks > 1) load_tiles(1, page_of(block_begin + 1), 0, kTiles);
    }

    // ---- Q -> shared memory (N rows, swizzled; rows past the live rows zero) ------------------
    stage_q<T, D, N, kThreads>(p, i, group, 0, sm.q[0], tid);
    __syncthreads();

    // Rows (columns of S^T / O^T) this thread holds, their causal limits and running state.
    // The last key position row r may see (bottom-right causal for s_q > 1): r / hpg + causal_shift.
    const bool causal = p.causal && p.s_q > 1;
    const int causal_shift = len - p.s_q;
    float m_run[kNT][2], l_part[kNT][2], o[kVTiles][N / 2];
    small_start<N>(m_run, l_part, o);

    int pg_cur = n_blocks > 0 ? page_of(block_begin) : p.num_blocks;
    int pg_next = n_blocks > 1 ? page_of(block_begin + 1) : p.num_blocks;
    for (int j = 0; j < n_blocks; ++j) {
      const int buf = j & 1, kb = block_begin + j;
      const uint32_t parity = ((buf ? rounds[1] : rounds[0]) + uint32_t(j / 2)) & 1u;
      const bool reload = j + 2 < n_blocks;
      const int pg_reload = reload ? page_of(kb + 2) : p.num_blocks;  // read early, used after S
      const int valid = min(kBlockN, len - kb * kBlockN);

      // ---- S^T = K Q^T (all tiles first: a wait inside a wgmma chain serialises it) -------------
      float sc[N / 2];
      for (int t = 0; t < kTiles; ++t) mbar_wait(&sm.full[buf][t], parity);
      small_qk<T, N, kTiles>([&](int t) { return sm.k[buf][t]; }, sm.q, sc);
      // The RoPE tile (D = 576) only feeds S: reload it with the block after next now.
      if (tid == 0 && reload && kTiles > kVTiles) load_tiles(buf, pg_reload, kVTiles, kTiles);

      // ---- mask (length, invalid page, causal), column maxima --------------------------------
      const bool pg_ok = pg_cur != p.num_blocks;
      const int key0 = kb * kBlockN;
      // Whole: inside the sequence and (causal) visible to every row; the first row sees least.
      const bool whole = pg_ok && valid == kBlockN && (!causal || key0 + kBlockN - 1 <= causal_shift);
      small_mask_max<N>(sc, scale_log2, whole, [&](int key, int r) {
        return pg_ok && key0 + key < len && (!causal || key0 + key <= r / hpg + causal_shift);
      }, sm.warp_max, warp, lane);
      // The V tail of the request's last page is garbage (maybe NaN): P is 0 there, 0 * NaN is not.
      if (valid < kBlockN) {
        const int rows = kBlockN - valid;
        for (int c = tid; c < rows * kVTiles * 8; c += kThreads) {
          const int t = c / (rows * 8), r = valid + (c / 8) % rows;
          *reinterpret_cast<uint4*>(sm.k[buf][t] + r * 128 + (c % 8) * 16) = make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async();
      }
      __syncthreads();

      // ---- P = exp2(S - m) as P [row][key], O^T rescaled, then O^T += V^T P^T --------------------
      small_softmax<T, N>(sc, sm.warp_max, m_run, l_part, o, sm.p, warp, lane);
      __syncthreads();  // P complete; every thread has read warp_max
      small_pv<T, N>([&](int t) { return sm.k[buf][t]; }, sm.p, o);
      if (tid == 0 && reload) load_tiles(buf, pg_reload, 0, kVTiles);
      pg_cur = pg_next;
      pg_next = pg_reload;
    }
    rounds[0] += uint32_t((n_blocks + 1) / 2);
    rounds[1] += uint32_t(n_blocks / 2);

    // ---- epilogue: l over the 8 lanes and 4 warps sharing a row; O^T / l out ---------------------
    small_row_sums<N>(l_part, sm.warp_sum, warp, lane);
    __syncthreads();
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * n + 2 * t4 + e;
        if (r >= num_rows) continue;
        const float l = sm.warp_sum[0][r] + sm.warp_sum[1][r] + sm.warp_sum[2][r] + sm.warp_sum[3][r];
        const float m = m_run[n][e];
        const int s = r / hpg, h = group * hpg + r % hpg;
        small_store_column<T, N>(p.o, p.split, p.b, p.s_q, p.h_q, i, pc.is_split, pc.split_index, s, h, o, n, e,
                                 key_lo, m, l, -INFINITY, warp == 0 && g == 0);
      }
  }
#endif  // MLA_SM90A_DEVICE
}

// ---- host side -------------------------------------------------------------------------------

template <typename T, int D, int N>
cudaError_t launch(const DenseDecodeParams& p, cudaStream_t stream) {
  DenseArgs args;
  args.p = p;
  const cudaError_t enc = encode_kv_tensor_map<T>(&args.kmap, p, D);
  if (enc != cudaSuccess) return enc;
  constexpr int smem = int(sizeof(Smem<D, N>)) + 1024;  // + alignment of the tiles to 1024 bytes
  static_assert(smem <= 227 * 1024, "both key buffers, Q and P fit the 227 KB an sm90 block may use");
  cudaError_t err = raise_smem_limit_once<dense_decode_small_kernel<T, D, N>>(smem, "the sm90 small-rows kernel");
  if (err != cudaSuccess) return err;
  return launch_dependent(dense_decode_small_kernel<T, D, N>, dim3(1, unsigned(p.h_k), unsigned(p.split.num_sm_parts)),
                          kThreads, smem, stream, args);
}

template <typename T, int N>
cudaError_t launch_for_dim(const DenseDecodeParams& p, cudaStream_t stream) {
  return p.d_qk == kHeadDimV32 ? launch<T, 576, N>(p, stream) : launch<T, 512, N>(p, stream);
}

}  // namespace sm90_small

cudaError_t sm90_dense_decode_small(const DenseDecodeParams& p, cudaStream_t stream) {
  // A fresh plan is made in the kernel, its part costs in a key buffer (the dispatcher sends more
  // parts than that holds to the planner kernel first).
  if (p.split.plan_fresh && p.split.num_sm_parts > kPlanMaxPartsIn64KB) return cudaErrorInvalidValue;
  const int rows = p.s_q * (p.h_q / p.h_k);
  if (rows > 32) return cudaErrorInvalidValue;  // the dispatch never sends more (kFeatHeadsOver32)
  cudaError_t err;
  if (p.dtype == DType::kFP16)
    err = rows <= 16 ? sm90_small::launch_for_dim<__half, 16>(p, stream) : sm90_small::launch_for_dim<__half, 32>(p, stream);
  else
    err = rows <= 16 ? sm90_small::launch_for_dim<__nv_bfloat16, 16>(p, stream)
                     : sm90_small::launch_for_dim<__nv_bfloat16, 32>(p, stream);
  if (err != cudaSuccess) return err;
  return combine(combine_params(p.b, p.s_q, p.h_q, p.split, p.o, nullptr), stream, /*pdl=*/true);
}

}  // namespace mla::cuda
