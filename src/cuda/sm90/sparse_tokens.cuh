// The producer side of the Hopper sparse kernels: where a token of a plan block lives, its FP8
// record loaded by kParts threads (each a contiguous part of its NoPE dims and of its RoPE), and
// that part dequantised to bf16 (exactly as the reference: e4m3 * scale rounded to bf16; RoPE
// copied) into one row of a 64 x D key buffer in the 128-byte swizzle.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "../common/decode_io.cuh"
#include "../common/fp8.cuh"
#include "mla/params.h"
#include "mla/plan.h"
#include "mla/sparse_slots.h"

namespace mla::cuda::sm90 {

constexpr int kSparseTileBytes = 64 * 128;  // a 64 x 64 tile of bf16

template <KvFormat F>
struct SparseFormat {
  static constexpr bool kV32 = F == KvFormat::kV32;
  static constexpr int kD = kV32 ? 576 : 512;
  static constexpr int kNope = kV32 ? 512 : 448;          // FP8 dims
  static constexpr int kRecordBytes = kV32 ? 656 : 576;   // bytes of a token inside its page block
  static constexpr int kRopeOffset = kV32 ? 528 : 448;    // bytes into the record
  static constexpr int kScaleTile = kV32 ? 128 : 64;      // dims per scale
};

// A token of a plan block: its index (-1 past the list's valid length) and whether it indexes the
// extra cache. The index stays 32-bit as loaded, so that locating a token a step ahead issues its
// load without waiting for it (widening it there would wait at once); the cache is a flag, so
// that its fields come from the kernel parameters, not through a pointer (a load per token).
struct TokenRef {
  int32_t tok;
  bool extra;
};

// A CTA's blocks in order, across its part's pieces, as a producer walks them: request i, plan
// block blk, and the request's lengths (read once per piece, not per block). advance() moves to
// the next block (the first one from the initial state) and says whether there is one; every
// thread of a warp calls it together.
struct BlockWalk {
  int num_pieces, s;  // the CTA's pieces, its query row
  int k = -1, i = 0, blk = 0, blk_end = 0;
  SparseRequestLens lens{};
  __device__ bool advance(const SparseDecodeParams& p, const DecodePlanParams& plan, int part) {
    ++blk;
    while (blk >= blk_end) {
      if (++k >= num_pieces) return false;
      const PlanPiece pc = decode_io::piece(p.split, plan, part, k);
      i = __shfl_sync(0xffffffffu, pc.req, 0);
      blk = __shfl_sync(0xffffffffu, pc.block_begin, 0);
      blk_end = __shfl_sync(0xffffffffu, pc.block_end, 0);
      lens = sparse_request_lens(plan, i);
    }
    return true;
  }
  // The token in slot t of the current block.
  __device__ TokenRef locate(const SparseDecodeParams& p, int t) const {
    const SparseBlockSlots src = sparse_block_slots(p, lens, i, s, blk);
    const int slot = src.slot0 + t;
    int32_t tok = -1;
    if (slot < src.len) tok = src.indices[slot];
    return {tok, src.cache != &p.kv};
  }
};

// A producer thread's steps: kRounds rounds of every block of its walk. It locates the token of a
// step (reads its index) one step before it loads the token's record, so that the record's loads
// never wait for the index: cur's record is dequantised while next's is in flight and the index
// of the step after next is read.
template <int kRounds>
struct RoundWalk {
  BlockWalk blocks;
  int round = kRounds - 1;
  __device__ bool advance(const SparseDecodeParams& p, const DecodePlanParams& plan, int part) {
    if (++round < kRounds) return true;
    round = 0;
    return blocks.advance(p, plan, part);
  }
};

// Part `part` of kParts of a token's record as loaded. The parts interleave by 16-byte chunk
// (chunk c of the part is chunk c * kParts + part of the record), so the kParts threads of a token
// read kParts x 16 contiguous bytes per load: NoPE chunks of 16 e4m3 dims, RoPE chunks of 8 bf16
// dims, and all the token's scales (V3.2: four float32, one per 128-dim tile; MODEL1: eight UE8M0
// bytes, one per 64-dim tile).
template <KvFormat F, int kParts>
struct TokenPart {
  using Fm = SparseFormat<F>;
  static constexpr int kNopeChunks = Fm::kNope / kParts / 16;
  static constexpr int kRopeChunks = 8 / kParts;
  static_assert(Fm::kNope % (kParts * 16) == 0 && 8 % kParts == 0, "parts of whole chunks");
  // A part's chunk c lies in scale tile c * kParts * 16 / kScaleTile whatever the part: the kParts
  // chunks c * kParts .. + kParts - 1 never straddle a tile.
  static_assert((Fm::kScaleTile / 16) % kParts == 0, "interleaved chunks stay inside their scale tile");
  bool ok;
  uint4 nope[kNopeChunks];
  uint4 rope[kRopeChunks];
  uint32_t scales[Fm::kV32 ? 4 : 2];
};

// 16 bytes of a record, read once, under the L2 cache policy `policy` (createpolicy); not kept in L1
// with kNoAllocate.
template <bool kNoAllocate>
__device__ __forceinline__ uint4 load_record16(const void* a, uint64_t policy) {
  uint4 v;
  if constexpr (kNoAllocate) {
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(a), "l"(policy));
  } else {
    asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(a), "l"(policy));
  }
  return v;
}

// Loads `part` of the token `ref` names. Indices outside the cache are invalid: nothing is read.
// The 16-byte loads (V3.2's scales among them) go under the L2 policy `policy`; a MODEL1 record in a
// page block only 8-byte aligned, and MODEL1's 8-byte scales, load without it. kNoAllocate: the
// 16-byte loads bypass L1 allocation.
template <KvFormat F, int kParts, bool kNoAllocate = false>
__device__ __forceinline__ TokenPart<F, kParts> load_token_part(const SparseDecodeParams& p, const TokenRef& ref,
                                                                int part, uint64_t policy) {
  using Fm = SparseFormat<F>;
  using TP = TokenPart<F, kParts>;
  TP r;
  const SparseKvCache& cache = ref.extra ? p.extra_kv : p.kv;
  const int64_t tok = ref.tok;
  r.ok = sparse_token_in_cache(cache, tok);
  if (!r.ok) {  // all zero, so that it dequantises to zero without a branch
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (uint4& v : r.nope) v = zero;
    for (uint4& v : r.rope) v = zero;
    for (uint32_t& v : r.scales) v = 0;
    return r;
  }
  // A valid index is a non-negative int32, so 32-bit unsigned division is exact (and far cheaper
  // than the 64-bit one).
  const uint32_t page = uint32_t(cache.page_block_size);
  const uint8_t* block = cache.data + int64_t(uint32_t(ref.tok) / page) * cache.stride_block;
  const int off = int(uint32_t(ref.tok) % page);
  const uint8_t* rec = block + int64_t(off) * Fm::kRecordBytes;
  // MODEL1 records are 576 = 36 x 16 bytes apart, so they are 16-byte aligned wherever their page
  // block is (a cache whose base and block stride are multiples of 16, as allocators give): one
  // 16-byte load per chunk then, two 8-byte ones otherwise. V3.2 records are always aligned.
  static_assert(Fm::kRecordBytes % 16 == 0, "records are 16-byte multiples");
  const bool aligned = Fm::kV32 || (reinterpret_cast<uintptr_t>(block) & 15) == 0;
  auto load16 = [&](const uint8_t* a) {
    return aligned ? load_record16<kNoAllocate>(a, policy) : fp8::load16_align8(a);
  };
#pragma unroll
  for (int c = 0; c < TP::kNopeChunks; ++c) r.nope[c] = load16(rec + (c * kParts + part) * 16);
#pragma unroll
  for (int c = 0; c < TP::kRopeChunks; ++c) r.rope[c] = load16(rec + Fm::kRopeOffset + (c * kParts + part) * 16);
  if constexpr (Fm::kV32) {
    const uint4 v = load_record16<false>(rec + Fm::kNope, policy);
    r.scales[0] = v.x, r.scales[1] = v.y, r.scales[2] = v.z, r.scales[3] = v.w;
  } else {
    const uint2 v =
        __ldg(reinterpret_cast<const uint2*>(block + int64_t(cache.page_block_size) * 576 + int64_t(off) * 8));
    r.scales[0] = v.x, r.scales[1] = v.y;
  }
  return r;
}

// Dequantises r into row t of a key buffer (bf16, 128-byte swizzle); an invalid token's part of
// the row is zero (its part is all zero bits, and e4m3 zero times a zero scale is +0). `tiles`:
// the buffer's 64 x 64 tiles.
//
// The offsets are a few per-thread constants, not computed per store: with g = c kParts + part
// (kParts divides 4, so c kParts and part have no bit in common), NoPE chunk c covers the 8-dim
// groups 2 (g % 4) and 2 (g % 4) + 1 of tile g / 4 = c kParts / 4, i.e. group K ^ 2 part with K a
// compile-time constant; RoPE chunk c is group c kParts ^ part of the last tile. The swizzle XORs
// the group with t % 8, so each offset is t * 128 + ((K ^ x) << 4) with x fixed per thread.
template <KvFormat F, int kParts>
__device__ __forceinline__ void store_token_part(const TokenPart<F, kParts>& r, uint8_t (*tiles)[kSparseTileBytes],
                                                 int t, int part) {
  auto put = [&](int tile, int off, const uint4& v) { *reinterpret_cast<uint4*>(tiles[tile] + off) = v; };
  using Fm = SparseFormat<F>;
  using TP = TokenPart<F, kParts>;
  static_assert(4 % kParts == 0 && Fm::kNope % 64 == 0, "a part's chunk groups are a constant XOR its part");
  const int row = t * 128, x_nope = (2 * part) ^ (t & 7), x_rope = part ^ (t & 7);
#pragma unroll
  for (int c = 0; c < TP::kNopeChunks; ++c) {
    float scale;
    if constexpr (Fm::kV32) {
      scale = __uint_as_float(r.scales[c * kParts * 16 / Fm::kScaleTile]);
    } else {
      const int tile = c * kParts * 16 / Fm::kScaleTile;
      scale = fp8::ue8m0(uint8_t((tile < 4 ? r.scales[0] >> (8 * tile) : r.scales[1] >> (8 * (tile - 4))) & 0xff));
    }
    const int k0 = 2 * ((c * kParts) % 4);
    put(c * kParts / 4, row + ((k0 ^ x_nope) << 4), fp8::dequant8_bf16(make_uint2(r.nope[c].x, r.nope[c].y), scale));
    put(c * kParts / 4, row + (((k0 + 1) ^ x_nope) << 4),
        fp8::dequant8_bf16(make_uint2(r.nope[c].z, r.nope[c].w), scale));
  }
#pragma unroll
  for (int c = 0; c < TP::kRopeChunks; ++c) put(Fm::kNope / 64, row + (((c * kParts) ^ x_rope) << 4), r.rope[c]);
}

}  // namespace mla::cuda::sm90
