// Hopper (sm_90a) sparse MLA decode over FP8 caches (V3.2: d_qk 576, 656 bytes per token; MODEL1:
// d_qk 512, 584 bytes per token, block-interleaved scales) for more than 32 heads, 64 heads per
// CTA (h_q not a multiple of 64 leaves the last CTA's spare rows zero). Every feature of the op:
// the attention sink, topk_length, an extra cache with its own page size, extra_topk_length;
// indices outside the cache are invalid and never read.
//
// Schedule (384 threads = three warpgroups, one CTA per (64-head tile, query token s, plan part),
// persistent over the part's pieces; one CTA per SM):
//   * warpgroup 2 produces (setmaxnreg 136): per 64-slot block, rounds of 32 tokens, four threads
//     per token, each loading every fourth 16-byte chunk of the FP8 record (two 8-byte loads
//     for a MODEL1 record in a page block that is only 8-byte aligned) one round ahead of its
//     dequantisation (e4m3 * scale -> bf16, RoPE copied) into a 64 x D key buffer in the 128-byte
//     swizzle, with a validity flag per token; two buffers handed over with full / empty mbarriers
//     (one arrival per warp);
//   * with 65 to 128 heads the token's two 64-head CTAs form a cluster: each producer takes one of
//     the two rounds of every block, stores it into its own buffer, and each producer warp copies
//     its eight rows of every tile into the peer's buffer with the bulk-copy engine (nine 1 KB
//     copies per warp and block), so each CTA dequantises half of what it multiplies (FlashMLA's
//     crossover). The copies and the flags (st.async) complete their bytes on the peer's full
//     barrier (warp 0 of the peer's producer expects them); empty counts both CTAs' consumer warps
//     (remote arrivals); every wait is CTA-scoped, as in a TMA-multicast pipeline (cluster-scope
//     acquires cost 17% of the stall samples in L1 invalidations);
//   * warpgroup 0 (setmaxnreg 208): S = Q K^T (64 heads x 64 tokens, wgmma m64n64k16 over the D / 64
//     tiles), invalid tokens masked, online softmax (running max and sum per head in registers;
//     the max moves only when a block exceeds it by more than 2^8, so most blocks skip the rescale),
//     P to shared memory with the rescale factor of each head, then O[:, 0:256] = O a + P V_L with
//     P from registers;
//   * warpgroup 1 (setmaxnreg 160): O[:, 256:512] = O a + P V_R with P from shared memory;
//   * named barriers order P: warpgroup 0 writes a block's P and factors once warpgroup 1 is done
//     with the previous block's ("P free"), and warpgroup 1 multiplies once they are written ("P
//     ready"); every consumer warp returns a buffer to the producers once its product is done;
//   * epilogue: O / (l + exp2(sink - m)) to out / lse for whole pieces, fp32 partials for split
//     ones (the combine kernel applies the sink), each warpgroup its 256 columns;
//   * with a fresh plan every CTA first plans its own part (plan_block.cuh; no planner kernel),
//     the two CTAs of a cluster before either stores into the other's buffers.
// Tile sizes: 64 heads, 64-token blocks, two bf16 key buffers (144 KB at d_qk 576) + Q (72 KB) +
// P (8 KB); wgmma m64n64k16 (S) and m64n256k16 (P V).
// Reached on an H200 (bench/RESULTS.md, fifteenth session, whole API calls beside FlashMLA in one
// run): V3.2 b=128 h_q=128 topk 2048 178.5 us (FlashMLA 196.3, 1.10x); b=128 s_q=2 341.9 (356.3,
// 1.04x); b=32 s_q=2 96.6 (99.0, 1.02x); MODEL1 b=128 h_q=128 mixed with sink 84.9 (105.7, 1.24x).
// On an H100 (thirty-seventh session, the same kernels with the records evict-first in L2): V3.2
// b=128 h_q=128 184.0 us (FlashMLA 209.1, 1.14x); s_q=2 b=128 346.0 (377.2, 1.09x), b=32 98.9
// (106.9, 1.08x); MODEL1 b=128 h_q=128 mixed with sink 89.2 (109.3, 1.23x). Forty-third session,
// H100, the V3.2 plan in closed form (no topk_length; plan_block.cuh): b=128 h_q=128 185.1 / 183.4
// -> 180.2 / 181.3 us over two rounds (FlashMLA 208.2-210.3, 1.16x).
// With both plans reused the kernels are level with FlashMLA's (tenth session: 172.9 against
// 173.7). The largest steps: the cluster crossover 515 -> 357 us; st.async instead of cluster-scope
// fences 357 -> 316; per-thread store offsets, the index a step ahead, lengths once per request
// 316 -> 237; the peer's half by bulk copy 241 -> 197; the planner in the kernel 197.6 -> 177.8.
// Timed alone (MLA_SPARSE_DIAG below) the consumers take 151 us and the producers 128, together
// 197 (before the planner step): warpgroup 0 waits on `full` a fifth of its time, the two buffers
// are the limit, and a third does not fit beside Q (72 KB) at d_qk 576. Warpgroup 0 issues
// O_L += P V_L before it hands P over (the hand-over runs under the product).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "../common/decode_io.cuh"
#include "../common/plan_block.cuh"
#include "../common/smem_limit.h"
#include "../implementations.h"
#include "common.cuh"
#include "m64.cuh"
#include "mla/sparse_slots.h"
#include "ptx_sm90.cuh"
#include "sparse_tokens.cuh"

namespace mla::cuda {

namespace sm90_sparse {

using namespace sm90;
// Timing aid, never for results: MLA_SPARSE_DIAG=1 makes the consumers skip their products (the
// producers alone), 2 makes the producers skip their loads and stores (the consumers alone).
#ifndef MLA_SPARSE_DIAG
#define MLA_SPARSE_DIAG 0
#endif
constexpr int kDiag = MLA_SPARSE_DIAG;

constexpr int kThreads = 384;  // warpgroups 0 and 1 consume, 2 produces
[[maybe_unused]] constexpr int kConsumers = 256;
constexpr int kBlockM = 64;    // heads per CTA
constexpr int kBlockN = 64;    // tokens per block = plan block
constexpr int kRoundTokens = 32;  // tokens a producer round covers (four threads per token)
[[maybe_unused]] constexpr int kTokenParts = 128 / kRoundTokens;
constexpr int kTileBytes = kM64TileBytes;
[[maybe_unused]] constexpr int kVTilesPerWg = 4;  // each consumer warpgroup owns 256 output columns = 4 tiles
static_assert(kBlockN == kPlanBlockSize, "one token block per plan block");
static_assert(kBlockN == 2 * kRoundTokens, "two producer rounds per block");
// Registers per thread of each warpgroup after setmaxnreg (multiples of 8). The CTA starts with
// 168 per thread (64 K / 384, rounded down to 8) and setmaxnreg only moves registers between its
// warpgroups, so the three must sum to at most 3 x 168.
constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
constexpr int kRegsWg0 = 208, kRegsWg1 = 160, kRegsProducer = 136;
static_assert(kRegsWg0 + kRegsWg1 + kRegsProducer <= 3 * kLaunchRegs, "setmaxnreg moves registers, never adds");

enum Barrier : int {
  kBarPReady = 1,  // warpgroup 0 wrote P and the factors of a block
  kBarPFree = 2,   // warpgroup 1 is done with them
  kBarEpilogue = 3,  // warpgroup 0 wrote the piece's final max and sum
  kBarWg0 = 4,     // warpgroup 0 alone
};

template <int D>
struct Smem {
  static constexpr int kTiles = D / 64;  // 9 or 8
  uint8_t q[kTiles][kTileBytes];
  uint8_t k[2][kTiles][kTileBytes];  // dequantised tokens [token][dim], bf16, swizzled
  uint8_t p[kTileBytes];             // P [head][token], bf16, swizzled
  float factor[kBlockM];             // the block's rescale factor of each head's output
  float m_final[2][kBlockM];         // per piece (by parity): the heads' final max and sum
  float l_final[2][kBlockM];
  uint8_t valid[2][kBlockN];
  uint64_t full[2], empty[2];
};

#if defined(MLA_SM90A_DEVICE)

// Warpgroup kWg (0 or 1) of the consumers: the CTA's pieces, block by block, then each piece's
// epilogue for this warpgroup's 256 output columns.
template <KvFormat F, int kWg, int kPeers>
__device__ __forceinline__ void consume(const SparseDecodeParams& p, Smem<SparseFormat<F>::kD>& sm,
                                        const DecodePlanParams& plan, int num_pieces, int row_base, int s, int part,
                                        int wtid) {
  constexpr int D = SparseFormat<F>::kD;
  constexpr int kTiles = Smem<D>::kTiles;
  const int warp = wtid / 32, lane = wtid % 32, g = lane / 4, t4 = lane % 4;
  const uint32_t peer_empty = kPeers > 1 ? peer_addr(&sm.empty[0], cluster_rank() ^ 1) : 0;
  const float scale_log2 = p.softmax_scale * kLog2e;
  const int rr[2] = {warp * 16 + g, warp * 16 + g + 8};  // this thread's two rows (heads) of the tile
  int total_blocks = 0;  // the CTA's blocks over all its pieces (for the P barriers' first / last)
  for (int k = 0; k < num_pieces; ++k) {
    const PlanPiece pc = decode_io::piece(p.split, plan, part, k);
    total_blocks += max(0, pc.block_end - pc.block_begin);
  }
  total_blocks = __shfl_sync(0xffffffffu, total_blocks, 0);
  const auto* q = reinterpret_cast<const __nv_bfloat16*>(p.q);
  const bool q_vec = rows_16b_aligned(q, p.q_stride_b, p.q_stride_s, p.q_stride_h);

  uint32_t count = 0;  // blocks consumed so far
  for (int k = 0; k < num_pieces; ++k) {
    const PlanPiece pc = decode_io::piece(p.split, plan, part, k);
    const int i = __shfl_sync(0xffffffffu, pc.req, 0);
    const int n_blocks = __shfl_sync(0xffffffffu, max(0, pc.block_end - pc.block_begin), 0);

    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_own[2] = {0.f, 0.f};

    if constexpr (kWg == 0) {
      // Q of this token's 64 heads (heads past h_q zero); only this warpgroup reads Q, and its S of
      // the previous piece is done.
      stage_rows<__nv_bfloat16, D, kBlockM, 128>(
          [&](int r) -> const __nv_bfloat16* {
            const int h = row_base + r;
            return h < p.h_q ? q + i * p.q_stride_b + s * p.q_stride_s + h * p.q_stride_h : nullptr;
          },
          q_vec, sm.q[0], wtid);
      named_sync(kBarWg0, 128);
    }

    for (int j = 0; j < n_blocks; ++j, ++count) {
      const int buf = count & 1;
      mbar_wait(&sm.full[buf], (count / 2) & 1);
      if constexpr (kDiag == 1) {
        // timing aid: the buffer goes straight back
      } else if constexpr (kWg == 0) {
        // ---- S = Q K^T, masked; m, P, l -------------------------------------------------------
        float sc[32];
        wgmma_fence();
        const uint64_t dq = smem_desc(sm.q[0], 0, 1024), dk = smem_desc(sm.k[buf][0], 0, 1024);
#pragma unroll
        for (int t = 0; t < kTiles; ++t)
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wgmma_ss_k<__nv_bfloat16>(sc, desc_offset(dq, t * kTileBytes + kk * 32),
                                      desc_offset(dk, t * kTileBytes + kk * 32), t > 0 || kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(sc);
        const uint8_t* valid = sm.valid[buf];
        float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          // The flags of keys 8 n + 2 t4 and + 1, in one load.
          const uint32_t ok2 = *reinterpret_cast<const uint16_t*>(valid + n * 8 + 2 * t4);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = e / 2;
            sc[n * 4 + e] = (ok2 >> (8 * (e % 2))) & 0xffu ? sc[n * 4 + e] * scale_log2 : -INFINITY;
            row_max[h] = fmaxf(row_max[h], sc[n * 4 + e]);
          }
        }
        float factor[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
          row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
          // Lazy rescale: most blocks leave the running max, and with it O, as they are.
          const float m_new = lazy_max(m_run[h], row_max[h]);
          factor[h] = m_new == m_run[h] ? 1.f : exp2_ftz(m_run[h] - m_new);
          m_run[h] = m_new;
        }
        exponentiate(sc, m_run, sum);
#pragma unroll
        for (int h = 0; h < 2; ++h) l_own[h] = l_own[h] * factor[h] + sum[h];
        uint32_t pa[4][4];
        pack_p<__nv_bfloat16>(sc, pa);

        // ---- O_L = O_L a + P V_L, issued first: it runs while P is handed to warpgroup 1 ---------
        if (__any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f)) scale_rows(o, factor[0], factor[1]);
        pv_rs<__nv_bfloat16>(sm.k[buf][0], pa, o);

        // ---- P and the factors for warpgroup 1, once it is done with the previous block's ------
        // (pa is only read here, which the product in flight allows.)
        if (count > 0) named_sync(kBarPFree, kConsumers);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            *reinterpret_cast<uint32_t*>(sm.p + swz(rr[e % 2], kk * 16 + (e / 2) * 8 + 2 * t4)) = pa[kk][e];
        if (t4 == 0) sm.factor[rr[0]] = factor[0], sm.factor[rr[1]] = factor[1];
        fence_proxy_async();
        named_arrive(kBarPReady, kConsumers);
        wgmma_wait<0>();
        fence_regs(o);
      } else {
        // ---- O_R = O_R a + P V_R ----------------------------------------------------------------
        named_sync(kBarPReady, kConsumers);
        const float fa = sm.factor[rr[0]], fb = sm.factor[rr[1]];
        if (__any_sync(0xffffffffu, fa != 1.f || fb != 1.f)) scale_rows(o, fa, fb);
        pv_ss<__nv_bfloat16>(sm.p, sm.k[buf][kVTilesPerWg], o);
        wgmma_wait<0>();
        fence_regs(o);
        if (int(count) + 1 < total_blocks) named_arrive(kBarPFree, kConsumers);
      }
      // This warp is done with the buffer (and its validity flags), here and, with two CTAs, in the
      // peer, whose producer fills this CTA's buffer too.
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(&sm.empty[buf]);
        if constexpr (kPeers > 1) mbar_arrive_remote(peer_empty + buf * sizeof(uint64_t));
      }
    }

    // ---- epilogue: warpgroup 0's final max and sum per head, each warpgroup its 256 columns ------
    const int pk = k & 1;
    if constexpr (kWg == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        l_own[h] += __shfl_xor_sync(0xffffffffu, l_own[h], 1);
        l_own[h] += __shfl_xor_sync(0xffffffffu, l_own[h], 2);
        if (t4 == 0) sm.m_final[pk][rr[h]] = m_run[h], sm.l_final[pk][rr[h]] = l_own[h];
      }
    }
    named_sync(kBarEpilogue, kConsumers);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // By pairs: the quad-transposed 16-byte stores (decode_io::store_row) cost these consumers,
      // at 168 registers, spills.
      const int head = row_base + rr[h];
      if (head >= p.h_q) continue;
      const float sink = p.attn_sink ? p.attn_sink[head] : -INFINITY;
      decode_io::store_row<kM64OTiles, __nv_bfloat16>(
          p.o, p.split, p.b, p.s_q, p.h_q, i, pc.is_split, pc.split_index, s, head, kWg * 256, t4,
          [&](int n) { return make_float2(o[4 * n + 2 * h], o[4 * n + 2 * h + 1]); }, sm.m_final[pk][rr[h]],
          sm.l_final[pk][rr[h]], 1.f, sink, kWg == 0 && t4 == 0);
    }
  }
}

#endif  // MLA_SM90A_DEVICE

template <KvFormat F, int kPeers>
__global__ void __launch_bounds__(kThreads, 1) sparse_decode_kernel(const __grid_constant__ SparseDecodeParams p) {
#if defined(MLA_SM90A_DEVICE)
  using Fm = SparseFormat<F>;
  constexpr int D = Fm::kD;
  using SmemT = Smem<D>;
  extern __shared__ uint8_t smem_raw[];
  // Tiles 1024-byte aligned; offsetting smem_raw keeps the accesses in the shared address space.
  SmemT& sm = *reinterpret_cast<SmemT*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));

  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128;
  const int row_base = blockIdx.x * kBlockM, s = blockIdx.y, part = blockIdx.z;
  const DecodePlanParams plan = sparse_plan_params(p);

  // full: every producer warp of this CTA arrives once per block (warp 0 expecting the peer's bytes,
  // which complete on it); empty: every consumer warp of every CTA that reads the buffer.
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) mbar_init(&sm.full[b], 4), mbar_init(&sm.empty[b], 8 * kPeers);
    fence_barrier_init();
  }
  if constexpr (kPeers > 1) cluster_sync();  // the peer's barriers exist before anything arrives on them
  else __syncthreads();
  if (p.split.plan_fresh) {
    // The call brought no plan: every CTA makes it (its own part's row and num_splits, at least the
    // entries it reads, the same values wherever two CTAs write one) before anything reads it, with its key
    // buffers as scratch, waiting for the work before it on the stream as late as it can (see
    // wait_then_plan); with a peer, neither producer stores into the other's buffers before both
    // have planned.
    static_assert(sizeof(typename BlockPlanner<kThreads>::Scratch) <= sizeof(sm.k[0]), "scratch fits a buffer");
    BlockPlanner<kThreads>::run_in(plan, part, sm.k[0], sm.k[1]);
    if constexpr (kPeers > 1) cluster_sync();
    else __syncthreads();
  } else {
    wait_for_prior_grids();
  }
  const int num_pieces = decode_io::num_pieces(p.split, p.b, part);

  if (wg == 2) {
    // ---- producer: gather, dequantise, store; the next round's records in flight ---------------
    // Alone it covers both rounds of a block; with a peer CTA (the other 64 heads of the same
    // token) each covers one round and stores it into both CTAs' buffers.
    set_max_regs_dec<kRegsProducer>();
    constexpr int kMyRounds = 2 / kPeers;
    const int rank = kPeers > 1 ? cluster_rank() : 0, peer = rank ^ 1;
    auto round_of = [&](int r) { return kPeers > 1 ? rank : r; };
    const int tq = wtid / kTokenParts, tp = wtid % kTokenParts;  // token of the round, its part
    const int warp = wtid / 32, lane = wtid % 32;
    // The peer's key buffers, validity flags and full barriers (cluster addresses). Our half of each
    // block goes there by bulk copy and st.async, completing on its full barrier: a round of tokens
    // and their flags.
    const uint32_t peer_k = kPeers > 1 ? peer_addr(&sm.k[0][0][0], peer) : 0;
    const uint32_t peer_valid = kPeers > 1 ? peer_addr(&sm.valid[0][0], peer) : 0;
    const uint32_t peer_full = kPeers > 1 ? peer_addr(&sm.full[0], peer) : 0;
    constexpr uint32_t kPeerBytes = kRoundTokens * (D * 2 + 1);
    using Part = TokenPart<F, kTokenParts>;
    const uint64_t policy = evict_first_policy();  // each record is read once a call (as sparse_decode_small.cu)
    // `ahead` is one step past `next`: its token's index is read while next's record loads.
    RoundWalk<kMyRounds> ahead{BlockWalk{num_pieces, s}};
    auto step = [&]() { return ahead.advance(p, plan, part); };
    auto locate = [&]() { return ahead.blocks.locate(p, round_of(ahead.round) * kRoundTokens + tq); };
    bool have = step();
    Part cur = have && kDiag != 2 ? load_token_part<F, kTokenParts>(p, locate(), tp, policy) : Part{};
    bool have_next = have && step();
    TokenRef ref_next = have_next ? locate() : TokenRef{};
    uint32_t count = 0;  // blocks handed over: buffer count % 2, phase (count / 2) % 2
    int r = 0;           // this producer's round of the block
    while (have) {
      const bool have_after = have_next && step();
      const TokenRef ref_after = have_after ? locate() : TokenRef{};
      Part next;  // unused past the last step
      if (have_next && kDiag != 2) next = load_token_part<F, kTokenParts>(p, ref_next, tp, policy);
      const int buf = count & 1;
      if (r == 0) mbar_wait(&sm.empty[buf], ((count / 2) & 1) ^ 1);
      const int t = round_of(r) * kRoundTokens + tq;
      const uint32_t peer_full_buf = peer_full + buf * sizeof(uint64_t);
      if constexpr (kDiag != 2) store_token_part<F, kTokenParts>(cur, sm.k[buf], t, tp);
      if constexpr (kPeers > 1 && kDiag != 2) {
        // The warp's eight rows of every tile (1 KB each, contiguous) go to the peer's buffer by bulk
        // copy once the warp's stores reach the async proxy: nine copies per warp instead of a
        // st.async per 16 bytes, which kept the producer's store queue full.
        fence_proxy_async();
        __syncwarp();
        // One lane issues the nine (their operands are uniform registers; the compiler wraps each
        // in a loop over the lanes that issue it, so one lane, one pass).
        if (lane == 0) {
          const uint32_t rows = uint32_t(round_of(r) * kRoundTokens + 8 * warp) * 128u;
#pragma unroll
          for (int tile = 0; tile < SmemT::kTiles; ++tile)
            bulk_copy_to_peer(peer_k + (buf * SmemT::kTiles + tile) * kTileBytes + rows, sm.k[buf][tile] + rows,
                              8 * 128, peer_full_buf);
        }
      }
      // The warp's eight tokens' flags (lane 4j holds token 8 warp + j), as two 4-byte words.
      const uint32_t oks = __ballot_sync(0xffffffffu, cur.ok);
      if (lane == 0 && kDiag != 2) {
        const int t0 = round_of(r) * kRoundTokens + 8 * warp;
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          uint32_t word = 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) word |= ((oks >> (4 * (4 * w + j))) & 1u) << (8 * j);
          *reinterpret_cast<uint32_t*>(&sm.valid[buf][t0 + 4 * w]) = word;
          if constexpr (kPeers > 1) st_async_4(peer_valid + (buf * kBlockN + t0 + 4 * w), word, peer_full_buf);
        }
      }
      if (r == kMyRounds - 1) {
        // Each lane's stores reach the async proxy (wgmma), then one arrival per warp; warp 0's
        // also expects the peer's bytes in this CTA's buffer (its bulk copies and flag words).
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
          if (kPeers > 1 && warp == 0 && kDiag != 2) mbar_expect_tx(&sm.full[buf], kPeerBytes);
          else mbar_arrive(&sm.full[buf]);
        }
        ++count;
      }
      cur = next;
      have = have_next;
      have_next = have_after;
      ref_next = ref_after;
      r = (r + 1) % kMyRounds;
    }
  } else if (wg == 0) {
    // ---- consumers: each warpgroup its own code, so that each is compiled with its own registers
    set_max_regs_inc<kRegsWg0>();
    consume<F, 0, kPeers>(p, sm, plan, num_pieces, row_base, s, part, wtid);
  } else {
    set_max_regs_dec<kRegsWg1>();
    consume<F, 1, kPeers>(p, sm, plan, num_pieces, row_base, s, part, wtid);
  }
  // No CTA leaves while its peer may still store into its shared memory or arrive on its barriers.
  if constexpr (kPeers > 1) {
    __syncwarp();
    cluster_sync();
  }
#endif  // MLA_SM90A_DEVICE
}

// ---- host side -------------------------------------------------------------------------------

template <KvFormat F, int kPeers>
cudaError_t launch(const SparseDecodeParams& p, cudaStream_t stream) {
  constexpr int smem = int(sizeof(Smem<SparseFormat<F>::kD>)) + 1024;  // + alignment of the tiles to 1024 bytes
  static_assert(smem <= 227 * 1024, "Q, both key buffers and P fit the 227 KB an sm90 block may use");
  const cudaError_t err =
      raise_smem_limit_once<sparse_decode_kernel<F, kPeers>>(smem, "the sm90 sparse decode kernel");
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned(ceil_div(p.h_q, kBlockM)), unsigned(p.s_q), unsigned(p.split.num_sm_parts));
  return launch_dependent(sparse_decode_kernel<F, kPeers>, grid, kThreads, smem, stream, p, dim3(kPeers, 1, 1));
}

// 65 to 128 heads: the two 64-head CTAs of a token form a cluster and share the dequantisation.
// Where the device refuses the cluster (e.g. a partition whose SMs cannot hold two such CTAs side
// by side), they run apart, and later calls on that device (64 at most) go there directly rather
// than trying the refused launch again.
template <KvFormat F>
cudaError_t launch_for_heads(const SparseDecodeParams& p, cudaStream_t stream) {
  static std::atomic<uint64_t> refused{0};
  if (ceil_div(p.h_q, kBlockM) == 2) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const uint64_t bit = uint64_t(1) << (dev & 63);
    if (!(refused.load(std::memory_order_acquire) & bit)) {
      err = launch<F, 2>(p, stream);
      if (err != cudaErrorInvalidClusterSize) return err;
      (void)cudaGetLastError();  // a refused launch configuration, not a sticky error
      refused.fetch_or(bit, std::memory_order_release);
    }
  }
  return launch<F, 1>(p, stream);
}

}  // namespace sm90_sparse

cudaError_t sm90_sparse_decode(const SparseDecodeParams& p, cudaStream_t stream) {
  // A fresh plan is made in the kernel, its part costs in a key buffer (the dispatcher sends more
  // parts than that holds to the planner kernel first).
  if (p.split.plan_fresh && p.split.num_sm_parts > kPlanMaxPartsIn64KB) return cudaErrorInvalidValue;
  const cudaError_t err = p.format == KvFormat::kV32 ? sm90_sparse::launch_for_heads<KvFormat::kV32>(p, stream)
                                                     : sm90_sparse::launch_for_heads<KvFormat::kModel1>(p, stream);
  if (err != cudaSuccess) return err;
  return combine_sparse(p, stream);
}

}  // namespace mla::cuda
