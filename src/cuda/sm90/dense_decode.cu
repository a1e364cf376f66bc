// Hopper (sm_90a) dense MLA decode: BF16/FP16 paged caches with 64-token pages, d_qk 576 or 512,
// d_v 512, any h_q with h_q % h_k == 0 (s_q x h_q / h_k query rows folded into 64-row tiles),
// bottom-right causal masking for s_q > 1.
//
// Schedule: 256 threads = two warpgroups; one CTA per (64-row tile, KV head, plan part), persistent
// over the part's pieces, one CTA per SM; with a fresh plan each CTA plans its own part first
// (plan_block.cuh); programmatic dependent launch from the kernel before and into the combine.
//   * loads (one thread each): a piece's Q once into shared memory (TMA, one 64 x 64 box a column
//     tile, where its rows are evenly strided; else cp.async by all threads), its first two blocks
//     right behind it; keys in 64-token blocks as 64 x 64 TMA tiles, each on its own mbarrier, into
//     two buffers K0 / K1 (V is the first 512 columns of the same rows), each tile reloaded with
//     the next pair's block as soon as its last reader is done; the next piece's Q and first
//     blocks go out in a piece's epilogue, ahead of its stores;
//   * multiplies and softmax ("seesaw", FlashMLA's, §6.1 of the reference): the warpgroups take a
//     pair's blocks in turn and share one running max per row (moved lazily, by more than 2^8);
//     WG0 owns O[:, 0:256], WG1 O[:, 256:512], in registers:
//       WG0: m0 = max(m, rowmax S0); P0 = exp2(S0 - m0) -> smem; O_L = O_L a0 + P0 V0L (P0 from registers)
//       WG1: m1 = max(m0, rowmax S1); O_R = O_R a0 + P0 V0R at once; then P1 = exp2(S1 - m1) -> smem;
//            O_R = O_R s1 + P1 V1R (s1 = exp2(m0 - m1), 1 in almost every pair: no wait then)
//       WG0: O_L = O_L s1 + P1 V1L, then S0' of the next pair behind it; WG1: S1' once K1 is back.
//     One warpgroup's softmax overlaps the other's products, and each S is queued behind the P V
//     before it. At D = 576 P0 / P1 live in the RoPE tile of K0 / K1 once S of that block is done;
//   * masks: only the pairs that reach a request's end or the causal limit test keys; a last page's
//     V tail is zeroed in shared memory (P is 0 there, 0 * NaN is not); invalid block-table entries
//     load as zeros (out-of-bounds TMA box) and are masked;
//   * epilogue: whole pieces write out / lse (16 bytes a lane), split pieces fp32 partials.
// Tile sizes: 64 rows x 64 keys; 64 x 64 TMA tiles in the 128-byte swizzle; Q + two key buffers =
// 216 KB at D = 576; wgmma m64n64k16 for S (both operands in shared memory, one commit group per
// tile) and m64n256k16 for P V.
// Reached on an H200 (bench/RESULTS.md, whole API calls with fresh plans, replays alternated with
// FlashMLA built from source in one run): b=128 s_q=2 h_q=128 s_k=8192 causal varlen 822.7 us,
// 85.3% of the 778 TFLOPS matmul ceiling (FlashMLA 879.8, 1.07x); b=128 h_q=128 s_k=4096 varlen
// 237.9 (259.2, 1.09x); b=128 h_q=16 s_k=8192 283.7, 100% of the copy ceiling (315.7, 1.11x)
// (thirty-fifth session); b=128 s_k=512 1.32x, b=2 s_k=65536 1.23x, b=1..8 1.13-1.58x
// (thirty-fourth). The largest steps: exp2 in one MUFU, mask-free steady pairs, one commit group
// per S tile, the plan in the kernel, 16-byte output stores, and in the pair the loads moved to the
// warpgroup that waits for them, P0 published before WG0's own product and O_R += P0 V0R issued
// before WG1's exponentials (causal 0.97x -> 1.07x over the last three).
// Measured and dropped (bench/RESULTS.md, the session named): TMA multicast of the keys to row
// tiles in a cluster (level, 18th); split pieces merged in this kernel instead of the combine (slower
// everywhere, 20th); the next piece's loads during a piece's last pairs (21st); the epilogue through
// shared memory and bulk or TMA stores (26th, 27th); L2 prefetch of the next pieces or pairs (24th,
// 33rd); keys at default L2 priority in every call (31st, 32nd: kept only with more than two row
// tiles); a tree for the row max (level, 35th).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

// Timing aid (MLA_DENSE_TIMELINE, below): the in-kernel planner's phases go into a table of their
// own, [row][phase] as plan_block.cuh numbers them, which the library exports as
// `extern "C" int mla_kernels_dense_plan_timeline(unsigned long long* rows, int max_rows)` (rows
// as in the main table; zero in a call that did not plan). The hook has to exist before
// plan_block.cuh is read.
#ifndef MLA_DENSE_TIMELINE
#define MLA_DENSE_TIMELINE 0
#endif
#if MLA_DENSE_TIMELINE
namespace mla::cuda::sm90 {
constexpr int kTimelineRows = 2048;
constexpr int kPlanStamps = 6;
__device__ unsigned long long g_dense_plan_timeline[kTimelineRows][kPlanStamps];
__device__ __forceinline__ int timeline_row() {
  return (int(blockIdx.z) * int(gridDim.y) + int(blockIdx.y)) * int(gridDim.x) + int(blockIdx.x);
}
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ void plan_stamp(int phase) {
  const int row = timeline_row();
  if (threadIdx.x == 0 && row < kTimelineRows) g_dense_plan_timeline[row][phase] = global_timer();
}
}  // namespace mla::cuda::sm90
#define MLA_PLAN_STAMP(phase) ::mla::cuda::sm90::plan_stamp(phase)
#endif

#include "../common/decode_io.cuh"
#include "../common/plan_block.cuh"
#include "../common/smem_limit.h"
#include "../implementations.h"
#include "common.cuh"
#include "kv_tensor_map.h"
#include "m64.cuh"
#include "ptx_sm90.cuh"

namespace mla::cuda {

namespace sm90 {

// Timing aid, never for results: MLA_DENSE_TIMELINE=1 makes thread 0 of every CTA of a launch write
// the global timer (ns) into its row of a device table: [0] the CTA's piece count, [1] entry, [2] after
// the dependency wait (and the plan), then for each of its first kTimelinePieces pieces its start,
// the end of its pairs and the end of its epilogue (0: not reached). The library then exports
// `extern "C" int mla_kernels_dense_timeline(unsigned long long* rows, int max_rows)`, which copies
// the last launch's table (row = (part * gridDim.y + KV head) * gridDim.x + row tile) and returns the
// rows written, for ctypes. Global stores, not printf: a call in the kernel serialises its wgmma.
#if MLA_DENSE_TIMELINE
constexpr int kTimelinePieces = 6;
constexpr int kTimelineStamps = 3 + 3 * kTimelinePieces;
__device__ unsigned long long g_dense_timeline[kTimelineRows][kTimelineStamps];
__device__ int g_dense_timeline_rows;
#endif

constexpr int kThreads = 256;
constexpr int kBlockM = 64;          // query rows per CTA
constexpr int kBlockN = 64;          // keys per block = page size = plan block
constexpr int kTileCols = 64;        // columns of a 64 x 64 tile (128 bytes of 16-bit elements)
constexpr int kTileBytes = kBlockN * 128;
[[maybe_unused]] constexpr int kVTilesPerWg = 4;      // each warpgroup owns 256 output columns = 4 tiles

static_assert(kBlockN == kPlanBlockSize, "one key block per plan block");

// Named barriers (0 is __syncthreads).
enum Barrier : int {
  kBarM0 = 1,    // WG0 published m0
  kBarP1 = 2,    // WG1 published m1, s1 and P1 (once its O_R += P0 V0R is queued)
  kBarP0 = 3,    // WG0 published P0 (relative to m0)
  kBarWg0 = 4,   // WG0 alone
  kBarWg1 = 5,   // WG1 alone
  kBarV1LDone = 6,  // WG0's O_L += P1 V1L is done (K1's V1L tiles and P1 are free once WG1's products are)
};

template <int D>
struct Smem {
  static constexpr int kTiles = D / kTileCols;  // 9 or 8
  // At D = 576 P0 / P1 live in the RoPE tile of K0 / K1, which only S of that block reads.
  static constexpr bool kPInRope = D == 576;
  uint8_t q[kTiles][kTileBytes];
  uint8_t k[2][kTiles][kTileBytes];
  uint8_t p_own[2][kPInRope ? 16 : kTileBytes];
  float m[kBlockM];       // the shared running max (log2 domain)
  float s1[kBlockM];      // WG1's rescale factor of the pair
  float l[2][kBlockM];    // row sums of each warpgroup, reduced in the epilogue
  uint64_t full[2][kTiles];
  uint64_t q_full;        // Q's boxes landed (q_by_tma)
  __device__ uint8_t* p(int buf) { return kPInRope ? k[buf][kTiles - 1] : p_own[buf]; }
};

#if defined(MLA_SM90A_DEVICE)

// Issues S (+)= Q K^T over tiles [t0, t1) of buffer `buf`, each tile once its TMA has landed, one
// wgmma group per tile, so that a wait for an earlier group leaves the tiles queued (the first
// tile of a block overwrites S). kLateFirstHalf: visit the tiles from the
// V tile 4 on and tiles 0-3 (then the RoPE tile) last, which is the order they are reloaded in K1.
template <typename T, int D, bool kLateFirstHalf = false>
__device__ __forceinline__ void qk_issue(Smem<D>& sm, int buf, uint32_t parity, int t0, int t1, float (&s)[32]) {
  wgmma_fence();
  // Two base descriptors, the others at constant offsets from them (a 64-bit add each, not a
  // descriptor built per wgmma).
  const uint64_t dq = smem_desc(sm.q[0], 0, 1024), dk = smem_desc(sm.k[buf][0], 0, 1024);
#pragma unroll
  for (int i = t0; i < t1; ++i) {
    int t = i;
    if constexpr (kLateFirstHalf) t = i < kVTilesPerWg ? i + kVTilesPerWg : i < 2 * kVTilesPerWg ? i - kVTilesPerWg : i;
    mbar_wait(&sm.full[buf][t], parity);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_ss_k<T>(s, desc_offset(dq, t * kTileBytes + kk * 32), desc_offset(dk, t * kTileBytes + kk * 32),
                    i > t0 || kk > 0 || t0 > 0);
    wgmma_commit();
  }
}

// Zeroes key rows [valid, 64) of V tiles [t0, t0 + 4) of `buf` (the garbage, maybe NaN, past a
// request's length in its last page: P is 0 there, but 0 * NaN is not), then makes the writes
// visible to wgmma for the whole warpgroup. Lane l of a warp clears 16-byte chunk l % 8 of tile
// t0 + l / 8 in every fourth row from valid + warp (a whole row either way, so the swizzle does not
// matter), which needs no division by the row count: a division's inlined sequence at each of the
// four call sites made the masked pairs of varlen calls slower.
template <int D>
__device__ __forceinline__ void zero_v_tail(Smem<D>& sm, int buf, int t0, int valid, int wtid, int bar) {
  uint8_t* chunk = sm.k[buf][t0 + (wtid % 32) / 8] + (wtid % 8) * 16;
  for (int r = valid + wtid / 32; r < kBlockN; r += 4)
    *reinterpret_cast<uint4*>(chunk + r * 128) = make_uint4(0, 0, 0, 0);
  fence_proxy_async();
  named_sync(bar, 128);
}

#endif  // MLA_SM90A_DEVICE

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) dense_decode_kernel(const __grid_constant__ DenseArgs args) {
#if defined(MLA_SM90A_DEVICE)
  using SmemT = Smem<D>;
  constexpr int kTiles = SmemT::kTiles;
  const DenseDecodeParams& p = args.p;
  extern __shared__ uint8_t smem_raw[];
  // Tiles 1024-byte aligned; offsetting smem_raw (not rebuilding the pointer from an integer) keeps
  // the accesses in the shared address space (STS/LDS rather than generic stores and loads).
  SmemT& sm = *reinterpret_cast<SmemT*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));

  // Warp-uniform values go through a shuffle so that the compiler knows them uniform: a wgmma
  // under a branch it cannot prove uniform gets serialised.
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128;
  const int warp = wtid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int rr[2] = {warp * 16 + g, warp * 16 + g + 8};  // this thread's two rows of the tile
  const int group = blockIdx.y, part = blockIdx.z;
  const int hpg = p.h_q / p.h_k, num_rows = p.s_q * hpg, row_base = blockIdx.x * kBlockM;
  const DecodePlanParams plan = dense_plan_params(p);
  const float scale_log2 = p.softmax_scale * kLog2e;
  // Q is read once: evict first. Keys are read by every row tile of a part, each by its own TMA. Up
  // to two row tiles (one TPC) their requests mostly meet in L2's request coalescer, and keys evict
  // first. With more (s_q = 2 at h_q = 128: four, on two TPCs) the second TPC's requests come after
  // the first's have been served, and evict first would have sent those lines to DRAM again: keys
  // keep L2's default priority there (causal b=128 s_q=2 alone 0.93x -> 0.98x FlashMLA). Default
  // priority for every call was slower in alternated replays at b <= 8 with long sequences and at
  // varlen b=128 (bench/RESULTS.md, thirty-first and thirty-second sessions).
  const uint64_t policy = evict_first_policy();
  const uint64_t key_policy = gridDim.x > 2 ? kL2DefaultPriorityPolicy : policy;
  // Tiles [t0, t1) of the 64-key block in `page` into key buffer `buf` (one thread issues).
  auto load_tiles = [&](int buf, int page, int t0, int t1) {
    issue_key_tiles(sm.k[buf], sm.full[buf], &args.kmap, page, group, t0, t1, key_policy);
  };

#if MLA_DENSE_TIMELINE
  const int tl_row = timeline_row();
  unsigned long long* timeline = tl_row < kTimelineRows ? g_dense_timeline[tl_row] : nullptr;
  auto stamp = [&](int at) {
    if (tid == 0 && timeline && at < kTimelineStamps) timeline[at] = global_timer();
  };
  if (tid == 0 && timeline) {
    for (int at = 0; at < kTimelineStamps; ++at) timeline[at] = 0;
    for (int at = 0; at < kPlanStamps; ++at) g_dense_plan_timeline[tl_row][at] = 0;
    if (tl_row == 0) g_dense_timeline_rows = int(gridDim.x * gridDim.y * gridDim.z);
  }
  stamp(1);
#define MLA_TL(at) stamp(at)
#else
#define MLA_TL(at)
#endif
  if (tid == 0) {
    for (int b = 0; b < 2; ++b)
      for (int t = 0; t < kTiles; ++t) mbar_init(&sm.full[b][t], 1);
    mbar_init(&sm.q_full, 1);
    fence_barrier_init();
  }
  __syncthreads();
  wait_then_plan<kThreads>(p.split, plan, part, sm.k[0], sm.k[1]);
  MLA_TL(2);

  uint32_t rounds[2] = {0, 0};  // loads issued into each buffer so far (mbarrier phases)
  const int num_pieces = decode_io::num_pieces(p.split, p.b, part);
  // A piece's Q -> shared memory (swizzled; rows past the tile's live rows zero), with its first two
  // blocks' loads (both buffers are free) right behind Q's: the block-table reads and the keys'
  // latency overlap Q's, and Q, queued first, is not held up behind 144 KB of keys. Where Q's rows
  // are evenly strided (args.q_by_tma) one thread loads Q by TMA, a box per 64 columns completing
  // on q_full, which the threads wait for (q_landed) just before the piece's first S; otherwise the
  // threads copy its rows (cp.async), which staged_rows_landed() waits for. Either way the epilogue
  // of the piece before, which stages the next piece, runs its stores while Q is in flight.
  auto stage_piece = [&](const DensePiece& x) {
    const int32_t* x_table = p.block_table + int64_t(x.req) * p.block_table_stride;
    auto first_blocks = [&] {
      if (tid == 0) {
        if (x.n_blocks > 0) load_tiles(0, dense_page(p, x_table, x.block_begin), 0, kTiles);
        if (x.n_blocks > 1) load_tiles(1, dense_page(p, x_table, x.block_begin + 1), 0, kTiles);
      }
    };
    if (args.q_by_tma) {
      if (tid == 0) {
        mbar_expect_tx(&sm.q_full, kTiles * kTileBytes);
#pragma unroll 1
        for (int t = 0; t < kTiles; ++t)
          tma_load_4d(sm.q[t], &args.qmap, &sm.q_full, t * kTileCols, row_base, group, x.req, policy);
      }
      first_blocks();
    } else {
      stage_q<T, D, kBlockM, kThreads, false>(p, x.req, group, row_base, sm.q[0], tid, first_blocks);
    }
  };
  auto q_landed = [&](int k) {
    if (args.q_by_tma) mbar_wait(&sm.q_full, uint32_t(k) & 1u);
  };
  DensePiece pc = {};
  if (num_pieces > 0) {
    pc = dense_piece(p, plan, part, 0, kBlockN);
    stage_piece(pc);
    if (!args.q_by_tma) staged_rows_landed();
  }
  for (int k = 0; k < num_pieces; ++k) {
    const int i = pc.req, len = pc.len, block_begin = pc.block_begin, n_blocks = pc.n_blocks;
    const int32_t* table = p.block_table + int64_t(i) * p.block_table_stride;
    auto page_of = [&](int kb) { return dense_page(p, table, kb); };
    __syncthreads();  // Q staged (every thread's copies landed, or q_landed waits for the TMA)
    MLA_TL(3 + 3 * k);
    if (args.release_early && k + 1 == num_pieces) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    // The last key position each row may see (bottom-right causal for s_q > 1).
    int row_limit[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + rr[h];
      row_limit[h] = (!p.causal || p.s_q == 1) ? INT_MAX : row / hpg + len - p.s_q;
    }

    float m_prev[2] = {-INFINITY, -INFINITY};  // the shared running max before this pair
    float l_own[2] = {0.f, 0.f};               // this thread's part of its rows' sums
    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.f;

    // Block kb0 + wg of pair j (buffer wg) is load number base[wg] + j of that buffer.
    const uint32_t base0 = rounds[0], base1 = rounds[1];
    auto parity = [&](int buf, int j) { return uint32_t((buf == 0 ? base0 : base1) + j) & 1u; };
    // Pages of the pair's two blocks, and of the next pair's (read one pair ahead, so that the
    // block-table latency is off the path from a freed buffer to its reload).
    int pg0 = n_blocks > 0 ? page_of(block_begin) : p.num_blocks;
    int pg1 = n_blocks > 1 ? page_of(block_begin + 1) : p.num_blocks;

    // S of the first pair's blocks; later pairs' S is issued behind the P V of the pair before.
    float s[32];
    q_landed(k);
    if (wg == 0 || n_blocks > 1) {
      if (n_blocks > wg) {
        qk_issue<T, D>(sm, wg, parity(wg, 0), 0, kTiles, s);
        wgmma_wait<0>();
        fence_regs(s);
      }
    }

    // One pair of blocks. kSteady: both blocks and the next pair's two exist and neither block is
    // the request's last, so none of the tail branches is compiled in (they cost measurable time
    // in the wgmma issue sequence).
    auto run_pair = [&](const int j, auto steady) {
      constexpr bool kSteady = decltype(steady)::value;
      const int jp = j / 2;
      const int kb0 = block_begin + j, kb1 = kb0 + 1;
      const bool has1 = kSteady || j + 1 < n_blocks, next0 = kSteady || j + 2 < n_blocks;
      const bool next1 = kSteady || j + 3 < n_blocks;
      const int kb = wg == 0 ? kb0 : kb1;  // the block whose S this warpgroup holds
      const bool mine = wg == 0 || has1;
      const int valid0 = kSteady ? kBlockN : min(kBlockN, len - kb0 * kBlockN);
      const int valid1 = kSteady ? kBlockN : min(kBlockN, len - kb1 * kBlockN);
      const int nxt0 = next0 ? page_of(kb0 + 2) : p.num_blocks, nxt1 = next1 ? page_of(kb1 + 2) : p.num_blocks;

      // ---- mask and row max of this warpgroup's S ------------------------------------------
      // Steady pairs need no per-key mask (every key of both blocks is below the sequence end and
      // the causal limit): S stays unscaled, the row max is scaled once, and exponentiate_fma
      // folds the scale into P = exp2(S scale - m); an invalid page's P is exp2(-inf) = 0.
      float row_max[2] = {-INFINITY, -INFINITY};
      const bool pg_ok = mine && (wg == 0 ? pg0 : pg1) != p.num_blocks;
      if constexpr (kSteady) {
#pragma unroll
        for (int n = 0; n < 32; ++n) row_max[(n % 4) / 2] = fmaxf(row_max[(n % 4) / 2], s[n]);
      } else {
        // Key kb * 64 + 8 n + 2 t4 + e2 counts for row h iff 8 n + e2 <= thr[h]: the last key the
        // row may see (sequence end, causal limit; none on an invalid page) less this thread's
        // first key, so that each key's test is one compare with a constant (no branch, which
        // would make ptxas fence the next wgmma chain that writes s).
        int thr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) thr[h] = pg_ok ? min(len - 1, row_limit[h]) - (kb * kBlockN + 2 * t4) : -1;
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = e / 2;
            s[n * 4 + e] = n * 8 + (e % 2) <= thr[h] ? s[n * 4 + e] * scale_log2 : -INFINITY;
            row_max[h] = fmaxf(row_max[h], s[n * 4 + e]);
          }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
        if constexpr (kSteady) row_max[h] = pg_ok ? row_max[h] * scale_log2 : -INFINITY;
      }
      // P = exp2(S - m) (S scaled and masked above) or exp2(S scale - m) (steady), summed per row.
      auto softmax = [&](const float (&m)[2], float (&sum)[2]) {
        if constexpr (kSteady) {
          const float bias[2] = {pg_ok ? -m[0] : -INFINITY, pg_ok ? -m[1] : -INFINITY};
          exponentiate_fma(s, scale_log2, bias, sum);
        } else {
          exponentiate(s, m, sum);
        }
      };

      if (wg == 0) {
        // ---- WG0: m0, P0 (into shared memory for WG1 as it is); O_L = O_L a0 + P0 V0L -------
        float m0[2], a0[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          m0[h] = lazy_max(m_prev[h], row_max[h]);
          a0[h] = m0[h] == m_prev[h] ? 1.f : exp2_ftz(m_prev[h] - m0[h]);
        }
        softmax(m0, sum);
        if (t4 == 0) sm.m[rr[0]] = m0[0], sm.m[rr[1]] = m0[1];
        named_arrive(kBarM0, kThreads);
#pragma unroll
        for (int h = 0; h < 2; ++h) l_own[h] = l_own[h] * a0[h] + sum[h];
        if (__any_sync(0xffffffffu, a0[0] != 1.f || a0[1] != 1.f)) scale_rows(o, a0[0], a0[1]);
        uint32_t pa[4][4];
        pack_p<T>(s, pa);
        // P0 relative to m0, not m1: WG1 scales its O_R += P0 V0R by s1 itself, so P0 goes out
        // before this warpgroup's own product rather than after WG1's softmax and that product.
        store_p(sm.p(0), pa, warp, lane);
        fence_proxy_async();
        named_arrive(kBarP0, kThreads);
        if (valid0 < kBlockN) zero_v_tail(sm, 0, 0, valid0, wtid, kBarWg0);
        pv_rs<T>(sm.k[0][0], pa, o);
        wgmma_wait<0>();
        fence_regs(o);
        // K0's V0L tiles are free (WG1 reads only V0R and P0 of K0).
        if (wtid == 0 && next0) load_tiles(0, nxt0, 0, kVTilesPerWg);

        // ---- WG1 published m1, s1 and P1: O_L = O_L s1 + P1 V1L, then the next S0 -------------
        // K1's V1L tiles landed: WG1 waited for every tile of K1 before its S1, then arrived at
        // kBarP1, which this warpgroup has passed (the barrier orders WG1's observation of the
        // loads before this warpgroup's reads, as a wait here would, without the polls).
        named_sync(kBarP1, kThreads);
        float s1[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) s1[h] = sm.s1[rr[h]], m_prev[h] = sm.m[rr[h]];
        if (__any_sync(0xffffffffu, s1[0] != 1.f || s1[1] != 1.f)) scale_rows(o, s1[0], s1[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) l_own[h] *= s1[h];
        if (has1 && valid1 < kBlockN) zero_v_tail(sm, 1, 0, valid1, wtid, kBarWg0);
        if (has1) pv_ss<T>(sm.p(1), sm.k[1][0], o);
        // S0's first kS0Early tiles go behind it, one wgmma group each, so that the wait for O_L's
        // group leaves them queued.
        constexpr int kS0Early = kVTilesPerWg;
        if (next0) qk_issue<T, D>(sm, 0, parity(0, jp + 1), 0, kS0Early, s);
        if (has1) {
          if (next0) wgmma_wait<kS0Early>(); else wgmma_wait<0>();
          fence_regs(o);
          // K1's V1L tiles (and, at D = 576, P1 in its RoPE tile) are read: WG1 reloads them.
          if (next1) named_arrive(kBarV1LDone, kThreads);
        }
        if (next0) qk_issue<T, D>(sm, 0, parity(0, jp + 1), kS0Early, kTiles, s);
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(s);
      } else {
        // ---- WG1: m1, s1, P1; O_R = (O_R a0 + P0 V0R) s1 + P1 V1R ---------------------------
        named_sync(kBarM0, kThreads);
        float m1[2], a0[2], s1[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m0 = sm.m[rr[h]];
          m1[h] = lazy_max(m0, row_max[h]);
          s1[h] = m1[h] == m0 ? 1.f : exp2_ftz(m0 - m1[h]);
          a0[h] = m0 == m_prev[h] ? 1.f : exp2_ftz(m_prev[h] - m0);
          if (t4 == 0) sm.s1[rr[h]] = s1[h];
        }
        // O_R = O_R a0 + P0 V0R goes out before this warpgroup's own exponentials, which it then
        // overlaps, rather than after them: P0 is there (WG0 stores it long before S1 is done)
        // and the exponentials would otherwise sit between WG0's O_L += P0 V0L and this product
        // with nothing else queued.
        if (__any_sync(0xffffffffu, a0[0] != 1.f || a0[1] != 1.f)) scale_rows(o, a0[0], a0[1]);
        // K0's V0R tiles landed: WG0 waited for every tile of K0 before its S0, then arrived at
        // kBarM0 and kBarP0.
        named_sync(kBarP0, kThreads);
        if (valid0 < kBlockN) zero_v_tail(sm, 0, kVTilesPerWg, valid0, wtid, kBarWg1);
        pv_ss<T>(sm.p(0), sm.k[0][kVTilesPerWg], o);
        softmax(m1, sum);
        if (t4 == 0) sm.m[rr[0]] = m1[0], sm.m[rr[1]] = m1[1];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          m_prev[h] = m1[h];
          l_own[h] = l_own[h] * (a0[h] * s1[h]) + sum[h];
        }
        uint32_t pa[4][4];
        pack_p<T>(s, pa);
        uint8_t* p1 = sm.p(1);
        if (has1) {
          // P1 into shared memory, for WG0's O_L += P1 V1L and this warpgroup's O_R += P1 V1R.
          store_p(p1, pa, warp, lane);
          fence_proxy_async();
        }
        // m1, s1 and P1 for WG0 (O_R += P0 V0R is queued ahead of WG0's O_L += P1 V1L).
        named_arrive(kBarP1, kThreads);
        // s1 moves O_R += P0 V0R onto m1 (rare once the max settles: then nothing waits here).
        if (__any_sync(0xffffffffu, s1[0] != 1.f || s1[1] != 1.f)) {
          wgmma_wait<0>();
          fence_regs(o);
          scale_rows(o, s1[0], s1[1]);
        }
        if (has1) {
          if (valid1 < kBlockN) zero_v_tail(sm, 1, kVTilesPerWg, valid1, wtid, kBarWg1);
          named_sync(kBarWg1, 128);  // every warp's part of P1 stored
          pv_ss<T>(p1, sm.k[1][kVTilesPerWg], o);
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        // K0's V0R tiles (and, at D = 576, P0 in its RoPE tile) are free once O_R += P0 V0R is done.
        if (wtid == 0 && next0) load_tiles(0, nxt0, kVTilesPerWg, kTiles);
        wgmma_wait<0>();
        fence_regs(o);
        if (next1) {
          // K1's V1R tiles are free now, the rest of K1 (V1L, and the RoPE tile that holds P1 at
          // D = 576) once WG0's O_L += P1 V1L is done. Issued here rather than by WG0, whose S0'
          // would wait at its next wgmma for the warp issuing them: the causal call 0.97x ->
          // 0.99-1.00x FlashMLA alternated (bench/RESULTS.md, thirty-third session).
          if (wtid == 0) load_tiles(1, nxt1, kVTilesPerWg, 2 * kVTilesPerWg);
          named_sync(kBarV1LDone, kThreads);
          if (wtid == 0) {
            load_tiles(1, nxt1, 0, kVTilesPerWg);
            if (kTiles > 2 * kVTilesPerWg) load_tiles(1, nxt1, 2 * kVTilesPerWg, kTiles);
          }
          qk_issue<T, D, true>(sm, 1, parity(1, jp + 1), 0, kTiles, s);
          wgmma_wait<0>();
          fence_regs(s);
        }
      }
      pg0 = nxt0, pg1 = nxt1;
    };
    int j = 0;
    // (Steady pairs end at least 65 keys before the sequence does, so the causal limit, at least
    // s_q - 1 keys before it, spares them when s_q <= 64.)
    if (!p.causal || p.s_q <= kBlockN)
      for (; j + 3 < n_blocks; j += 2) run_pair(j, std::true_type{});
    for (; j < n_blocks; j += 2) run_pair(j, std::false_type{});
    MLA_TL(4 + 3 * k);
    rounds[0] += uint32_t((n_blocks + 1) / 2);
    rounds[1] += uint32_t(n_blocks / 2);

    // ---- epilogue ----------------------------------------------------------------------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_own[h] += __shfl_xor_sync(0xffffffffu, l_own[h], 1);
      l_own[h] += __shfl_xor_sync(0xffffffffu, l_own[h], 2);
      if (t4 == 0) sm.l[wg][rr[h]] = l_own[h];
    }
    __syncthreads();  // sm.l; and every product of the piece is done with Q, P and both buffers
    float l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = sm.l[0][rr[h]] + sm.l[1][rr[h]];
    auto store_piece = [&] {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Every lane takes part (the stores transpose within quads); rows past the tile's write nothing.
        const int row = row_base + rr[h];
        const int s = row / hpg, head = group * hpg + row % hpg;
        decode_io::store_row<kM64OTiles, T, true>(
            p.o, p.split, p.b, p.s_q, p.h_q, i, pc.is_split, pc.split_index, s, head, wg * 256, t4,
            [&](int n) { return make_float2(o[4 * n + 2 * h], o[4 * n + 2 * h + 1]); }, m_prev[h], l[h], 1.f,
            -INFINITY, wg == 0 && t4 == 0, row < num_rows);
      }
    };
    // The next piece's Q and first blocks go out before this piece's stores, which then overlap
    // their latency. One call site of the stores: each is a long unrolled sequence, run once a
    // piece from an instruction cache the steady pairs have had to themselves.
    const bool more = k + 1 < num_pieces;
    DensePiece nx = pc;
    if (more) {
      nx = dense_piece(p, plan, part, k + 1, kBlockN);
      stage_piece(nx);
    }
    store_piece();
    if (more && !args.q_by_tma) staged_rows_landed();
    MLA_TL(5 + 3 * k);
    pc = nx;
  }
#if MLA_DENSE_TIMELINE
  if (tid == 0 && timeline) timeline[0] = (unsigned long long)num_pieces;
#endif
#undef MLA_TL
#endif  // MLA_SM90A_DEVICE
}

// ---- host side -------------------------------------------------------------------------------

template <typename T, int D>
cudaError_t launch(const DenseDecodeParams& p, cudaStream_t stream) {
  DenseArgs args;
  args.p = p;
  const cudaError_t enc = encode_kv_tensor_map<T>(&args.kmap, p, D);
  if (enc != cudaSuccess) return enc;
  args.q_by_tma = encode_q_tensor_map<T>(&args.qmap, p, D);
  // The combine launches once every CTA has reached its last piece, so that its CTAs are resident
  // when this kernel ends and those of whole requests have left already (with a plan made before
  // the call they do not wait for this kernel). Only where the requests are at least as many as the
  // parts: a few long requests have few combine CTAs, each with many splits to merge, and launched
  // early they pile onto the SMs that finish first (b=2 s_k=65536 72.4 -> 76.7 us, b=4 s_k=8192
  // 32.4 -> 34.1 with the plan reused; b=128 s_k=512 47.7 -> 43.6, H200, twenty-eighth session).
  // And only at s_q = 1: the s_q = 2 causal call (b=128, four row tiles, 33 parts) gains nothing
  // from it (plan reused 958.7 / 955.0 us with it, 952.6 / 943.9 without, twenty-ninth session).
  args.release_early = p.s_q == 1 && p.b >= p.split.num_sm_parts;

  constexpr int smem = int(sizeof(Smem<D>)) + 1024;  // + alignment of the tiles to 1024 bytes
  static_assert(smem <= 227 * 1024, "Q, both key buffers and P fit the 227 KB an sm90 block may use");
  const cudaError_t err = raise_smem_limit_once<dense_decode_kernel<T, D>>(smem, "the sm90 dense decode kernel");
  if (err != cudaSuccess) return err;
  const int rows = p.s_q * (p.h_q / p.h_k);
  const dim3 grid(unsigned(ceil_div(rows, kBlockM)), unsigned(p.h_k), unsigned(p.split.num_sm_parts));
  return launch_dependent(dense_decode_kernel<T, D>, grid, kThreads, smem, stream, args);
}

}  // namespace sm90

cudaError_t sm90_dense_decode(const DenseDecodeParams& p, cudaStream_t stream) {
  // A fresh plan is made in the kernel, its part costs in a key buffer (the dispatcher sends more
  // parts than that holds to the planner kernel first).
  if (p.split.plan_fresh && p.split.num_sm_parts > kPlanMaxPartsIn64KB) return cudaErrorInvalidValue;
  cudaError_t err;
  const bool d576 = p.d_qk == kHeadDimV32;
  if (p.dtype == DType::kFP16)
    err = d576 ? sm90::launch<__half, 576>(p, stream) : sm90::launch<__half, 512>(p, stream);
  else
    err = d576 ? sm90::launch<__nv_bfloat16, 576>(p, stream) : sm90::launch<__nv_bfloat16, 512>(p, stream);
  if (err != cudaSuccess) return err;
  return combine(combine_params(p.b, p.s_q, p.h_q, p.split, p.o, nullptr), stream, /*pdl=*/true);
}

}  // namespace mla::cuda

#if MLA_DENSE_TIMELINE
namespace {
// Copies the last launch's rows of a timeline table, at most max_rows; returns the rows copied, or
// -1 on an error.
template <typename Table>
int copy_timeline(const Table& table, unsigned long long* rows, int max_rows) {
  using namespace mla::cuda::sm90;
  int n = 0;
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(&n, g_dense_timeline_rows, sizeof(int)) != cudaSuccess)
    return -1;
  n = n < max_rows ? n : max_rows;
  n = n < kTimelineRows ? n : kTimelineRows;
  if (n > 0 && cudaMemcpyFromSymbol(rows, table, size_t(n) * sizeof(table[0])) != cudaSuccess) return -1;
  return n;
}
}  // namespace

extern "C" int mla_kernels_dense_timeline(unsigned long long* rows, int max_rows) {
  return copy_timeline(mla::cuda::sm90::g_dense_timeline, rows, max_rows);
}
// The planner's table of the same launch, rows as in mla_kernels_dense_timeline.
extern "C" int mla_kernels_dense_plan_timeline(unsigned long long* rows, int max_rows) {
  return copy_timeline(mla::cuda::sm90::g_dense_plan_timeline, rows, max_rows);
}
#endif
