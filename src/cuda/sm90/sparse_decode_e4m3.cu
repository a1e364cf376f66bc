// Hopper (sm_90a) sparse MLA decode over the V3.2 FP8 cache (d_qk 576, 656 bytes per token) for at
// most 16 heads, multiplying the records' e4m3 bytes as they are (e4m3 wgmma): no dequantisation,
// no bf16 copy of a block. Every feature of the op: the attention sink, topk_length, an extra cache
// with its own page size, extra_topk_length; indices outside their cache are invalid and never read.
//
// The other operand of each product is split into two e4m3 parts, hi + lo, scaled by a power of
// two (bench/fp8_split_numerics.py emulates this arithmetic against the reference; SPEC section 8's
// tolerances hold with room):
//   S^T (64 tokens x 16 heads) = sum over the four 128-dim scale groups G of
//       scale[token][G] * (K8_G [Q_G hi | Q_G lo]^T) / b[head][G]     (+ RoPE: bf16 x bf16),
//   one m64n32k32 chain per group (hi heads in columns 0-15, lo in 16-31), Q split per head and
//   group with b = 2^k putting its largest |q| at <= 224;
//   O^T (512 x 16) += V8^T (P' hi + P' lo)^T per group, P' = P * scale[token][G] * beta_G, beta_G a
//   power of two per block and group putting the block's largest scale at <= 224 (P <= 1: the
//   running max is exact, not lazy); O^T is kept in units of the last block's beta_G, rescaled
//   (exactly, by powers of two) when it moves, and divided by it at the end of a piece.
//
// Schedule (384 threads, one CTA per (query token s, plan part), persistent over the part's
// pieces; one CTA per SM):
//   * warpgroup 2 produces: eight threads per token copy each 64-slot block's records by cp.async
//     into a stage laid out as wgmma operands (four 64 x 128-byte e4m3 tiles, one per scale group,
//     the RoPE tile, the scales; 128-byte swizzle), invalid tokens as zeros, a validity flag per
//     token, four stages on full / empty mbarriers; each piece's Q split into its hi / lo tiles;
//   * warpgroups 0 and 1 consume alternate blocks, each with its own running max, sums and O^T,
//     merged at the end of each piece: S^T from shared memory (16 m64n32k32 + 4 bf16 m64n16k16), the
//     softmax down the columns, P' hi / lo as four 16 x 128-byte B tiles; V8^T's A fragments from the
//     stage by 4-byte loads and 4 x 4 byte transposes (prmt), 32 m64n16k32;
//   * epilogue: each consumer warpgroup writes two of the four groups' dims, out / lse with the sink
//     for whole pieces, fp32 partials for split ones (the combine kernel applies the sink);
//   * with a fresh plan every CTA first plans its own part (plan_block.cuh).
// Tile sizes: 64-token blocks, N = 16 heads (32 columns for S^T), four 41 KB stages, two 19 KB Q
// buffers, 8 KB of P' per consumer warpgroup.
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

namespace sm90_sparse_e4m3 {

using namespace sm90;
using Fm = SparseFormat<KvFormat::kV32>;
// Timing aid, never for results (as MLA_SPARSE_DIAG in the other sparse kernels): 1 makes the
// consumers hand every stage straight back (the producer alone), 2 makes the producer copy nothing.
#ifndef MLA_E4M3_DIAG
#define MLA_E4M3_DIAG 0
#endif
constexpr int kDiag = MLA_E4M3_DIAG;

constexpr int N = 16;        // heads: O^T's wgmma N
constexpr int kBlockN = 64;  // tokens per block = plan block = wgmma M of S^T
static_assert(kBlockN == kPlanBlockSize, "one token block per plan block");
constexpr int kGroups = 4;   // 128-dim scale groups of the NoPE dims, one 64 x 128-byte tile each
constexpr int kTileBytes = kBlockN * 128;
constexpr int kRecordBytes = Fm::kRecordBytes;  // 656: 512 e4m3, 4 float scales, 64 bf16 RoPE dims
constexpr int kChunks = kRecordBytes / 16;      // 41: 32 NoPE, 1 of scales, 8 RoPE
constexpr int kStages = 4;
constexpr int kConsumerWgs = 2;
constexpr int kProducerThreads = 128;
constexpr int kThreads = 128 * kConsumerWgs + kProducerThreads;
constexpr int kTokenThreads = 8;                                   // producer threads per token
constexpr int kTokensPerRound = kProducerThreads / kTokenThreads;  // 16
constexpr int kRounds = kBlockN / kTokensPerRound;                 // 4 tokens per producer thread and block
constexpr int kChunksPerThread = (kChunks + kTokenThreads - 1) / kTokenThreads;  // 6
// Registers per thread after setmaxnreg (the CTA starts with 168 = 64 K / 384, and moves them):
// a consumer holds O^T (64) and S^T's five accumulators (72) at once.
constexpr int kConsumerRegs = 208, kProducerRegs = 88;
static_assert(kConsumerWgs * kConsumerRegs + kProducerRegs <= 3 * 168, "moved, never added");
constexpr float kSplitMax = 224.f;
// Q's lo part is stored times 16: |q b - hi| is at most half an e4m3 step of hi (16 at hi = 224), so
// 16 times it still fits, and lo keeps four significant bits down to 16 times smaller values before
// it reaches e4m3's subnormal range (hi + lo / 16 is then a bf16 q exactly).
constexpr float kLoScale = 16.f;  // hi + lo parts scaled to at most this (e4m3's largest is 448)

struct Stage {
  uint8_t nope[kGroups][kTileBytes];  // e4m3 [token][128 dims of group G], 128-byte swizzle
  uint8_t rope[kTileBytes];           // bf16 [token][64 dims], 128-byte swizzle
  float scale[kBlockN][kGroups];
};
struct alignas(1024) QBuffer {
  uint8_t nope[kGroups][2 * N * 128];  // e4m3 [hi heads | lo heads][128 dims], 128-byte swizzle
  uint8_t rope[N * 128];               // bf16 [head][64 dims], 128-byte swizzle
  float inv_b[N][kGroups];             // 1 / b per head and group
};
struct Smem {
  union {
    Stage stage[kStages];
    uint8_t stage_bytes[kStages][sizeof(Stage)];  // the first two: the in-kernel planner's scratch
  };
  QBuffer q[2];
  uint8_t p[kConsumerWgs][kGroups][N * 128];  // P' e4m3 [head][hi k-slots 0-63 | lo 64-127], swizzled
  float warp_max[kConsumerWgs][4][N];
  float warp_scale_max[kConsumerWgs][4][kGroups];
  float warp_sum[kConsumerWgs][4][N];
  float m_merge[kConsumerWgs][N];  // each warpgroup's running max at the end of a piece
  uint8_t valid[kStages][kBlockN];
  uint64_t full[kStages], empty[kStages], qfull[2], qempty[2];
};
static_assert(sizeof(Stage) % 1024 == 0, "the stages keep every tile after them 1024-byte aligned");
// The merge passes one warpgroup's partial sums and half of its O^T (32 + 4 floats per thread).
static_assert((kSmallVTiles / 2 * N / 2 + N / 4) * 128 * 4 <= sizeof(QBuffer), "the merge fits a Q buffer");

// The k-slot order of a block's tokens (the K of O^T = V8^T P'^T; any order will do if P' takes the
// same). Within each 32-token k-step, k-slot 4 t + j + 16 h holds token 16 h + 8 (j % 2) + 2 t + j / 2:
// a thread's four tokens of a register then lie in four distinct rows mod 8, and the 32 lanes' 4-byte
// loads of V8 hit 32 distinct banks through the swizzle (in token order, two-way conflicts).
__host__ __device__ constexpr int token_of_kslot(int k) {
  const int h = (k >> 4) & 1, t = (k >> 2) & 3, j = k & 3;
  return (k & ~31) + 16 * h + 8 * (j & 1) + 2 * t + (j >> 1);
}
__host__ __device__ constexpr int kslot_of_token(int r) {
  const int h = (r >> 4) & 1, x = r & 15, j = 2 * (x & 1) + (x >> 3), t = (x & 7) >> 1;
  return (r & ~31) + 16 * h + 4 * t + j;
}
constexpr bool kslots_permute() {
  for (int k = 0; k < kBlockN; ++k)
    if (kslot_of_token(token_of_kslot(k)) != k) return false;
  return true;
}
static_assert(kslots_permute(), "k-slots and tokens are one permutation");

// A power of two 2^k with amax 2^k <= kSplitMax (1 for amax 0), k clamped to [-62, 62]: the ratio
// of two of them (O^T's rescale between blocks) stays finite. A group whose largest scale is under
// about 1e-17 loses the bits of its P' that fall below e4m3's range.
constexpr int kSplitExpLimit = 62;
__host__ __device__ inline float split_scale(float amax) {
  if (!(amax > 0.f)) return 1.f;
  const float r = kSplitMax / amax;
  int e = kSplitExpLimit + 1;
  if (r < INFINITY) (void)frexpf(r, &e);  // r = f 2^e, f in [0.5, 1)
  e = e - 1 < -kSplitExpLimit ? -kSplitExpLimit : (e - 1 > kSplitExpLimit ? kSplitExpLimit : e - 1);
  return ldexpf(1.f, e);
}

#if defined(MLA_SM90A_DEVICE)

__device__ __forceinline__ uint16_t to_e4m3x2(float lo_byte, float hi_byte) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo_byte, hi_byte), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float2 from_e4m3x2(uint16_t v) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&r));
}

// Byte (row, k) of a 128-byte-swizzled tile with 128-byte rows.
__device__ __forceinline__ int swz_byte(int row, int k) { return row * 128 + ((((k >> 4) ^ row) & 7) << 4) + (k & 15); }

// Eight bf16 of Q (16 bytes at e) as floats.
__device__ __forceinline__ void load_q8(const uint16_t* e, bool vec, float (&x)[8]) {
  uint32_t w[4];
  if (vec) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(e));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = uint32_t(e[2 * j]) | uint32_t(e[2 * j + 1]) << 16;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) x[2 * j] = __uint_as_float(w[j] << 16), x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
}

// Q of request i, query row s into a Q buffer, by the producer warpgroup: per head and group, hi =
// e4m3(q b) and lo = e4m3(q b - hi) (heads past h_q zero); the RoPE dims as they are. Two threads
// per (head, group), 64 dims each, read them twice (for the group's largest |q|, then to split
// them), so that the producer's registers stay few.
__device__ __forceinline__ void stage_q(const SparseDecodeParams& p, bool vec, int i, int s, QBuffer& q, int tid) {
  const uint16_t* src = p.q + i * p.q_stride_b + s * p.q_stride_s;
  {
    const int h = tid / 8, grp = (tid / 2) % kGroups, half = tid % 2;
    const bool live = h < p.h_q;
    const uint16_t* e = src + h * p.q_stride_h + 128 * grp + 64 * half;
    float amax = 0.f;
    if (live) {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        float x[8];
        load_q8(e + 8 * c, vec, x);
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(x[j]));
      }
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const float b = split_scale(amax);
    if (half == 0) q.inv_b[h][grp] = 1.f / b;
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // 16 dims a chunk
      uint32_t hw[4] = {0, 0, 0, 0}, lw[4] = {0, 0, 0, 0};
      if (live) {
        float x[16];
        load_q8(e + 16 * c, vec, *reinterpret_cast<float(*)[8]>(x));
        load_q8(e + 16 * c + 8, vec, *reinterpret_cast<float(*)[8]>(x + 8));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float a0 = x[4 * j] * b, a1 = x[4 * j + 1] * b, a2 = x[4 * j + 2] * b, a3 = x[4 * j + 3] * b;
          const uint16_t h01 = to_e4m3x2(a0, a1), h23 = to_e4m3x2(a2, a3);
          const float2 f01 = from_e4m3x2(h01), f23 = from_e4m3x2(h23);
          const uint16_t l01 = to_e4m3x2(kLoScale * (a0 - f01.x), kLoScale * (a1 - f01.y));
          const uint16_t l23 = to_e4m3x2(kLoScale * (a2 - f23.x), kLoScale * (a3 - f23.y));
          hw[j] = uint32_t(h01) | uint32_t(h23) << 16;
          lw[j] = uint32_t(l01) | uint32_t(l23) << 16;
        }
      }
      const int k = 64 * half + 16 * c;
      *reinterpret_cast<uint4*>(q.nope[grp] + swz_byte(h, k)) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
      *reinterpret_cast<uint4*>(q.nope[grp] + swz_byte(N + h, k)) = make_uint4(lw[0], lw[1], lw[2], lw[3]);
    }
  }
  {
    // The RoPE dims: one 16-byte chunk per thread.
    const int h = tid / 8, c = tid % 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (h < p.h_q) {
      const uint16_t* e = src + h * p.q_stride_h + Fm::kNope + 8 * c;
      if (vec) {
        v = __ldg(reinterpret_cast<const uint4*>(e));
      } else {
        uint32_t w[4];
        for (int j = 0; j < 4; ++j) w[j] = uint32_t(e[2 * j]) | uint32_t(e[2 * j + 1]) << 16;
        v = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    *reinterpret_cast<uint4*>(q.rope + swz_byte(h, 16 * c)) = v;
  }
}
static_assert(N * kGroups * 2 == kProducerThreads && N * 8 == kProducerThreads, "stage_q's thread mapping");

// S^T (64 x 16) = K Q^T over one stage into s (rows 16 w + g, + 8: tokens; columns: heads): each
// group's chain accumulates alone, then adds in fp32 times the token's scale / b.
__device__ __forceinline__ void qk(const Stage& st, const QBuffer& q, int row0, int t4, float (&s)[N / 2]) {
  float acc[kGroups][16], rope[N / 2];
  wgmma_fence();
#pragma unroll
  for (int grp = 0; grp < kGroups; ++grp) {
    const uint64_t da = smem_desc(st.nope[grp], 0, 1024), db = smem_desc(q.nope[grp], 0, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_ss_e4m3_n32(acc[grp], desc_offset(da, 32 * kk), desc_offset(db, 32 * kk), kk > 0);
  }
  {
    const uint64_t da = smem_desc(st.rope, 0, 1024), db = smem_desc(q.rope, 0, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_ss_small<__nv_bfloat16, N, 0>(rope, desc_offset(da, 32 * kk), desc_offset(db, 32 * kk), kk > 0);
  }
  wgmma_commit();
  const float4 sc0 = *reinterpret_cast<const float4*>(st.scale[row0]);
  const float4 sc1 = *reinterpret_cast<const float4*>(st.scale[row0 + 8]);
  float inv_b[N / 8][2][kGroups];
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float4 v = *reinterpret_cast<const float4*>(q.inv_b[8 * n + 2 * t4 + e]);
      inv_b[n][e][0] = v.x, inv_b[n][e][1] = v.y, inv_b[n][e][2] = v.z, inv_b[n][e][3] = v.w;
    }
  wgmma_wait<0>();
#pragma unroll
  for (int grp = 0; grp < kGroups; ++grp) fence_regs(acc[grp]);
  fence_regs(rope);
  const float sc[2][kGroups] = {{sc0.x, sc0.y, sc0.z, sc0.w}, {sc1.x, sc1.y, sc1.z, sc1.w}};
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int hk = 0; hk < 2; ++hk)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 4 * n + 2 * hk + e;
        float v = rope[j];
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp)
          v = fmaf(sc[hk][grp] * inv_b[n][e][grp], fmaf(acc[grp][j + 8], 1.f / kLoScale, acc[grp][j]), v);
        s[j] = v;
      }
}

// Four words (one per k-slot j) of four bytes (one per dim d) -> four words, one per dim.
__device__ __forceinline__ void transpose4x4(const uint32_t (&w)[4], uint32_t (&r)[4]) {
  const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
  r[0] = __byte_perm(t0, t2, 0x5410), r[1] = __byte_perm(t0, t2, 0x7632);
  r[2] = __byte_perm(t1, t3, 0x5410), r[3] = __byte_perm(t1, t3, 0x7632);
}

// O^T (512 x 16) += V8^T P'^T over one stage. O^T's m-tile 2 G + m, row 16 w + g + 8 hk is dim
// 128 G + 32 w + 4 g + 2 m + hk: a thread's four dims of group G are one 4-byte word of each token's
// row in tile G. Per group, 16 such loads (the thread's k-slots of both k-steps) become by byte
// transposes the A fragments of both m-tiles, each used for P' hi and P' lo; the groups' fragments
// alternate between two register sets. The stage's empty barrier gets this thread's arrival once
// its last load is issued; the products are done on return.
__device__ __forceinline__ void pv(const Stage& st, const uint8_t (*p)[N * 128], int warp, int g, int t4,
                                   float (&o)[kSmallVTiles][N / 2], uint64_t* empty) {
  const int unit = 2 * warp + (g >> 2), byte = 4 * (g & 3);
  uint32_t a[2][2][2][4];  // [set][m][kk][register]
#pragma unroll
  for (int grp = 0; grp < kGroups; ++grp) {
    uint32_t(&A)[2][2][4] = a[grp & 1];
    uint32_t w[2][2][4];  // [kk][h][j]
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int t = token_of_kslot(32 * kk + 16 * h + 4 * t4 + j);
          w[kk][h][j] = *reinterpret_cast<const uint32_t*>(st.nope[grp] + t * 128 + (((unit ^ t) & 7) << 4) + byte);
        }
    if (grp == kGroups - 1) mbar_arrive(empty);
    if (grp >= 2) wgmma_wait<1>();  // the group that last used this set
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t r[4];
        transpose4x4(w[kk][h], r);
#pragma unroll
        for (int m = 0; m < 2; ++m) A[m][kk][2 * h] = r[2 * m], A[m][kk][2 * h + 1] = r[2 * m + 1];
      }
    wgmma_fence();
    const uint64_t dp = smem_desc(p[grp], 0, 1024);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int part = 0; part < 2; ++part)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
          wgmma_rs_e4m3_n16(o[2 * grp + m], A[m][kk], desc_offset(dp, 64 * part + 32 * kk), 1);
    wgmma_commit();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int mt = 0; mt < kSmallVTiles; ++mt) fence_regs(o[mt]);
}

// A producer's view of one block, read two blocks before its records are copied: the piece and
// request, the cache, and the indices of this thread's tokens (t0 + 16 r).
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

// The four dims 128 G + 32 w + 4 g .. + 3 of head h (column (n, e) of O^T) to output row (s, h) of
// request req, for the groups G = 2 Half, 2 Half + 1 (this warpgroup's half of the dims). Half is a
// template argument: o is indexed by constants only (else it goes to local memory).
template <int Half>
__device__ __forceinline__ void store_half(const SparseDecodeParams& p, bool vec_out, int req, bool is_split,
                                           int split_index, int s, int h, const float (&o)[kSmallVTiles][N / 2],
                                           int n, int e, int warp, int g, float m, float l, float sink,
                                           bool write_stats) {
  const DecodeOutput& out = p.o;
  if (is_split && (split_index < 0 || split_index >= p.b + p.split.num_sm_parts)) return;
  const float inv = !(l > 0.f) ? 0.f : is_split ? 1.f / l : 1.f / (l + exp2f(sink * kLog2e - m));
#pragma unroll
  for (int gi = 0; gi < 2; ++gi) {
    const int grp = 2 * Half + gi, d0 = 128 * grp + 32 * warp + 4 * g;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = o[2 * grp + j / 2][4 * n + 2 * (j % 2) + e] * inv;
    if (is_split) {
      const int64_t row = (int64_t(split_index) * p.s_q + s) * p.h_q + h;
      *reinterpret_cast<float4*>(p.split.o_accum + row * kHeadDimV + d0) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(out.out) + req * out.out_stride_b + s * out.out_stride_s +
                           h * out.out_stride_h + d0;
      const uint32_t w0 = ptx::pack2<__nv_bfloat16>(v[0], v[1]), w1 = ptx::pack2<__nv_bfloat16>(v[2], v[3]);
      if (vec_out) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(w0, w1);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[j] = __float2bfloat16_rn(v[j]);
      }
    }
  }
  if (write_stats) {
    if (is_split) {
      p.split.lse_accum[(int64_t(split_index) * p.s_q + s) * p.h_q + h] = l > 0.f ? log2f(l) + m : -INFINITY;
    } else {
      out.lse[req * out.lse_stride_b + s * out.lse_stride_s + h * out.lse_stride_h] =
          l > 0.f ? (log2f(l) + m) * kLn2 : INFINITY;
    }
  }
}

#endif  // MLA_SM90A_DEVICE

__global__ void __launch_bounds__(kThreads, 1) sparse_decode_e4m3_kernel(const __grid_constant__ SparseDecodeParams p) {
#if defined(MLA_SM90A_DEVICE)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), wtid = tid % 128;
  const int warp = wtid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int s = blockIdx.y, part = blockIdx.z;
  const DecodePlanParams plan = sparse_plan_params(p);

  if (tid == 0) {
    if (smem_addr(smem_raw) & 1023u) __trap();  // the swizzled tiles rely on it
    for (int b = 0; b < kStages; ++b) mbar_init(&sm.full[b], 2 * kProducerThreads), mbar_init(&sm.empty[b], 128);
    for (int b = 0; b < 2; ++b) mbar_init(&sm.qfull[b], kProducerThreads), mbar_init(&sm.qempty[b], kConsumerWgs * 128);
    fence_barrier_init();
  }
  __syncthreads();
  wait_then_plan<kThreads>(p.split, plan, part, sm.stage_bytes[0], sm.stage_bytes[1]);
  const int num_pieces = decode_io::num_pieces(p.split, p.b, part);

  if (wg == kConsumerWgs) {
    // ---- producer: records into stages, Q into its buffers ---------------------------------------
    set_max_regs_dec<kProducerRegs>();
    const int t0 = wtid / kTokenThreads, tp = wtid % kTokenThreads;
    const bool q_vec = rows_16b_aligned(p.q, p.q_stride_b, p.q_stride_s, p.q_stride_h);
    BlockWalk walk{num_pieces, s};
    uint32_t block_count = 0, q_count = 0;
    int q_piece = -1;
    auto issue = [&](const BlockAhead& a) {
      const int sti = block_count % kStages;
      mbar_wait(&sm.empty[sti], ((block_count / kStages) & 1) ^ 1);
      Stage& st = sm.stage[sti];
      const SparseKvCache& cache = a.extra ? p.extra_kv : p.kv;
      const uint32_t page = uint32_t(cache.page_block_size);
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const int t = t0 + kTokensPerRound * r;
        const bool ok = sparse_token_in_cache(cache, a.tok[r]);
        // A valid index is a non-negative int32: 32-bit division is exact.
        const uint8_t* rec = cache.data + int64_t(uint32_t(a.tok[r]) / page) * cache.stride_block +
                             int64_t(uint32_t(a.tok[r]) % page) * kRecordBytes;
#pragma unroll
        for (int j = 0; j < kChunksPerThread; ++j) {
          const int c = tp + kTokenThreads * j;  // chunk c of the record
          if (c >= kChunks) break;
          uint8_t* dst;
          if (j < kGroups) dst = st.nope[j] + swz_byte(t, 16 * tp);
          else if (c == Fm::kNope / 16) dst = reinterpret_cast<uint8_t*>(st.scale[t]);
          else dst = st.rope + swz_byte(t, 16 * (c - Fm::kRopeOffset / 16));
          if (kDiag == 2) continue;
          if (ok) cp_async_16(dst, rec + 16 * c, 16);
          else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        }
        if (tp == 0) sm.valid[sti][t] = ok;
      }
      mbar_arrive(&sm.full[sti]);  // the flags and zero rows
      cp_async_arrive_noinc(&sm.full[sti]);
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
    set_max_regs_inc<kConsumerRegs>();
    const int c = wg;
    const float scale_log2 = p.softmax_scale * kLog2e;
    const int row0 = 16 * warp + g;  // S^T rows (tokens) row0 and row0 + 8
    const int kslot0 = kslot_of_token(row0);
    const DecodeOutput& out = p.o;
    const bool vec_out = reinterpret_cast<uintptr_t>(out.out) % 8 == 0 && out.out_stride_b % 4 == 0 &&
                         out.out_stride_s % 4 == 0 && out.out_stride_h % 4 == 0;
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
      float beta_run[kGroups] = {1.f, 1.f, 1.f, 1.f};  // O^T of group G is in units of 1 / beta_run[G]
      for (int blk = block_begin; blk < block_end; ++blk, ++block_count) {
        if (int(block_count & 1) != c) continue;
        const int sti = block_count % kStages;
        mbar_wait(&sm.full[sti], (block_count / kStages) & 1);
        const Stage& st = sm.stage[sti];
        if constexpr (kDiag == 1) {  // timing aid: the stage goes straight back
          mbar_arrive(&sm.empty[sti]);
          continue;
        }
        float sc[N / 2];
        qk(st, sm.q[qb], row0, t4, sc);
        const uint8_t* valid = sm.valid[sti];
        small_mask_max<N>(sc, scale_log2, false, [&](int key, int) { return valid[key] != 0; }, sm.warp_max[c],
                          warp, lane);
        // The block's largest scale per group (an invalid token's are zero).
        const float4 scl0 = *reinterpret_cast<const float4*>(st.scale[row0]);
        const float4 scl1 = *reinterpret_cast<const float4*>(st.scale[row0 + 8]);
        const float tok_scale[2][kGroups] = {{scl0.x, scl0.y, scl0.z, scl0.w}, {scl1.x, scl1.y, scl1.z, scl1.w}};
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) {
          float m = fmaxf(tok_scale[0][grp], tok_scale[1][grp]);
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
          if (lane == 0) sm.warp_scale_max[c][warp][grp] = m;
        }
        named_sync(1 + c, 128);  // warp_max and warp_scale_max complete
        float beta[kGroups], f_beta[kGroups];
#pragma unroll
        for (int grp = 0; grp < kGroups; ++grp) {
          const float m = fmaxf(fmaxf(sm.warp_scale_max[c][0][grp], sm.warp_scale_max[c][1][grp]),
                                fmaxf(sm.warp_scale_max[c][2][grp], sm.warp_scale_max[c][3][grp]));
          beta[grp] = split_scale(m);
          f_beta[grp] = beta[grp] / beta_run[grp];  // a power of two: exact
          beta_run[grp] = beta[grp];
        }
        // The softmax down S^T's columns with an exact running max (P <= 1), P' hi / lo per group.
#pragma unroll
        for (int n = 0; n < N / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int h = 8 * n + 2 * t4 + e;
            const float blk_max = fmaxf(fmaxf(sm.warp_max[c][0][h], sm.warp_max[c][1][h]),
                                        fmaxf(sm.warp_max[c][2][h], sm.warp_max[c][3][h]));
            const float m_new = fmaxf(m_run[n][e], blk_max);
            const float alpha = m_new == m_run[n][e] ? 1.f : exp2_ftz(m_run[n][e] - m_new);
            m_run[n][e] = m_new;
            const float base = m_new == -INFINITY ? 0.f : m_new;
            const float p0 = exp2_ftz(sc[4 * n + e] - base), p1 = exp2_ftz(sc[4 * n + 2 + e] - base);
            l_part[n][e] = l_part[n][e] * alpha + (p0 + p1);
#pragma unroll
            for (int grp = 0; grp < kGroups; ++grp) {
              const float x0 = p0 * tok_scale[0][grp] * beta[grp], x1 = p1 * tok_scale[1][grp] * beta[grp];
              const uint16_t hi = to_e4m3x2(x0, x1);
              const float2 fh = from_e4m3x2(hi);
              const uint16_t lo = to_e4m3x2(x0 - fh.x, x1 - fh.y);
              *reinterpret_cast<uint16_t*>(sm.p[c][grp] + swz_byte(h, kslot0)) = hi;
              *reinterpret_cast<uint16_t*>(sm.p[c][grp] + swz_byte(h, 64 + kslot0)) = lo;
              const float f = alpha * f_beta[grp];
#pragma unroll
              for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int hk = 0; hk < 2; ++hk) o[2 * grp + m][4 * n + 2 * hk + e] *= f;
            }
          }
#pragma unroll
        for (int mt = 0; mt < kSmallVTiles; ++mt) fence_regs(o[mt]);
        fence_proxy_async();     // P' is read by wgmma next
        named_sync(1 + c, 128);  // P' complete; every thread has read warp_max
        pv(st, sm.p[c], warp, g, t4, o, &sm.empty[sti]);
      }
      wgmma_wait<0>();  // unconditional: a wait on one path only would serialise every wgmma
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        const float f = 1.f / beta_run[grp];  // back to true units
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int j = 0; j < N / 2; ++j) o[2 * grp + m][j] *= f;
      }
#pragma unroll
      for (int mt = 0; mt < kSmallVTiles; ++mt) fence_regs(o[mt]);

      // ---- merge the two warpgroups' states (through this piece's Q buffer) ---------------------
      if (has_blocks) {
        float* xfer = reinterpret_cast<float*>(&sm.q[qb]);
        named_sync(3, 256);  // both are done with the piece's products and its Q
        if (warp == 0 && g == 0)
#pragma unroll
          for (int n = 0; n < N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) sm.m_merge[c][8 * n + 2 * t4 + e] = m_run[n][e];
        // Round 0: warpgroup 1 hands over its half 0 (groups 0, 1) and its sums, which warpgroup 0
        // merges into its own. Round 1: warpgroup 0 hands over its half 1 (untouched by round 0)
        // and the merged sums.
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
            store_half<0>(p, vec_out, i, pc.is_split, pc.split_index, s, h, o, n, e, warp, g, m_run[n][e], l, sink,
                          warp == 0 && g == 0);
          else
            store_half<1>(p, vec_out, i, pc.is_split, pc.split_index, s, h, o, n, e, warp, g, m_run[n][e], l, sink,
                          false);
        }
      named_sync(1 + c, 128);  // warp_sum is read before the next piece's epilogue writes it
    }
  }
#endif  // MLA_SM90A_DEVICE
}

}  // namespace sm90_sparse_e4m3

cudaError_t sm90_sparse_decode_e4m3(const SparseDecodeParams& p, cudaStream_t stream) {
  // The dispatch never sends them (kSparseSm90E4m3).
  if (p.format != KvFormat::kV32 || p.h_q > sm90_sparse_e4m3::N) return cudaErrorInvalidValue;
  // A fresh plan is made in the kernel, its part costs in two stages (the dispatcher sends more
  // parts than that holds to the planner kernel first).
  if (p.split.plan_fresh && p.split.num_sm_parts > kPlanMaxPartsIn64KB) return cudaErrorInvalidValue;
  using namespace sm90_sparse_e4m3;
  constexpr int smem = int(sizeof(Smem));
  static_assert(smem <= 227 * 1024, "the stages, Q and P' fit an sm90 block");
  static_assert(2 * sizeof(Stage) >= 65536, "two stages hold the planner's part costs");
  cudaError_t err = raise_smem_limit_once<sparse_decode_e4m3_kernel>(smem, "the sm90 e4m3 sparse kernel");
  if (err != cudaSuccess) return err;
  err = launch_dependent(sparse_decode_e4m3_kernel, dim3(1, unsigned(p.s_q), unsigned(p.split.num_sm_parts)),
                         kThreads, smem, stream, p);
  if (err != cudaSuccess) return err;
  return combine(combine_params(p.b, p.s_q, p.h_q, p.split, p.o, p.attn_sink), stream, /*pdl=*/true);
}

}  // namespace mla::cuda
