// Thin wrappers around the Hopper (sm_90a) PTX the sm90 kernels use: mbarriers, TMA tile loads,
// named barriers, proxy fences and warpgroup MMA (wgmma) with shared-memory matrix descriptors.
//
// Shared-memory tiles are 64 rows x 128 bytes in the 128-byte swizzle TMA writes: the 16-byte
// chunk c of row r sits at chunk c ^ (r % 8). A descriptor names such a tile by its start address,
//   K-major operand (rows x K, K contiguous): stride between 8-row groups (SBO) = 1024 bytes;
//     the k16 steps inside a tile advance the start address by 32 bytes;
//   MN-major operand (K rows x N, N contiguous; the V of P V): LBO = bytes between 64-column
//     tiles, SBO = 1024 bytes between 8-row groups; k16 steps advance by 16 rows = 2048 bytes.
// The kernel bodies compile only for sm_90a; elsewhere they are never launched.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLA_SM90A_DEVICE 1
#endif

namespace mla::cuda::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers and TMA --------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// One arrival (no transaction bytes) on the mbarrier.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// One box of a 4-D tensor map into shared memory, completing on `bar`, under an L2 cache policy
// (from createpolicy, or the policy word below).
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// A policy word: evict_unchanged over no fraction of the lines, so the loads leave a line's L2
// priority as it is (normal for a line they bring in). On the H200 createpolicy returns 0x12F0..
// for evict_first, 0x16F0.. for evict_normal and 0x10F0.. for evict_unchanged (the first byte names
// the priority, the next nibble the fraction: F for 1.0, 7 for 0.5). Keys loaded under
// createpolicy's evict_normal were slower than under this word (bench/RESULTS.md, thirty-second
// session).
constexpr uint64_t kL2DefaultPriorityPolicy = 0x1000000000000000ull;
__device__ __forceinline__ uint64_t evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// ---- barriers and fences -------------------------------------------------------------------------

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// 2^x in one MUFU.EX2, results below 2^-126 flushed to zero; exp2(-inf) = 0. exp2f adds a range
// fix-up per call for subnormal results (a compare, a scale and predicate shuffling around every
// element of a softmax), which softmax weights never need.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// Ordinary shared-memory writes become visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// 16 bytes global -> shared without a register round trip (L2 only); bytes past src_bytes (0 or 16)
// are zero-filled. All of a thread's copies complete at cp_async_wait_all().
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// One arrival on `bar` once every cp.async this thread issued before has landed; the arrival is
// one of the barrier's expected count (noinc). Whoever waits for the phase sees the copied bytes.
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// ---- registers between warpgroups ---------------------------------------------------------------

// Every thread of the warpgroup raises (inc) or lowers (dec) its register count to kRegs (a
// multiple of 8); the CTA's registers only move between its warpgroups.
template <int kRegs>
__device__ __forceinline__ void set_max_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void set_max_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- thread-block clusters ------------------------------------------------------------------------

__device__ __forceinline__ int cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return int(r);
}
// Every thread of every CTA of the cluster arrives and waits; what each wrote before (shared memory
// of any CTA of the cluster included) is visible to all after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The shared::cluster address of the same shared-memory location in CTA `rank` of the cluster
// (linear: the address of p + n is this plus n).
__device__ __forceinline__ uint32_t peer_addr(const void* p, int rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem_addr(p)), "r"(rank));
  return out;
}
// One arrival on an mbarrier of another CTA of the cluster (`bar` from peer_addr).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// A 4-byte store into another CTA's shared memory (`dst`, `bar` from peer_addr) that completes its
// bytes on that CTA's mbarrier `bar`: whoever waits for the barrier's phase sees it, with no fence
// or cluster-scope acquire (the mbarrier's owner expects the bytes with mbar_expect_tx).
__device__ __forceinline__ void st_async_4(uint32_t dst, uint32_t v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(dst), "r"(v),
               "r"(bar)
               : "memory");
}

// The same for 16 bytes (dst 16-byte aligned).
__device__ __forceinline__ void st_async_16(uint32_t dst, float4 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(dst),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
               : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) of this CTA's shared memory copied by
// the bulk-copy engine into another CTA's (`dst`, `bar` from peer_addr), completing on its mbarrier
// `bar` like st.async. The source must have been written before a fence_proxy_async by every writer.
__device__ __forceinline__ void bulk_copy_to_peer(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "r"(smem_addr(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// ---- wgmma ----------------------------------------------------------------------------------------

__device__ __forceinline__ uint64_t smem_desc(const void* tile, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t addr = smem_addr(tile);
  uint64_t d = uint64_t((addr & 0x3FFFF) >> 4);
  d |= uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= uint64_t(1) << 62;  // 128-byte swizzle
  // Built where it is used: hoisted out of the loops, a kernel's few dozen descriptors would hold
  // 64-bit registers for its whole life.
  asm volatile("mov.b64 %0, %0;\n" : "+l"(d));
  return d;
}

// The descriptor of the same layout `bytes` further on (a multiple of 16): the start address is
// the low field, and shared-memory addresses stay below 256 KB, so the sum never carries out of it.
__device__ __forceinline__ uint64_t desc_offset(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 64, fp32) += A (smem, K-major) * B^T (smem, K-major): S = Q K^T.
template <typename T>
__device__ void wgmma_ss_k(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d);
// D (64 x 256) += A (smem, K-major) * B (smem, MN-major): O += P V with P from shared memory.
template <typename T>
__device__ void wgmma_ss_v(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d);
// D (64 x 64) += A (registers) * B^T (smem, K-major).
template <typename T>
__device__ void wgmma_rs_k(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d);
// D (64 x 256) += A (registers) * B (smem, MN-major): O += P V with P in registers.
template <typename T>
__device__ void wgmma_rs_v(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b, int scale_d);

// D (64 x N, fp32, N = 16 or 32) += A (smem, 64 x 16) * B (smem, N x 16, K-major), with A K-major
// (TransA = 0: S^T = K Q^T) or MN-major (TransA = 1: O^T = V^T P^T, V stored key-major).
template <typename T, int N, int TransA>
__device__ void wgmma_ss_small(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d);
// The same with A (64 x 16) from registers: a[0] rows g, k 2 t4 .. + 1; a[1] row g + 8; a[2] row g,
// k + 8; a[3] row g + 8, k + 8 (g = lane / 4 + 16 warp, t4 = lane % 4), two 16-bit elements each.
template <typename T, int N>
__device__ void wgmma_rs_small(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d);

#if defined(MLA_SM90A_DEVICE)
// The instruction forms, one per shape and operand source, each written once for both 16-bit
// element types (PTX wants every accumulator register named).
#define MLA_WGMMA_REGS32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MLA_WGMMA_REGS128 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MLA_WGMMA_ACC32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MLA_WGMMA_ACC128 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// S = Q K^T: m64n64k16, A and B from shared memory, both K-major.
#define MLA_WGMMA_SS_K(T, PT)                                                                          \
  template <>                                                                                          \
  __device__ __forceinline__ void wgmma_ss_k<T>(float(&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                           \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PT "." PT " {" MLA_WGMMA_REGS32          \
                 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                                     \
                 : MLA_WGMMA_ACC32                                                                     \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                            \
  }
// O += P V: m64n256k16, P from shared memory (K-major), V from shared memory (MN-major).
#define MLA_WGMMA_SS_V(T, PT)                                                                          \
  template <>                                                                                          \
  __device__ __forceinline__ void wgmma_ss_v<T>(float(&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PT "." PT " {" MLA_WGMMA_REGS128        \
                 "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                                   \
                 : MLA_WGMMA_ACC128                                                                    \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                            \
  }
// m64n64k16 with A from registers, B K-major.
#define MLA_WGMMA_RS_K(T, PT)                                                                          \
  template <>                                                                                          \
  __device__ __forceinline__ void wgmma_rs_k<T>(float(&d)[32], const uint32_t(&a)[4], uint64_t desc_b, int scale_d) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                           \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PT "." PT " {" MLA_WGMMA_REGS32          \
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                       \
                 : MLA_WGMMA_ACC32                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));             \
  }
// O += P V: m64n256k16, P from registers, V MN-major.
#define MLA_WGMMA_RS_V(T, PT)                                                                          \
  template <>                                                                                          \
  __device__ __forceinline__ void wgmma_rs_v<T>(float(&d)[128], const uint32_t(&a)[4], uint64_t desc_b, int scale_d) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PT "." PT " {" MLA_WGMMA_REGS128        \
                 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                                  \
                 : MLA_WGMMA_ACC128                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));             \
  }


// Small-N forms (m64n16k16, m64n32k16), both operands in shared memory, A K-major (TA 0) or
// MN-major (TA 1).
#define MLA_WGMMA_REGS8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define MLA_WGMMA_REGS16 MLA_WGMMA_REGS8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define MLA_WGMMA_ACC8 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define MLA_WGMMA_ACC16 \
  MLA_WGMMA_ACC8, "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
// N = 16: accumulators %0-%7, descriptors %8, %9, scale %10; N = 32: %0-%15, %16, %17, %18.
#define MLA_WGMMA_SS_SMALL(T, PT, N, TA, REGS, ACC, A, B, SCALE)                                          \
  template <>                                                                                             \
  __device__ __forceinline__ void wgmma_ss_small<T, N, TA>(float(&d)[N / 2], uint64_t desc_a, uint64_t desc_b, \
                                                           int scale_d) {                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                      \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT " {" REGS "}, " A ", " B     \
                 ", p, 1, 1, " #TA ", 0;\n}\n"                                                             \
                 : ACC                                                                                    \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                               \
  }
// N = 16 (the only form used): accumulators %0-%7, A %8-%11, descriptor %12, scale %13.
#define MLA_WGMMA_RS_SMALL(T, PT, N, REGS, ACC, A, B, SCALE)                                               \
  template <>                                                                                             \
  __device__ __forceinline__ void wgmma_rs_small<T, N>(float(&d)[N / 2], const uint32_t(&a)[4], uint64_t desc_b, \
                                                       int scale_d) {                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                      \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PT "." PT " {" REGS "}, " A ", " B     \
                 ", p, 1, 1, 0;\n}\n"                                                                      \
                 : ACC                                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));                \
  }
MLA_WGMMA_RS_SMALL(__nv_bfloat16, "bf16", 16, MLA_WGMMA_REGS8, MLA_WGMMA_ACC8, "{%8, %9, %10, %11}", "%12", "%13")
#undef MLA_WGMMA_RS_SMALL
MLA_WGMMA_SS_SMALL(__nv_bfloat16, "bf16", 16, 0, MLA_WGMMA_REGS8, MLA_WGMMA_ACC8, "%8", "%9", "%10")
MLA_WGMMA_SS_SMALL(__half, "f16", 16, 0, MLA_WGMMA_REGS8, MLA_WGMMA_ACC8, "%8", "%9", "%10")
MLA_WGMMA_SS_SMALL(__nv_bfloat16, "bf16", 16, 1, MLA_WGMMA_REGS8, MLA_WGMMA_ACC8, "%8", "%9", "%10")
MLA_WGMMA_SS_SMALL(__half, "f16", 16, 1, MLA_WGMMA_REGS8, MLA_WGMMA_ACC8, "%8", "%9", "%10")
MLA_WGMMA_SS_SMALL(__nv_bfloat16, "bf16", 32, 0, MLA_WGMMA_REGS16, MLA_WGMMA_ACC16, "%16", "%17", "%18")
MLA_WGMMA_SS_SMALL(__half, "f16", 32, 0, MLA_WGMMA_REGS16, MLA_WGMMA_ACC16, "%16", "%17", "%18")
MLA_WGMMA_SS_SMALL(__nv_bfloat16, "bf16", 32, 1, MLA_WGMMA_REGS16, MLA_WGMMA_ACC16, "%16", "%17", "%18")
MLA_WGMMA_SS_SMALL(__half, "f16", 32, 1, MLA_WGMMA_REGS16, MLA_WGMMA_ACC16, "%16", "%17", "%18")

MLA_WGMMA_SS_K(__nv_bfloat16, "bf16")
MLA_WGMMA_SS_K(__half, "f16")
MLA_WGMMA_SS_V(__nv_bfloat16, "bf16")
MLA_WGMMA_SS_V(__half, "f16")
MLA_WGMMA_RS_K(__nv_bfloat16, "bf16")
MLA_WGMMA_RS_K(__half, "f16")
MLA_WGMMA_RS_V(__nv_bfloat16, "bf16")
MLA_WGMMA_RS_V(__half, "f16")

#undef MLA_WGMMA_SS_SMALL
#undef MLA_WGMMA_REGS8
#undef MLA_WGMMA_REGS16
#undef MLA_WGMMA_ACC8
#undef MLA_WGMMA_ACC16
#undef MLA_WGMMA_SS_K
#undef MLA_WGMMA_SS_V
#undef MLA_WGMMA_RS_K
#undef MLA_WGMMA_RS_V
#undef MLA_WGMMA_REGS32
#undef MLA_WGMMA_REGS128
#undef MLA_WGMMA_ACC32
#undef MLA_WGMMA_ACC128
#endif  // MLA_SM90A_DEVICE

}  // namespace mla::cuda::sm90
