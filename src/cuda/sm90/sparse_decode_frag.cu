// Hopper (sm_90a) sparse MLA decode over the V3.2 FP8 cache (d_qk 576, 656 bytes per token) for at
// most 16 heads, with the keys dequantised straight into the consumers' wgmma operand registers:
// the FP8 records cross shared memory once, and no bf16 copy of a block is ever stored or re-read.
// Every feature of the op: the attention sink, topk_length, an extra cache with its own page size,
// extra_topk_length; indices outside their cache are invalid and never read.
//
// Schedule (384 threads, one CTA per (query token s, plan part), persistent over the part's
// pieces; one CTA per SM):
//   * warpgroup 2 produces: eight threads per token copy each 64-slot block's records verbatim into a stage (cp.async, 16 bytes each, four stages, completing on the
//     stage's full mbarrier), a validity flag per token; the tokens' indices are read two blocks
//     ahead. It also stages each piece's Q (two buffers), its dims in the order the consumers'
//     key fragments take them;
//   * warpgroups 0 and 1 consume alternate blocks, each with its own running
//     max, sums and O^T, merged at the end of each piece through the piece's Q buffer:
//       S^T (64 tokens x 16 heads) = K Q^T as 36 wgmma m64n16k16 with K from registers: a thread
//       loads 16 bytes of each of its two tokens per 64 dims and dequantises them (e4m3 * scale
//       rounded to bf16, exactly as the reference) into four k-steps of A (Q's dims permuted to
//       match); the softmax down the columns of S^T; P [head][token] to shared memory;
//       O^T (512 dims x 16) += V^T P^T as 32 wgmma with V^T from registers: a thread takes 16 dims
//       (one 16-byte chunk) of each of 16 tokens and pairs tokens with byte permutes; the stage
//       goes back once the last of these loads is issued;
//   * epilogue: each consumer warpgroup writes half of the dims, out / lse with the sink for whole
//     pieces, fp32 partials for split ones (the combine kernel applies the sink);
//   * with a fresh plan every CTA first plans its own part (plan_block.cuh).
// Tile sizes: 64-token blocks, N = 16 heads, four 41 KB record stages, two 18 KB Q buffers.
// Measured on an H200 (bench/RESULTS.md, twenty-fifth session), correct on the card and slower than
// the small-heads kernel (sparse_decode_small.cu): V3.2 b=128 h_q=16 topk 2048, plan reused,
// 109.5-111.6 us against 75.0-76.3, whole calls 100.7 against 83.9. Alone (MLA_FRAG_DIAG) the
// consumers take 78.6 us and the producer 62.3: every element is dequantised twice (for K and
// for V) by the consumers, 75 k instructions a scheduler issued every other cycle (ncu: under one
// eligible warp of their two per scheduler), and the cp.async gather is slower than the
// small-heads kernel's register loads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/decode_io.cuh"
#include "../common/plan_block.cuh"
#include "../common/ptx.cuh"
#include "../common/smem_limit.h"
#include "../implementations.h"
#include "mla/sparse_slots.h"
#include "common.cuh"
#include "ptx_sm90.cuh"
#include "small_n.cuh"
#include "sparse_tokens.cuh"

namespace mla::cuda {

namespace sm90_sparse_frag {

using namespace sm90;
using Fm = SparseFormat<KvFormat::kV32>;
// Timing aid, never for results (as MLA_SPARSE_DIAG in the other sparse kernels): 1 makes the
// consumers hand every stage straight back (the producer alone), 2 makes the producer copy nothing.
#ifndef MLA_FRAG_DIAG
#define MLA_FRAG_DIAG 0
#endif
constexpr int kDiag = MLA_FRAG_DIAG;

constexpr int N = 16;        // heads: wgmma's N
constexpr int kBlockN = 64;  // tokens per block = plan block = wgmma M of S^T
static_assert(kBlockN == kPlanBlockSize, "one token block per plan block");
constexpr int kRecordBytes = Fm::kRecordBytes;  // 656: 512 e4m3, 4 float scales, 64 bf16 RoPE dims
constexpr int kScalesOffset = Fm::kNope, kRopeOffset = Fm::kRopeOffset;
constexpr int kChunks = kRecordBytes / 16;
constexpr int kStageBytes = kBlockN * kRecordBytes;
constexpr int kStages = 4;
constexpr int kQTiles = Fm::kD / 64;  // 9: eight NoPE tiles and the RoPE tile
constexpr int kQTileBytes = N * 128;
constexpr int kConsumerWgs = 2;
// Two consumer warpgroups and one producer warpgroup at 168 registers a thread (no setmaxnreg): a
// consumer's O^T (64), its A fragments in flight (two sets of 16) and the loads feeding them fit,
// and each block's O^T products are done before the next block's S^T starts. Left in flight
// behind it (with setmaxnreg 208 / 88 for the registers), ptxas serialised every wgmma: it does not
// see them retired by S^T's own waits.
constexpr int kProducerThreads = 128;
constexpr int kThreads = 128 * kConsumerWgs + kProducerThreads;
static_assert(kStageBytes % 1024 == 0, "the stages keep the Q and P tiles after them 1024-byte aligned");
// Records sit 41 16-byte units apart, so record r's unit u falls in bank group (r + u) % 8: the
// fragment loads below are conflict-free because of it (see token_of_row and pv).
static_assert(kChunks % 8 == 1, "record stride of 1 mod 8 bank groups");
constexpr int kTokenThreads = 8;  // producer threads per token: each load instruction reads 4 whole records' lines
constexpr int kTokensPerRound = kProducerThreads / kTokenThreads;  // 4
constexpr int kRounds = kBlockN / kTokensPerRound;                 // 16 tokens per producer thread and block
constexpr int kChunksPerThread = (kChunks + kTokenThreads - 1) / kTokenThreads;

struct Smem {
  uint8_t stage[kStages][kStageBytes];  // records as in the cache: token t at t * 656
  uint8_t q[2][kQTiles][kQTileBytes];   // Q [head][dim] per 64-dim tile, 128-byte swizzle, dims permuted
  uint8_t p[kConsumerWgs][N * 128];     // P [head][token], 128-byte swizzle
  float warp_max[kConsumerWgs][4][N];
  float warp_sum[kConsumerWgs][4][N];
  float m_merge[kConsumerWgs][N];       // each warpgroup's running max at the end of a piece
  uint8_t valid[kStages][kBlockN];
  uint64_t full[kStages], empty[kStages], qfull[2], qempty[2];
};
// The merge passes one warpgroup's partial sums and half of its O^T (32 + 4 floats per thread).
static_assert((kSmallVTiles / 2 * N / 2 + N / 4) * 128 * 4 <= kQTileBytes * kQTiles, "the merge fits a Q buffer");

// S^T's row r holds token token_of_row(r): the lanes g = 2j and 2j + 1 of a warp (rows 16 w + g)
// take tokens four apart, so the eight lanes of a load phase (two rows, t4 = 0..3) cover all eight
// bank groups with their 16-byte loads at 64 a + 16 t4.
__device__ __forceinline__ int token_of_row(int r) { return (r & 0x38) | ((r & 1) << 2) | ((r >> 1) & 3); }

// Q's dims in a tile, by 4-byte word (two dims): the consumers' A fragment of k-step b holds, in
// thread t4, the dims 16 t4 + 4 b .. + 3 of a NoPE tile (one e4m3 word of its 16-byte load), and
// dims 8 (t4 + 4 (b / 2)) + 4 (b % 2) .. + 3 of the RoPE tile (two bf16 words of its two loads).
// The word of Q at dims (2 pw, 2 pw + 1) of a tile goes to word q_word(pw) of its row.
__host__ __device__ constexpr int q_word_nope(int pw) { return 8 * ((pw >> 1) & 3) + 4 * (pw & 1) + (pw >> 3); }
__host__ __device__ constexpr int q_word_rope(int pw) {
  return 8 * (2 * (pw >> 4) + ((pw >> 1) & 1)) + 4 * (pw & 1) + ((pw >> 2) & 3);
}
constexpr bool q_words_permuted() {
  for (int rope = 0; rope < 2; ++rope) {
    unsigned seen = 0;
    for (int pw = 0; pw < 32; ++pw) seen |= 1u << (rope ? q_word_rope(pw) : q_word_nope(pw));
    if (seen != 0xffffffffu) return false;
  }
  return true;
}
static_assert(q_words_permuted(), "every word of a Q tile lands once");

#if defined(MLA_SM90A_DEVICE)

// An e4m3 pair (low byte first) times s_lo and s_hi, each rounded to bf16.
__device__ __forceinline__ uint32_t dequant2(uint32_t pair, float s_lo, float s_hi) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&r));
  return ptx::pack2<__nv_bfloat16>(f.x * s_lo, f.y * s_hi);
}

__device__ __forceinline__ uint4 lds16(const uint8_t* a) { return *reinterpret_cast<const uint4*>(a); }

// S^T (64 x 16) = K Q^T over one stage: rec0 / rec1 are this thread's two tokens (rows g, g + 8).
// Each 64-dim tile is one commit group; its A registers alternate between two sets, the set of
// tile t - 2 reused once that group is done.
__device__ __forceinline__ void qk(const uint8_t* rec0, const uint8_t* rec1, const uint8_t (*q)[kQTileBytes], int t4,
                                   float (&s)[N / 2]) {
  const float4 sc0 = *reinterpret_cast<const float4*>(rec0 + kScalesOffset);
  const float4 sc1 = *reinterpret_cast<const float4*>(rec1 + kScalesOffset);
  const float scale0[4] = {sc0.x, sc0.y, sc0.z, sc0.w}, scale1[4] = {sc1.x, sc1.y, sc1.z, sc1.w};
  const uint64_t dq = smem_desc(q[0], 0, 1024);
  uint32_t a[2][4][4];
#pragma unroll
  for (int t = 0; t < kQTiles; ++t) {
    uint32_t(&A)[4][4] = a[t & 1];
    if (t >= 2) wgmma_wait<1>();
    if (t < kQTiles - 1) {
      const uint4 c0 = lds16(rec0 + 64 * t + 16 * t4), c1 = lds16(rec1 + 64 * t + 16 * t4);
      const uint32_t w0[4] = {c0.x, c0.y, c0.z, c0.w}, w1[4] = {c1.x, c1.y, c1.z, c1.w};
      const float s0 = scale0[t / 2], s1 = scale1[t / 2];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        A[b][0] = dequant2(w0[b], s0, s0), A[b][2] = dequant2(w0[b] >> 16, s0, s0);
        A[b][1] = dequant2(w1[b], s1, s1), A[b][3] = dequant2(w1[b] >> 16, s1, s1);
      }
    } else {
      const uint4 r0a = lds16(rec0 + kRopeOffset + 16 * t4), r0b = lds16(rec0 + kRopeOffset + 16 * (t4 + 4));
      const uint4 r1a = lds16(rec1 + kRopeOffset + 16 * t4), r1b = lds16(rec1 + kRopeOffset + 16 * (t4 + 4));
      A[0][0] = r0a.x, A[0][1] = r1a.x, A[0][2] = r0a.y, A[0][3] = r1a.y;
      A[1][0] = r0a.z, A[1][1] = r1a.z, A[1][2] = r0a.w, A[1][3] = r1a.w;
      A[2][0] = r0b.x, A[2][1] = r1b.x, A[2][2] = r0b.y, A[2][3] = r1b.y;
      A[3][0] = r0b.z, A[3][1] = r1b.z, A[3][2] = r0b.w, A[3][3] = r1b.w;
    }
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < 4; ++b)
      wgmma_rs_small<__nv_bfloat16, N>(s, A[b], desc_offset(dq, t * kQTileBytes + b * 32), t > 0 || b > 0);
    wgmma_commit();
  }
  wgmma_wait<0>();
  fence_regs(s);
}

// O^T (512 x 16) += V^T P^T over one stage. O^T's row (m-tile mt, warp w, lane g, + 8 hk) is dim
// 16 (8 w + g) + 2 mt + hk: each thread reads one 16-byte chunk of each of its 16 tokens (k-step
// ks: tokens 16 ks + 2 t4, + 1, + 8, + 9), and a byte permute pairs two tokens' e4m3 of one dim.
// Each k-step's two halves of the m-tiles are one commit group each, their A registers in two
// alternating sets. The stage's empty barrier gets this thread's arrival once its last load is
// issued; the products are done on return.
__device__ __forceinline__ void pv(const uint8_t* stage, const uint8_t* p, int warp, int g, int t4,
                                   float (&o)[kSmallVTiles][N / 2], uint64_t* empty) {
  const uint8_t* col = stage + 16 * (8 * warp + g);
  const uint8_t* scales = stage + kScalesOffset + 4 * warp;  // dims 128 w .. + 127: scale w
  const uint64_t dp = smem_desc(p, 0, 1024);
  constexpr int kHalf = kSmallVTiles / 2;
  uint32_t a[2][kHalf][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const int ta = 16 * ks + 2 * t4;
    const int tok[4] = {ta, ta + 1, ta + 8, ta + 9};
    uint32_t w[4][4];
    float sc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 c = lds16(col + tok[j] * kRecordBytes);
      w[j][0] = c.x, w[j][1] = c.y, w[j][2] = c.z, w[j][3] = c.w;
      sc[j] = *reinterpret_cast<const float*>(scales + tok[j] * kRecordBytes);
    }
    if (ks == 3) mbar_arrive(empty);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t(&A)[kHalf][4] = a[half];
      if (ks > 0) wgmma_wait<1>();  // the group that last used this set
#pragma unroll
      for (int m = 0; m < kHalf; ++m) {
        const int mt = kHalf * half + m;
        const uint32_t sel = mt & 1 ? 0x7362u : 0x5140u;  // bytes 2, 3 or 0, 1 of the two tokens' word
        const uint32_t x = __byte_perm(w[0][mt / 2], w[1][mt / 2], sel);
        const uint32_t y = __byte_perm(w[2][mt / 2], w[3][mt / 2], sel);
        A[m][0] = dequant2(x, sc[0], sc[1]), A[m][1] = dequant2(x >> 16, sc[0], sc[1]);
        A[m][2] = dequant2(y, sc[2], sc[3]), A[m][3] = dequant2(y >> 16, sc[2], sc[3]);
      }
      wgmma_fence();
#pragma unroll
      for (int m = 0; m < kHalf; ++m)
        wgmma_rs_small<__nv_bfloat16, N>(o[kHalf * half + m], A[m], desc_offset(dp, ks * 32), 1);
      wgmma_commit();
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int mt = 0; mt < kSmallVTiles; ++mt) fence_regs(o[mt]);
}

// Q of request i, query row s (N heads x 576 dims, heads past h_q zero) into a Q buffer, each word
// of a tile where q_word_* puts it, by the producer warpgroup.
__device__ __forceinline__ void stage_q(const SparseDecodeParams& p, bool vec, int i, int s,
                                        uint8_t (*q)[kQTileBytes], int tid) {
  constexpr int kRowChunks = kQTiles * 8;  // 16-byte chunks of a head's row
  constexpr int kPerThread = N * kRowChunks / kProducerThreads;  // 9
  static_assert(N * kRowChunks % kProducerThreads == 0, "whole chunks per thread");
  const uint16_t* src = p.q + i * p.q_stride_b + s * p.q_stride_s;
  uint4 v[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int id = tid + kProducerThreads * u, h = id / kRowChunks, cq = id % kRowChunks;
    v[u] = make_uint4(0, 0, 0, 0);
    if (h < p.h_q) {
      const uint16_t* e = src + h * p.q_stride_h + cq * 8;
      if (vec) {
        v[u] = __ldg(reinterpret_cast<const uint4*>(e));
      } else {
        uint32_t x[4];
        for (int j = 0; j < 4; ++j) x[j] = uint32_t(e[2 * j]) | uint32_t(e[2 * j + 1]) << 16;
        v[u] = make_uint4(x[0], x[1], x[2], x[3]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int id = tid + kProducerThreads * u, h = id / kRowChunks, cq = id % kRowChunks, tile = cq / 8;
    const uint32_t x[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int pw = (cq % 8) * 4 + j;
      const int lw = tile < kQTiles - 1 ? q_word_nope(pw) : q_word_rope(pw);
      *reinterpret_cast<uint32_t*>(q[tile] + h * 128 + (((lw >> 2) ^ (h & 7)) << 4) + (lw & 3) * 4) = x[j];
    }
  }
}

// A producer's view of one block, read two blocks before its records are copied: the piece and
// request, the cache, and the indices of this thread's tokens (16 r + thread / 8).
struct BlockAhead {
  bool has;
  bool extra;
  int k, i;
  int32_t tok[kRounds];
};

__device__ __forceinline__ void read_ahead(BlockAhead& a, BlockWalk& walk, const SparseDecodeParams& p,
                                           const DecodePlanParams& plan, int part, int t0) {
  a.has = walk.advance(p, plan, part);
  if (!a.has) return;
  const SparseBlockSlots src = sparse_block_slots(p, walk.lens, walk.i, walk.s, walk.blk);
  a.extra = src.cache != &p.kv;
  a.k = walk.k, a.i = walk.i;
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const int slot = src.slot0 + t0 + kTokensPerRound * r;
    a.tok[r] = slot < src.len ? src.indices[slot] : -1;
  }
}

// One column (n, e) of a warpgroup's half of the dims (mt 4 half .. + 3: dims 16 (8 w + g) + 8 half
// .. + 7) to output row (s, h) of request req, as small_store_column does for a whole column.
// Half is a template argument: o is indexed by constants only (else it goes to local memory).
template <int Half>
__device__ __forceinline__ void store_half(const SparseDecodeParams& p, bool vec_out, int req, bool is_split,
                                           int split_index, int s, int h, const float (&o)[kSmallVTiles][N / 2],
                                           int n, int e, int d0, float m, float l, float sink, bool write_stats) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = o[4 * Half + j / 2][4 * n + 2 * (j % 2) + e];
  if (is_split) {
    if (split_index < 0 || split_index >= p.b + p.split.num_sm_parts) return;
    const int64_t row = (int64_t(split_index) * p.s_q + s) * p.h_q + h;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float4* dst = reinterpret_cast<float4*>(p.split.o_accum + row * kHeadDimV + d0);
    dst[0] = make_float4(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv);
    dst[1] = make_float4(v[4] * inv, v[5] * inv, v[6] * inv, v[7] * inv);
    if (write_stats) p.split.lse_accum[row] = l > 0.f ? log2f(l) + m : -INFINITY;
  } else {
    const DecodeOutput& out = p.o;
    const float inv = l > 0.f ? 1.f / (l + exp2f(sink * kLog2e - m)) : 0.f;
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(out.out) + req * out.out_stride_b + s * out.out_stride_s +
                         h * out.out_stride_h + d0;
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = ptx::pack2<__nv_bfloat16>(v[2 * j] * inv, v[2 * j + 1] * inv);
    if (vec_out) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = __float2bfloat16_rn(v[j] * inv);
    }
    if (write_stats)
      out.lse[req * out.lse_stride_b + s * out.lse_stride_s + h * out.lse_stride_h] =
          l > 0.f ? (log2f(l) + m) * kLn2 : INFINITY;
  }
}

#endif  // MLA_SM90A_DEVICE

__global__ void __launch_bounds__(kThreads, 1) sparse_decode_frag_kernel(const __grid_constant__ SparseDecodeParams p) {
#if defined(MLA_SM90A_DEVICE)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128;
  const int warp = wtid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int s = blockIdx.y, part = blockIdx.z;
  const DecodePlanParams plan = sparse_plan_params(p);

  if (tid == 0) {
    if (smem_addr(smem_raw) & 1023u) __trap();  // the swizzled Q and P tiles rely on it
    for (int b = 0; b < kStages; ++b) mbar_init(&sm.full[b], 2 * kProducerThreads), mbar_init(&sm.empty[b], 128);
    for (int b = 0; b < 2; ++b) mbar_init(&sm.qfull[b], kProducerThreads), mbar_init(&sm.qempty[b], kConsumerWgs * 128);
    fence_barrier_init();
  }
  __syncthreads();
  wait_then_plan<kThreads>(p.split, plan, part, sm.stage[0], sm.stage[1]);
  const int num_pieces = decode_io::num_pieces(p.split, p.b, part);

  if (wg == kConsumerWgs) {
    // ---- producer: records into stages, Q into its buffers ---------------------------------------
    const int t0 = wtid / kTokenThreads, tp = wtid % kTokenThreads;
    const bool q_vec = rows_16b_aligned(p.q, p.q_stride_b, p.q_stride_s, p.q_stride_h);
    BlockWalk walk{num_pieces, s};
    uint32_t block_count = 0, q_count = 0;
    int q_piece = -1;
    auto issue = [&](const BlockAhead& a) {
      const int st = block_count % kStages;
      mbar_wait(&sm.empty[st], ((block_count / kStages) & 1) ^ 1);
      const SparseKvCache& cache = a.extra ? p.extra_kv : p.kv;
      const uint32_t page = uint32_t(cache.page_block_size);
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const int t = t0 + kTokensPerRound * r;
        const bool ok = sparse_token_in_cache(cache, a.tok[r]);
        uint8_t* dst = sm.stage[st] + t * kRecordBytes;
        // A valid index is a non-negative int32: 32-bit division is exact.
        const uint8_t* rec = cache.data + int64_t(uint32_t(a.tok[r]) / page) * cache.stride_block +
                             int64_t(uint32_t(a.tok[r]) % page) * kRecordBytes;
#pragma unroll
        for (int j = 0; j < kChunksPerThread; ++j) {
          const int c = tp + kTokenThreads * j;
          if (c >= kChunks) break;
          if (kDiag == 2) continue;
          if (ok) cp_async_16(dst + 16 * c, rec + 16 * c, 16);
          else *reinterpret_cast<uint4*>(dst + 16 * c) = make_uint4(0, 0, 0, 0);
        }
        if (tp == 0) sm.valid[st][t] = ok;
      }
      mbar_arrive(&sm.full[st]);  // the flags and zero rows
      cp_async_arrive_noinc(&sm.full[st]);
      ++block_count;
      if (a.k != q_piece) {  // the piece's first block: its Q follows its records
        q_piece = a.k;
        const int qb = q_count & 1;
        mbar_wait(&sm.qempty[qb], ((q_count >> 1) & 1) ^ 1);
        stage_q(p, q_vec, a.i, s, sm.q[qb], wtid);
        fence_proxy_async();
        mbar_arrive(&sm.qfull[qb]);
        ++q_count;
      }
    };
    // Two blocks read ahead in two distinct variables (a register move would wait for the loads).
    BlockAhead a0, a1;
    read_ahead(a0, walk, p, plan, part, t0);
    read_ahead(a1, walk, p, plan, part, t0);
    while (a0.has) {
      issue(a0);
      read_ahead(a0, walk, p, plan, part, t0);
      if (!a1.has) break;
      issue(a1);
      read_ahead(a1, walk, p, plan, part, t0);
    }
  } else {
    // ---- consumers: warpgroup wg takes the blocks with block_count % 2 == wg -----------------------
    const int c = wg;
    const float scale_log2 = p.softmax_scale * kLog2e;
    const int row0 = 16 * warp + g;  // S^T rows row0 and row0 + 8
    const int tok0 = token_of_row(row0), tok1 = token_of_row(row0 + 8);
    const DecodeOutput& out = p.o;
    const bool vec_out = reinterpret_cast<uintptr_t>(out.out) % 16 == 0 && out.out_stride_b % 8 == 0 &&
                         out.out_stride_s % 8 == 0 && out.out_stride_h % 8 == 0;
    const int d0 = 16 * (8 * warp + g) + 8 * c;  // this warpgroup's half of the thread's 16 dims
    uint32_t block_count = 0, q_count = 0;
    for (int k = 0; k < num_pieces; ++k) {
      const PlanPiece pc = decode_io::piece(p.split, plan, part, k);
      const int i = __shfl_sync(0xffffffffu, pc.req, 0);
      const int block_begin = __shfl_sync(0xffffffffu, pc.block_begin, 0);
      const int block_end = __shfl_sync(0xffffffffu, pc.block_end, 0);
      const bool has_blocks = block_end > block_begin;
      const int qb = q_count & 1;
      if (has_blocks) mbar_wait(&sm.qfull[qb], (q_count >> 1) & 1);

      float m_run[N / 8][2], l_part[N / 8][2], o[kSmallVTiles][N / 2];
      small_start<N>(m_run, l_part, o);
      for (int blk = block_begin; blk < block_end; ++blk, ++block_count) {
        if (int(block_count & 1) != c) continue;
        const int st = block_count % kStages;
        mbar_wait(&sm.full[st], (block_count / kStages) & 1);
        const uint8_t* stage = sm.stage[st];
        if constexpr (kDiag == 1) {  // timing aid: the stage goes straight back
          mbar_arrive(&sm.empty[st]);
          continue;
        }
        float sc[N / 2];
        qk(stage + tok0 * kRecordBytes, stage + tok1 * kRecordBytes, sm.q[qb], t4, sc);
        const uint8_t* valid = sm.valid[st];
        small_mask_max<N>(sc, scale_log2, false, [&](int key, int) { return valid[token_of_row(key)] != 0; },
                          sm.warp_max[c], warp, lane);
        named_sync(1 + c, 128);  // warp_max complete
        small_softmax<__nv_bfloat16, N>(sc, sm.warp_max[c], m_run, l_part, o, sm.p[c], warp, lane,
                                        [](int key) { return token_of_row(key); });
        named_sync(1 + c, 128);  // P complete; every thread has read warp_max
        pv(stage, sm.p[c], warp, g, t4, o, &sm.empty[st]);
      }
      wgmma_wait<0>();  // unconditional: a wait on one path only would serialise every wgmma
#pragma unroll
      for (int mt = 0; mt < kSmallVTiles; ++mt) fence_regs(o[mt]);

      // ---- merge the two warpgroups' states (through this piece's Q buffer) ---------------------
      if (has_blocks) {
        float* xfer = reinterpret_cast<float*>(sm.q[qb][0]);
        named_sync(3, 256);  // both are done with the piece's products and its Q
        if (warp == 0 && g == 0)
#pragma unroll
          for (int n = 0; n < N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) sm.m_merge[c][8 * n + 2 * t4 + e] = m_run[n][e];
        // Round 0: warpgroup 1 hands over its half 0 and its sums, which warpgroup 0 merges into its
        // own. Round 1: warpgroup 0 hands over its half 1 (untouched by round 0) and the merged sums.
        constexpr int kHalfFloats = kSmallVTiles / 2 * N / 2;  // per thread
#pragma unroll
        for (int round = 0; round < 2; ++round) {
          const int giver = 1 - round, half = round;  // the taker keeps dims half `half`
          if (c == giver) {
#pragma unroll
            for (int r = 0; r < kHalfFloats; ++r) xfer[r * 128 + wtid] = o[4 * half + r / (N / 2)][r % (N / 2)];
#pragma unroll
            for (int r = 0; r < N / 4; ++r) xfer[(kHalfFloats + r) * 128 + wtid] = l_part[r / 2][r % 2];
          }
          named_sync(3, 256);
          if (c != giver) {
#pragma unroll
            for (int n = 0; n < N / 8; ++n)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float m_own = m_run[n][e], m_peer = sm.m_merge[giver][8 * n + 2 * t4 + e];
                const float m = fmaxf(m_own, m_peer);
                const float f_own = m == -INFINITY ? 0.f : exp2_ftz(m_own - m);
                const float f_peer = m == -INFINITY ? 0.f : exp2_ftz(m_peer - m);
                const float l_peer = xfer[(kHalfFloats + 2 * n + e) * 128 + wtid];
                l_part[n][e] = round == 0 ? l_part[n][e] * f_own + l_peer * f_peer : l_peer;
                m_run[n][e] = m;
#pragma unroll
                for (int mt = 4 * half; mt < 4 * half + 4; ++mt)
#pragma unroll
                  for (int hk = 0; hk < 2; ++hk) {
                    const int j = 4 * n + 2 * hk + e;
                    o[mt][j] = o[mt][j] * f_own + xfer[((mt - 4 * half) * (N / 2) + j) * 128 + wtid] * f_peer;
                  }
              }
          }
          named_sync(3, 256);
        }
        mbar_arrive(&sm.qempty[qb]);
        ++q_count;
      }

      // ---- epilogue: this warpgroup's half of the dims ---------------------------------------------
      small_row_sums<N>(l_part, sm.warp_sum[c], warp, lane);
      named_sync(1 + c, 128);
#pragma unroll
      for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int h = 8 * n + 2 * t4 + e;
          if (h >= p.h_q) continue;
          const float l = sm.warp_sum[c][0][h] + sm.warp_sum[c][1][h] + sm.warp_sum[c][2][h] + sm.warp_sum[c][3][h];
          const float sink = p.attn_sink ? p.attn_sink[h] : -INFINITY;
          if (c == 0)
            store_half<0>(p, vec_out, i, pc.is_split, pc.split_index, s, h, o, n, e, d0, m_run[n][e], l, sink,
                          warp == 0 && g == 0);
          else
            store_half<1>(p, vec_out, i, pc.is_split, pc.split_index, s, h, o, n, e, d0, m_run[n][e], l, sink, false);
        }
      named_sync(1 + c, 128);  // warp_sum is read before the next piece's epilogue writes it
    }
  }
#endif  // MLA_SM90A_DEVICE
}

}  // namespace sm90_sparse_frag

cudaError_t sm90_sparse_decode_frag(const SparseDecodeParams& p, cudaStream_t stream) {
  // The dispatch never sends them (kSparseSm90Frag).
  if (p.format != KvFormat::kV32 || p.h_q > sm90_sparse_frag::N) return cudaErrorInvalidValue;
  // A fresh plan is made in the kernel, its part costs in two stages (the dispatcher sends more
  // parts than that holds to the planner kernel first).
  if (p.split.plan_fresh && p.split.num_sm_parts > kPlanMaxPartsIn64KB) return cudaErrorInvalidValue;
  using namespace sm90_sparse_frag;
  constexpr int smem = int(sizeof(Smem));
  static_assert(smem + 1024 <= 228 * 1024 && smem <= 227 * 1024, "the stages, Q and P fit an sm90 block");
  static_assert(2 * kStageBytes >= 65536, "two stages hold the planner's part costs");
  cudaError_t err = raise_smem_limit_once<sparse_decode_frag_kernel>(smem, "the sm90 fragment sparse kernel");
  if (err != cudaSuccess) return err;
  err = launch_dependent(sparse_decode_frag_kernel, dim3(1, unsigned(p.s_q), unsigned(p.split.num_sm_parts)),
                         kThreads, smem, stream, p);
  if (err != cudaSuccess) return err;
  return combine_sparse(p, stream);
}

}  // namespace mla::cuda
