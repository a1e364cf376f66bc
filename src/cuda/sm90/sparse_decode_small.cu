// Hopper (sm_90a) sparse MLA decode over FP8 caches (V3.2: d_qk 576, 656 bytes per token; MODEL1:
// d_qk 512, 584 bytes per token, block-interleaved scales) for at most 32 heads: DeepSeek's 128
// heads under tensor parallelism 4-8, which FlashMLA pads to 64. Every feature of the op: the
// attention sink, topk_length, an extra cache with its own page size, extra_topk_length; indices
// outside the cache are invalid and never read.
//
// Schedule (384 threads, one CTA per (query token s, plan part), persistent over the part's
// pieces; one CTA per SM):
//   * warpgroups 1 and 2 produce, each half of every 64-slot block, two blocks ahead at N = 16
//     (setmaxnreg 176, three register slots of V3.2 records, two of MODEL1's, which skip L1) and
//     one at N = 32 (136, two slots): four threads per token gather the FP8 record with 16-byte
//     loads (two 8-byte ones for a MODEL1 record in a page block that is only 8-byte aligned),
//     evict-first in L2, dequantise it to bf16 (exactly as the reference: e4m3 * scale rounded to
//     bf16; RoPE copied) and store it into a 64 x D key buffer in the 128-byte swizzle, with a
//     validity flag per token; two buffers handed over with full / empty mbarriers;
//   * warpgroup 0 (setmaxnreg 152 at N = 16, 232 at N = 32) consumes, with the heads as wgmma's N
//     (16 or 32; no padding to 64): S^T (64 tokens x N heads) = K Q^T, masked by the validity
//     flags; the softmax down the columns of S^T (lanes sharing a head, then the four warps through
//     shared memory); P (N x 64) to shared memory (at d_qk 576 into the block's RoPE tile, which
//     S^T alone reads); O^T (512 x N) += V^T P^T with V read transposed from the buffer, left in
//     flight while the next block's S^T is issued behind it (the buffer goes back once it lands);
//   * epilogue: O^T / (l + exp2(sink - m)) to out / lse for whole pieces, fp32 partials for split
//     ones (the combine kernel applies the sink); at N = 16, a call planning for itself into the
//     even split of two pieces a request runs in clusters of two, whose CTAs merge the two partials
//     through distributed shared memory (merge_pair) with no combine after;
//   * with a fresh plan every CTA first plans its own part (plan_block.cuh; no planner kernel).
// Tile sizes: 64-token blocks, N = 16 or 32 heads, two bf16 key buffers (144 KB at d_qk 576) + Q;
// shared memory kept small, since what it leaves of 256 KB is the L1 the producers' loads land in.
//
// Reached (bench/RESULTS.md; whole API calls with fresh plans beside FlashMLA padded to 64 heads,
// in one run): H200, forty-fifth session: V3.2 b=128 h_q=16 topk 2048 76.7-76.9 us (1.94x), b=64
// h_q=32 60.7 (1.74x), MODEL1 b=128 h_q=16 mixed with sink 39.5 (2.67x). H100, fifty-first
// session (these kernels): V3.2 b=128 h_q=16 79.1-79.2 us (1.99x), b=66 h_q=16 50.3 (2.38-2.39x),
// b=64 h_q=32 57.1-57.7 (1.94-1.95x); MODEL1 h_q=16 40.0-41.1 (2.67-2.72x, forty-sixth).
// Where the time goes (H200, fortieth session, topk sweeps): a block per SM costs 2.04 us at N = 16
// and 2.49 at N = 32; the producers alone take 1.49 at both (87% of the copy ceiling), the consumer
// alone 1.36 and 1.69: the two share the SM's shared-memory and L1 data path (about 317 KB a block:
// records in, bf16 keys out, both products' operands; a m64n16k16 from shared memory takes 21.3
// cycles, bound by reading its operands, bench/wgmma_rate.cu). The records of b=128 topk 2048 alone
// gather in 48.8 us at best on the H200 and 69.3 on the H100 (bench/gather_ceiling.cu): on the H100
// above the 61.4 us that 2.5x FlashMLA padded would be.
// The largest steps (H200, h_q=16 unless said): per-thread store offsets, the index a block ahead
// and lengths once per request (183.5 -> 155.8 us); a second producer warpgroup (-> 124.8); the
// planner in the kernel; three register slots (92.6 -> 87.6); shared memory under 164 KB (79.5 ->
// 76.5); O^T in flight behind the next S^T (76.8 -> 75.2); records evict-first in L2 (H100, 94.0 ->
// 87.7); the V3.2 plan in closed form; the even split of uniform requests.
// Measured slower and dropped (the runs are in bench/RESULTS.md): whole records staged by
// cp.async.bulk; three key buffers with S^T(j+1) before O^T(j); S^T's RoPE part from registers;
// V3.2 records skipping L1; the keys dequantised into both products' register operands
// (sparse_decode_frag.cu, 76 -> 110 us); the dequantisation in bf16x2; e4m3 products (also outside
// SPEC §8); a vote on whether a block moves any head's max; per-slot next tokens; the next piece's
// Q by cp.async; the next slot's records prefetched into L2; S^T(j) ahead of O^T(j - 1) with two
// buffers; key buffers handed back in two halves; records located or loaded at other points of the
// producers' loop; the cluster merge at 32 heads (see launch); its exchange as one bulk copy (no
// faster); a merge by whichever CTA finishes a request last (H100, b=64 h_q=32: 57 -> 72 us); the
// epilogue staged through shared memory (H100, b=128 h_q=16: 78 -> 81 us).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/decode_io.cuh"
#include "../common/plan_block.cuh"
#include "../common/smem_limit.h"
#include "../implementations.h"
#include "mla/sparse_slots.h"
#include "common.cuh"
#include "ptx_sm90.cuh"
#include "small_n.cuh"
#include "sparse_tokens.cuh"

namespace mla::cuda {

namespace sm90_sparse_small {

using namespace sm90;
// Timing aid, never for results (as in sparse_decode.cu): MLA_SPARSE_DIAG=1 makes the consumer skip
// its products (the producers alone), 2 makes the producers skip their loads and stores.
#ifndef MLA_SPARSE_DIAG
#define MLA_SPARSE_DIAG 0
#endif
constexpr int kDiag = MLA_SPARSE_DIAG;

constexpr int kProducerWgs = 2;                    // warpgroups 1 and 2 produce, each half of every block
constexpr int kThreads = 128 * (1 + kProducerWgs);  // warpgroup 0 consumes
constexpr int kBlockN = 64;    // tokens per block = plan block = wgmma M of S^T
constexpr int kTileBytes = kBlockN * 128;
[[maybe_unused]] constexpr int kVTiles = 8;  // d_v 512
static_assert(kBlockN == kPlanBlockSize, "one token block per plan block");
constexpr int kTokenParts = kProducerWgs * 128 / kBlockN;
static_assert(kTokenParts == 4, "four producer threads per token");
// Registers per thread after setmaxnreg: the CTA starts with 168 (64 K / 384) and the three
// warpgroups' counts must sum to at most 3 x 168. At N = 16 the consumer needs far fewer (O^T is 64
// per thread), and the producers hold one more block's records (kSlots register sets).
template <int N>
struct Regs {
  static constexpr int kConsumer = N <= 16 ? 152 : 232, kProducer = N <= 16 ? 176 : 136;
  // Records held: the block being stored, the rest in flight. MODEL1's records skip L1 (see
  // load_next) and take two slots: three measured slower (H200, b=128 h_q=16, plan reused 36.5-36.8
  // against 35.7-36.1 us).
  static constexpr int slots(KvFormat f) { return N <= 16 && f != KvFormat::kModel1 ? 3 : 2; }
  static constexpr int kLaunch = (65536 / kThreads) / 8 * 8;  // 168: raised with inc, lowered with dec
  static_assert(kConsumer + kProducerWgs * kProducer <= 3 * kLaunch, "moved, never added");
};

template <int D, int N>
struct Smem {
  static constexpr int kTiles = D / 64;
  uint8_t k[2][kTiles][kTileBytes];  // dequantised tokens [token][dim], bf16, swizzled
  uint8_t q[kTiles][N * 128];
  // P [head][token]. At D = 576 it lives in the RoPE tile of the block's buffer, which only S^T
  // reads (done when P is written; the buffer goes back after O^T): with the alignment slack gone
  // (below), 3 KB less shared memory puts N = 16 under 164 KB, leaving the L1 cache the producers'
  // record loads land in 92 KB, not 60. At N = 32, Q twice the size puts both formats (181.2 KB at
  // d_qk 576, 165.2 KB at 512, plus the 1 KB reserve) in the 196 KB carveout: 60 KB of L1.
  static constexpr bool kPInRope = D == 576;
  uint8_t p_own[kPInRope ? 16 : N * 128];
  float warp_max[4][N];
  float warp_sum[4][N];
  uint8_t valid[2][kBlockN];
  uint64_t full[2], empty[2];
  uint64_t merge_free, merge_sent;  // merge_pair: the peer's buffers free, its partial here
  __device__ uint8_t* p(int buf) { return kPInRope ? k[buf][kTiles - 1] : p_own; }
};

// What merge_pair sends each thread of the peer, in 16-byte words: four of the eight dim tiles of
// its partial (N / 2 values a tile), then its columns' lse.
template <int N>
constexpr int kMergeWords = kVTiles / 2 * (N / 2) / 4 + N / 8 / 2;

#if defined(MLA_SM90A_DEVICE)
// The even split's two pieces of a request (plan_uniform_choice: part j runs piece j % 2 of request
// j / 2), run by the two CTAs of a cluster (rank = piece), merged through distributed shared memory
// instead of by the combine kernel. Rank r finishes dim tiles [4 r, 4 r + 4) of the output: it sends
// the peer the other four tiles of its partial (O^T / l, the values the workspace would hold) and
// its columns' lse, by st.async into the peer's `inbox` (its first key buffer, free once the peer's
// last O^T has landed: merge_free), then merges what it receives with the combine kernel's
// arithmetic on the same values, in the same order: out and lse are bitwise the combine's.
// Every consumer thread calls it once its last O^T has landed and the column sums are published.
template <int N>
__device__ __forceinline__ void merge_pair(const SparseDecodeParams& p, uint8_t* inbox, uint64_t* merge_free,
                                           uint64_t* merge_sent, const float (&o)[kVTiles][N / 2],
                                           const float (&m_run)[N / 8][2], const float (*warp_sum)[N], int req, int s,
                                           int wtid) {
  constexpr int kNT = N / 8, kHalf = kVTiles / 2, kTileWords = N / 8;
  const int warp = wtid / 32, g = (wtid % 32) / 4, t4 = wtid % 4, key_lo = warp * 16 + g;
  const int rank = cluster_rank();
  float inv[kNT][2], lse[kNT][2];
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = 8 * n + 2 * t4 + e;
      const float l = warp_sum[0][h] + warp_sum[1][h] + warp_sum[2][h] + warp_sum[3][h];
      inv[n][e] = l > 0.f ? 1.f / l : 0.f;
      lse[n][e] = l > 0.f ? log2f(l) + m_run[n][e] : -INFINITY;
    }
  // Element j of a tile is column (j / 4, j % 2); rank 0 sends tiles 4..7, rank 1 tiles 0..3.
  auto sent = [&](int q, int j) { return (rank == 0 ? o[kHalf + q][j] : o[q][j]) * inv[j / 4][j % 2]; };
  auto kept = [&](int q, int j) { return (rank == 0 ? o[q][j] : o[kHalf + q][j]) * inv[j / 4][j % 2]; };

  mbar_arrive_remote(peer_addr(merge_free, rank ^ 1));  // this CTA's buffers are read no more
  mbar_wait(merge_free, 0);                             // nor the peer's
  const uint32_t to = peer_addr(inbox, rank ^ 1) + wtid * 16, bar = peer_addr(merge_sent, rank ^ 1);
#pragma unroll
  for (int q = 0; q < kHalf; ++q)
#pragma unroll
    for (int w = 0; w < kTileWords; ++w)
      st_async_16(to + (q * kTileWords + w) * 128 * 16,
                  make_float4(sent(q, 4 * w), sent(q, 4 * w + 1), sent(q, 4 * w + 2), sent(q, 4 * w + 3)), bar);
#pragma unroll
  for (int n = 0; n < kNT; n += 2)
    st_async_16(to + (kHalf * kTileWords + n / 2) * 128 * 16, make_float4(lse[n][0], lse[n][1], lse[n + 1][0], lse[n + 1][1]),
                bar);
  mbar_wait(merge_sent, 0);

  const float4* in = reinterpret_cast<const float4*>(inbox) + wtid;
  float w0[kNT][2], w1[kNT][2];
#pragma unroll
  for (int n = 0; n < kNT; n += 2) {
    const float4 peer = in[(kHalf * kTileWords + n / 2) * 128];
    const float other[2][2] = {{peer.x, peer.y}, {peer.z, peer.w}};
#pragma unroll
    for (int d = 0; d < 2; ++d)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int h = 8 * (n + d) + 2 * t4 + e;
        const float l0 = rank == 0 ? lse[n + d][e] : other[d][e], l1 = rank == 0 ? other[d][e] : lse[n + d][e];
        float m = fmaxf(l0, l1);
        if (m == -INFINITY) m = 0.f;
        const float sum = exp2f(l0 - m) + exp2f(l1 - m);
        float gl = sum == 0.f ? INFINITY : log2f(sum) + m;
        if (rank == 0 && warp == 0 && g == 0 && h < p.h_q)
          p.o.lse[req * p.o.lse_stride_b + s * p.o.lse_stride_s + h * p.o.lse_stride_h] = gl * kLn2;
        const float sink2 = p.attn_sink ? p.attn_sink[h < p.h_q ? h : 0] * kLog2e : -INFINITY;
        gl = decode_io::fold_sink(gl, sink2);
        w0[n + d][e] = exp2f(l0 - gl);
        w1[n + d][e] = exp2f(l1 - gl);
      }
  }
  auto* out = static_cast<__nv_bfloat16*>(p.o.out) + req * p.o.out_stride_b + s * p.o.out_stride_s;
#pragma unroll
  for (int q = 0; q < kHalf; ++q)
#pragma unroll
    for (int w = 0; w < kTileWords; ++w) {
      const float4 peer = in[(q * kTileWords + w) * 128];
      const float got[4] = {peer.x, peer.y, peer.z, peer.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = 4 * w + c, n = j / 4, e = j % 2, h = 8 * n + 2 * t4 + e;
        if (h >= p.h_q) continue;
        const float v0 = rank == 0 ? kept(q, j) : got[c], v1 = rank == 0 ? got[c] : kept(q, j);
        float acc = 0.f;
        if (w0[n][e] != 0.f) acc += w0[n][e] * v0;
        if (w1[n][e] != 0.f) acc += w1[n][e] * v1;
        out[h * p.o.out_stride_h + (rank * kHalf + q) * 64 + key_lo + 8 * (j % 4 / 2)] = __float2bfloat16_rn(acc);
      }
    }
}
#endif  // MLA_SM90A_DEVICE

// kMerge: launched in clusters of two over an even split of two pieces a request, which merge_pair
// merges (no combine follows; N = 16 only, see launch()).
template <KvFormat F, int N, bool kMerge>
__global__ void __launch_bounds__(kThreads, 1) sparse_decode_small_kernel(const __grid_constant__ SparseDecodeParams p) {
#if defined(MLA_SM90A_DEVICE)
  using Fm = SparseFormat<F>;
  constexpr int D = Fm::kD;
  using SmemT = Smem<D, N>;
  constexpr int kTiles = SmemT::kTiles;
  constexpr int kNT = N / 8;
  // The window is declared 1024-byte aligned (the tiles' swizzle needs it), so no slack is asked
  // for: every byte counts against the L1 cache here (see Smem). The kernel has no static shared
  // memory, so the window starts right after the 1 KB the block reserves; static shared memory
  // added here would be padded to 1 KB, which the 164 KB static_assert below does not count.
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  SmemT& sm = *reinterpret_cast<SmemT*>(smem_raw);

  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128;
  const int warp = (wtid / 32), lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int s = blockIdx.y, part = blockIdx.z;
  const DecodePlanParams plan = sparse_plan_params(p);

  if (tid == 0) {
    // The alignment the swizzled tiles rely on (see above): a broken assumption stops the kernel
    // instead of producing wrong scores.
    if (smem_addr(smem_raw) & 1023u) __trap();
    for (int b = 0; b < 2; ++b) mbar_init(&sm.full[b], kProducerWgs * 128), mbar_init(&sm.empty[b], 128);
    if constexpr (kMerge) {
      mbar_init(&sm.merge_free, 128);  // the peer's consumer threads
      mbar_init(&sm.merge_sent, 1);
      mbar_expect_tx(&sm.merge_sent, 128 * 16 * kMergeWords<N>);  // completes once the peer's bytes land
    }
    fence_barrier_init();
  }
  if constexpr (kMerge) cluster_sync();  // the peer's barriers exist before anything arrives on them
  else __syncthreads();
  wait_then_plan<kThreads>(p.split, plan, part, sm.k[0], sm.k[1]);

  const int num_pieces = decode_io::num_pieces(p.split, p.b, part);
  uint32_t block_count = 0;  // blocks this CTA has handed over so far: buffer count % 2, phase (count / 2) % 2

  if (wg >= 1) {
    // ---- producers: gather, dequantise, store, kSlots - 1 blocks ahead -------------------------
    // Each of the two warpgroups takes half of every block's tokens, four threads per token (two
    // producer warps per scheduler hide each other's conversion and load latencies). The records
    // of the next kSlots - 1 blocks are in flight in registers while a block is dequantised and
    // stored (ncu at one block ahead: half the producers' samples waited on the records at their
    // first use, the memory latency longer than a block's work).
    if constexpr (Regs<N>::kProducer > Regs<N>::kLaunch) set_max_regs_inc<Regs<N>::kProducer>();
    else set_max_regs_dec<Regs<N>::kProducer>();
    const int t = (wg - 1) * (kBlockN / kProducerWgs) + wtid / kTokenParts, tp = wtid % kTokenParts;
    using Part = TokenPart<F, kTokenParts>;
    constexpr int kSlots = Regs<N>::slots(F);
    RoundWalk<1> ahead{BlockWalk{num_pieces, s}};
    auto step = [&]() { return ahead.advance(p, plan, part); };
    auto locate = [&]() { return ahead.blocks.locate(p, t); };
    // The first kSlots blocks' records are loaded before any is stored; then each block, once
    // stored, hands its register slot to the block kSlots later. Every slot is a distinct variable
    // (the loop below is unrolled by hand), so no record moves between registers (a move would
    // wait for its loads). A block's token is located (its index read) one load earlier.
    bool have_ref = step();
    TokenRef ref = have_ref ? locate() : TokenRef{};
    int pending = 0;  // slots holding a loaded block, in store order from the next one
    // Each record is read once a call: evict first, so that the records do not push out of L2 what
    // is read again (the next call's indices, Q and code, the in-kernel planner's code). H100, whole
    // calls: V3.2 h_q=16 94.0 -> 87.7 us, h_q=32 73.3 -> 66.0.
    const uint64_t policy = evict_first_policy();
    auto load_next = [&](Part& slot) {
      if (!have_ref) return;
      // MODEL1's records skip L1 allocation (measured 37.5 -> 36.5 us at h_q 16); V3.2's do not: its
      // producers' loads in flight are held by L1, and bypassing it cost 80.8 -> 92 us.
      if constexpr (kDiag != 2) slot = load_token_part<F, kTokenParts, F == KvFormat::kModel1>(p, ref, tp, policy);
      ++pending;
      have_ref = step();
      if (have_ref) ref = locate();
    };
    auto store = [&](Part& slot) {  // stores the oldest loaded block and refills its slot
      if (pending == 0) return false;
      const int buf = block_count & 1;
      mbar_wait(&sm.empty[buf], ((block_count / 2) & 1) ^ 1);
      if constexpr (kDiag != 2) {
        store_token_part<F, kTokenParts>(slot, sm.k[buf], t, tp);
        if (tp == 0) sm.valid[buf][t] = slot.ok;
      }
      fence_proxy_async();
      mbar_arrive(&sm.full[buf]);
      ++block_count;
      --pending;
      // Refilled only now: loads issued ahead of the proxy fence made the call slower (H100, h_q=16:
      // 82.2 -> 85.2 us; ptxas sinks them to just before the fence anyway).
      load_next(slot);
      return true;
    };
    Part s0, s1, s2;
    load_next(s0);
    load_next(s1);
    if constexpr (kSlots == 3) {
      load_next(s2);
      while (store(s0) && store(s1) && store(s2)) {
      }
    } else {
      while (store(s0) && store(s1)) {
      }
    }
  } else {
    // ---- consumer: S^T, softmax, O^T -----------------------------------------------------------
    if constexpr (Regs<N>::kConsumer > Regs<N>::kLaunch) set_max_regs_inc<Regs<N>::kConsumer>();
    else set_max_regs_dec<Regs<N>::kConsumer>();
    const float scale_log2 = p.softmax_scale * kLog2e;
    const int key_lo = warp * 16 + g;
    const auto* q = reinterpret_cast<const __nv_bfloat16*>(p.q);
    const bool q_vec = rows_16b_aligned(q, p.q_stride_b, p.q_stride_s, p.q_stride_h);
    // The combine launches once every CTA has reached its last piece (as the dense 64-row kernel's
    // does, dense_decode.cu): its CTAs are resident when this kernel ends. Only at s_q = 1 with at least
    // half as many requests as parts (about three pieces a request at most): a few long requests
    // have few combine CTAs with many splits each, which launched early pile onto the SMs that
    // finish first. H100, plan reused: b=128 h_q=16 81.4 / 81.1 -> 79.2 / 79.2 us; b=64 h_q=32
    // (2 b < 132 parts) level with it, 57.0 / 57.6 against 57.2 / 57.7.
    const bool release_early = p.s_q == 1 && 2 * p.b >= p.split.num_sm_parts;
    for (int k = 0; k < num_pieces; ++k) {
      const PlanPiece pc = decode_io::piece(p.split, plan, part, k);
      const int i = __shfl_sync(0xffffffffu, pc.req, 0);
      const int block_begin = __shfl_sync(0xffffffffu, pc.block_begin, 0);
      const int block_end = __shfl_sync(0xffffffffu, pc.block_end, 0);
      if (release_early && k + 1 == num_pieces) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

      // Q of this query token -> shared memory (N heads; heads past h_q zero).
      named_sync(1, 128);  // the previous piece is done with Q
      stage_rows<__nv_bfloat16, D, N, 128>(
          [&](int h) -> const __nv_bfloat16* {
            return h < p.h_q ? q + i * p.q_stride_b + s * p.q_stride_s + h * p.q_stride_h : nullptr;
          },
          q_vec, sm.q[0], wtid);
      named_sync(1, 128);

      float m_run[kNT][2], l_part[kNT][2], o[kVTiles][N / 2];
      small_start<N>(m_run, l_part, o);

      // O^T of block j stays in flight while block j + 1's S^T is issued behind it: the tensor
      // cores go from one to the other without draining, and the wait for the next full buffer
      // overlaps O^T. Block j's buffer goes back once its O^T is done (the older group).
      bool pv_in_flight = false;
      for (int blk = block_begin; blk < block_end; ++blk, ++block_count) {
        const int buf = block_count & 1;
        mbar_wait(&sm.full[buf], (block_count / 2) & 1);
        if constexpr (kDiag == 1) {  // timing aid: the buffer goes straight back
          mbar_arrive(&sm.empty[buf]);
          continue;
        }

        float sc[N / 2];
        small_qk<__nv_bfloat16, N, kTiles, false>([&](int t) { return sm.k[buf][t]; }, sm.q, sc);
        if (pv_in_flight) {
          wgmma_wait<1>();  // the previous block's O^T
#pragma unroll
          for (int mt = 0; mt < kVTiles; ++mt) fence_regs(o[mt]);
          mbar_arrive(&sm.empty[buf ^ 1]);
        }
        wgmma_wait<0>();
        fence_regs(sc);
        const uint8_t* valid = sm.valid[buf];
        small_mask_max<N>(sc, scale_log2, false, [&](int key, int) { return valid[key] != 0; }, sm.warp_max, warp,
                          lane);
        named_sync(1, 128);  // every warp has its S^T: warp_max complete, and at d_qk 576 no S^T
        // still reads the RoPE tile that P is written into next
        small_softmax<__nv_bfloat16, N>(sc, sm.warp_max, m_run, l_part, o, sm.p(buf), warp, lane);
        named_sync(1, 128);  // P complete; every thread has read warp_max
        small_pv<__nv_bfloat16, N, false>([&](int t) { return sm.k[buf][t]; }, sm.p(buf), o);
        pv_in_flight = true;
      }
      wgmma_wait<0>();  // the piece's last O^T; its buffer (and validity flags) go back
#pragma unroll
      for (int mt = 0; mt < kVTiles; ++mt) fence_regs(o[mt]);
      if (pv_in_flight) mbar_arrive(&sm.empty[(block_count - 1) & 1]);

      // ---- epilogue ----------------------------------------------------------------------------
      small_row_sums<N>(l_part, sm.warp_sum, warp, lane);
      named_sync(1, 128);
      if constexpr (kMerge) {
        merge_pair<N>(p, sm.k[0][0], &sm.merge_free, &sm.merge_sent, o, m_run, sm.warp_sum, i, s, wtid);
      } else {
#pragma unroll
        for (int n = 0; n < kNT; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int h = 8 * n + 2 * t4 + e;
            if (h >= p.h_q) continue;
            const float l = sm.warp_sum[0][h] + sm.warp_sum[1][h] + sm.warp_sum[2][h] + sm.warp_sum[3][h];
            const float m = m_run[n][e];
            const float sink = p.attn_sink ? p.attn_sink[h] : -INFINITY;
            small_store_column<__nv_bfloat16, N>(p.o, p.split, p.b, p.s_q, p.h_q, i, pc.is_split, pc.split_index, s,
                                                 h, o, n, e, key_lo, m, l, sink, warp == 0 && g == 0);
          }
      }
    }
  }
#endif  // MLA_SM90A_DEVICE
}

// Launches the kernel for this call; `merged`: in clusters of two that merge the pieces themselves
// (merge_pair), where the call plans for itself into the even split of two pieces a request (`fresh`:
// its shape alone says so), and every cluster of the grid is resident at once
// (the pair of a request waits for its peer). Else the combine follows (combine_sparse).
template <KvFormat F, int N>
cudaError_t launch(const SparseDecodeParams& p, cudaStream_t stream, const PlanUniformChoice& fresh, bool& merged) {
  constexpr int smem = int(sizeof(Smem<SparseFormat<F>::kD, N>));
  static_assert(smem <= 227 * 1024, "both key buffers, Q and P fit the 227 KB an sm90 block may use");
  // With the 1 KB every block reserves, V3.2 at N = 16 must stay within the 164 KB carveout: the
  // next one (196 KB) leaves the producers' loads 60 KB of L1 instead of 92 (76.5 -> 79.5 us).
  static_assert(F != KvFormat::kV32 || N != 16 || smem + 1024 <= 164 * 1024, "V3.2 N = 16 fits 164 KB");
  static_assert(128 * 16 * kMergeWords<N> <= sizeof(Smem<SparseFormat<F>::kD, N>::k[0]), "the peer's partial fits a key buffer");
  const dim3 grid(1, unsigned(p.s_q), unsigned(p.split.num_sm_parts)), pair(1, 1, 2);
  merged = false;
  // At 16 heads only: at 32 the merge measured slower than the combine (H100, whole calls, V3.2
  // topk 2048, b=64 h_q=32: 56.9 -> 58.0 us), at 16 faster (b=66 h_q=16: 52.9 -> 51.4).
  if constexpr (N == 16) {
    if (fresh.even_k == 2 && p.split.num_sm_parts % 2 == 0 && cluster_merge()) {
      constexpr auto kernel = sparse_decode_small_kernel<F, N, true>;
      const cudaError_t err = raise_smem_limit_once<kernel>(smem, "the sm90 small-heads sparse kernel");
      if (err != cudaSuccess) return err;
      if (clusters_resident<kernel>(kThreads, smem, pair) >= p.s_q * (p.split.num_sm_parts / 2)) {
        merged = true;
        return launch_dependent(kernel, grid, kThreads, smem, stream, p, pair);
      }
    }
  }
  constexpr auto kernel = sparse_decode_small_kernel<F, N, false>;
  const cudaError_t err = raise_smem_limit_once<kernel>(smem, "the sm90 small-heads sparse kernel");
  if (err != cudaSuccess) return err;
  return launch_dependent(kernel, grid, kThreads, smem, stream, p);
}

}  // namespace sm90_sparse_small

cudaError_t sm90_sparse_decode_small(const SparseDecodeParams& p, cudaStream_t stream) {
  // A fresh plan is made in the kernel, its part costs in a key buffer (the dispatcher sends more
  // parts than that holds to the planner kernel first).
  if (p.split.plan_fresh && p.split.num_sm_parts > kPlanMaxPartsIn64KB) return cudaErrorInvalidValue;
  if (p.h_q > 32) return cudaErrorInvalidValue;  // the dispatch never sends more (kFeatHeadsOver32)
  using namespace sm90_sparse_small;
  const PlanUniformChoice fresh = fresh_uniform_choice(p);  // asked once: the merge and the combine
  cudaError_t err;
  bool merged = false;
  if (p.format == KvFormat::kV32)
    err = p.h_q <= 16 ? launch<KvFormat::kV32, 16>(p, stream, fresh, merged)
                      : launch<KvFormat::kV32, 32>(p, stream, fresh, merged);
  else
    err = p.h_q <= 16 ? launch<KvFormat::kModel1, 16>(p, stream, fresh, merged)
                      : launch<KvFormat::kModel1, 32>(p, stream, fresh, merged);
  if (err != cudaSuccess || merged) return err;
  return combine_sparse(p, stream, fresh);
}

}  // namespace mla::cuda
