// The decode planner run by the kThreads threads of one CTA, one thread per request (in rounds of
// kThreads for larger batches): by the planner kernel, for every row, and by attention kernels that
// plan for themselves, each CTA for its own part's row (the same computation, so the rows agree).
// The costs are summed and the rows set idle; a scan of the costs gives each request its position
// on the line (plan.h), from which each thread marks the widths that would cut its request and adds
// its units to the part it would fall in at each width (part_cost), to rule out widths that leave a
// part over the bound; with the width chosen, each thread writes the rows its request begins or
// ends, and a second scan turns the piece counts into num_splits (every caller writes all of them,
// the same values; in the closed form below a CTA planning for its own part writes only those its
// pieces read and a 1 / num_sm_parts share: writes_split). The same functions (plan.h) make the
// host plan, so device and host plans are identical. One implementation, plan_line(), instantiated
// for 32-bit positions (lines under 2^31 units; divisions by the few candidate widths as a
// multiply-high) and for 64-bit ones (any line); the scans are warp shuffles and two barriers. A
// call whose requests all have the same blocks (sparse, without per-request lengths: the usual V3.2
// call) takes plan_uniform(), the same plan in closed form: checks per (width, part) instead of a
// pass over the requests, one barrier, and the piece-count scan only where the width cuts requests;
// or the even split of plan_even_pieces (both planners, and the host's, take it alike). H100, whole
// V3.2 calls (forty-third session): 2.6 us faster at b=128 h_q=16, 2.2 at b=64 h_q=32, 3.5 at b=128
// h_q=128.
// A kernel launched as a programmatic dependent (PDL) may start planning before the grid it depends
// on has finished: the planner waits for it (griddepcontrol.wait) before it first touches global
// memory, which in the closed form is once the plan is made, so the plan is made under the previous
// kernel's tail.
#pragma once

#include "mla/plan.h"

// Timing aid: a kernel's translation unit may define MLA_PLAN_STAMP(phase) before including this
// header to stamp the end of each of plan_line's phases (0: its start, 1: costs summed, 2: part
// costs cleared, 3: part costs added, 4: widths ruled out, 5: rows and num_splits made); the dense
// sm90 kernel's MLA_DENSE_TIMELINE build does.
#ifndef MLA_PLAN_STAMP
#define MLA_PLAN_STAMP(phase)
#endif

namespace mla::cuda {

// Parts whose costs fit 64 KB (the smallest key buffer of the attention kernels that plan in it):
// more than any GPU has SMs. The dispatcher plans elsewhere beyond it; the kernels check it.
constexpr int kPlanMaxPartsIn64KB = 65536 / (kPlanWidthChoices * 8);

// Waits for the grids this kernel depends on to finish and their writes to be visible (a no-op where
// it was not launched as a programmatic dependent). The planner touches nothing in global memory
// before it: the previous kernel may still read the last plan, or write this call's lengths.
__device__ __forceinline__ void wait_for_prior_grids() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Whether the CTA planning for `only_part` (< 0: every part) writes num_splits[i]: every entry where
// it plans every part; else the entries [lo, hi] its own pieces read and every num_sm_parts-th entry
// from only_part, so that the parts together write all b + 1 (a CTA reads only what it wrote; the
// combine reads them all once the grid is done). Every CTA writing all of them put b + 1 stores
// from every CTA into the same lines.
__device__ __forceinline__ bool writes_split(int i, int only_part, int parts, int lo, int hi) {
  return only_part < 0 || (i >= lo && i <= hi) || i % parts == only_part;
}

template <int kThreads>
struct BlockPlanner {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  static constexpr int kWarps = kThreads / 32;
  struct Scratch {
    unsigned unfit;
    PlanRow row;                          // row only_part, made here and stored once with its final values
    union {                               // the scans' warp totals, 32- or 64-bit
      unsigned u32[kWarps];
      unsigned long long u64[kWarps];
    } warp_sum;
    unsigned long long warp_total[kWarps];
  };
  // Bytes of part_cost, [width choice][part]: the units of the requests each part would run.
  static size_t part_cost_bytes(int num_sm_parts) {
    return size_t(kPlanWidthChoices) * size_t(num_sm_parts) * sizeof(unsigned long long);
  }

  // An attention kernel's prologue with a fresh plan: plans for `part` with its (not yet used) key
  // buffers as scratch, `scratch` for Scratch and `costs` for the part costs (64 KB at least: at
  // most kPlanMaxPartsIn64KB parts). Returns after wait_for_prior_grids. Ends with the proxy fence
  // (TMA or a peer's bulk copies write the same bytes next); the caller synchronises after.
  __device__ static void run_in(const DecodePlanParams& p, int part, void* scratch, void* costs) {
    // A copy for the out-of-line planner: the kernel's own params stay in registers.
    const DecodePlanParams copy = p;
    plan(copy, part, *reinterpret_cast<Scratch*>(scratch), costs);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }

  // Plans p: num_splits and every row (only_part < 0) or row only_part alone (made in shared memory
  // and stored once with its final values, so that CTAs of one part, which store the same row,
  // never expose an idle or half-made one to each other). Every thread of the CTA calls it; the
  // caller synchronises the CTA before it reads what was written. `costs` holds part_cost_bytes().
  // Lines under 2^31 units (any batch a GPU holds) take 32-bit positions and divide by the
  // candidate widths with a multiply-high (PlanInvariantDiv); longer ones 64-bit positions and
  // divisions. The same code either way, and the same plan as the host's. Returns after
  // wait_for_prior_grids: plan_uniform, which reads nothing but p, waits before its first store; the
  // line planners, which read the lengths, before they start.
  __device__ static void plan(const DecodePlanParams& p, int only_part, Scratch& sc, void* costs) {
    if (plan_uniform_requests(p) && plan_uniform(p, only_part, sc)) return;
    wait_for_prior_grids();
    if (!plan_line<unsigned, PlanInvariantDiv>(p, only_part, sc, costs)) run_general(p, only_part, sc, costs);
  }
  // The 64-bit planner for any line (plan() takes it past 2^31 units; tests call it directly).
  __device__ static void run_general(const DecodePlanParams& p, int only_part, Scratch& sc, void* costs) {
    plan_line<unsigned long long, PlanDiv>(p, only_part, sc, costs);
  }

  // The plan of b requests of u units each (plan_line's plan, made without its per-request pass):
  // request i spans units [i u, (i + 1) u) of the line and its blocks [i u + f, (i + 1) u). Width w
  // cuts a request where a part boundary k w (0 < k w < b u) falls at more than f units into it, and
  // part k runs the requests whose first block unit lies in [k w, (k + 1) w); both are checked per
  // (width, part), not per request. A part's row follows from its first and last request, and with
  // no request cut num_splits is 0, 1, .., b; else a scan of the piece counts makes it, as in
  // plan_line. Divisions by u and by w only, as multiply-highs. Returns false, having written
  // nothing, for a line of 2^31 units or more (the general planner makes those).
  __device__ __noinline__ static bool plan_uniform(const DecodePlanParams& p, int only_part, Scratch& sc) {
    const PlanUniformLine line = plan_uniform_line(p);
    if (!line.ok) return false;
    const int tid = threadIdx.x, f = line.f, parts = p.num_sm_parts, b = p.b, blocks = line.blocks;
    const unsigned u = line.u, total = line.total, w0 = line.w0;
    const PlanInvariantDiv by_u(u);
    // Bit c: width w0 + c cuts a request or leaves a part costing more than w0 + f.
    unsigned unfit = 0;
#pragma unroll 1
    for (int k = tid; k < (f + 1) * parts; k += kThreads) {
      const int c = k / parts, part = k - c * parts;
      if (plan_uniform_unfit(by_u, u, total, w0, f, b, c, part)) unfit |= 1u << c;
    }
    unfit = __reduce_or_sync(0xffffffffu, unfit);
    if (tid % 32 == 0) sc.warp_total[tid / 32] = unfit;
    __syncthreads();
    unfit = 0;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) unfit |= unsigned(sc.warp_total[k]);
    const unsigned w = unsigned(plan_choose_width(w0, unfit, f));
    const bool whole = !(unfit >> (w - w0) & 1u);  // no request cut (the width fits)
    if (const int k = plan_even_for(p, f, w0, unfit, w); k > 0) {
      wait_for_prior_grids();
      write_even_split(p, only_part, blocks, k);
      return true;
    }
    const PlanInvariantDiv by_w(w);

    // Rows: part j runs requests i0 = floor(j w / u) (the one holding its first unit) to i1, the
    // last whose first block unit is under (j + 1) w; those two write every field a row has
    // (plan_request_by). Its pieces read num_splits [i0, i1 + 1].
    auto requests_of = [&](int j, int& i0, int& i1) {
      const unsigned at = unsigned(j) * w, end = at + w - 1;
      i0 = int(by_u(at));
      i1 = end >= unsigned(f) ? min(int(by_u(end - f)), b - 1) : -1;
    };
    auto make_row = [&](int j) {
      __builtin_assume(j >= 0);  // plan_request_by writes `row` alone, never the rows in memory
      PlanRow row = plan_idle(b);
      int i0, i1;
      requests_of(j, i0, i1);
#pragma unroll 1
      for (int i = i0; i <= i1; i = i < i1 ? i1 : i1 + 1)
        plan_request_by(by_w, p, i, (long long)i * u, blocks, w, j, &row);
      return row;
    };
    int lo = 0, hi = b;  // writes_split's range
    if (only_part >= 0) {
      requests_of(only_part, lo, hi);
      ++hi;
      PlanRow row;  // made by thread 0 before the wait, stored after it
      if (tid == 0) row = make_row(only_part);
      wait_for_prior_grids();
      if (tid == 0) reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)[only_part] = row;
    } else {
      wait_for_prior_grids();
#pragma unroll 1
      for (int j = tid; j < parts; j += kThreads)
        reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)[j] = make_row(j);
    }

    if (tid == 0 && writes_split(0, only_part, parts, lo, hi)) p.num_splits[0] = 0;
    if (whole) {
#pragma unroll 1
      for (int i = tid + 1; i <= b; i += kThreads)
        if (writes_split(i, only_part, parts, lo, hi)) p.num_splits[i] = i;
      return true;
    }
    unsigned pieces_base = 0;
#pragma unroll 1
    for (int round = 0; round < b; round += kThreads) {
      const int i = round + tid;
      const unsigned start = unsigned(i) * u;
      const unsigned pieces = i < b ? unsigned(by_w(start + u - 1) - by_w(start + f)) + 1u : 0u;
      unsigned round_pieces;
      const unsigned before = exclusive_sum(pieces, sc, round_pieces);
      if (i < b && writes_split(i + 1, only_part, parts, lo, hi))
        p.num_splits[i + 1] = int(pieces_base + before + pieces);
      pieces_base += round_pieces;
    }
    return true;
  }

  // The even split (plan_even_pieces: part j runs piece j % k of request j / k): row only_part, or
  // every row, and num_splits (part j's piece reads entries j / k and j / k + 1).
  __device__ static void write_even_split(const DecodePlanParams& p, int only_part, int blocks, int k) {
    const int tid = threadIdx.x;
    const int j_first = only_part >= 0 ? (tid == 0 ? only_part : p.num_sm_parts) : tid;
    const int j_end = only_part >= 0 ? only_part + 1 : p.num_sm_parts;
#pragma unroll 1
    for (int j = j_first; j < j_end; j += kThreads)
      reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)[j] = plan_even_row(p.b, blocks, k, j);
    const int lo = only_part / k;
#pragma unroll 1
    for (int i = tid; i <= p.b; i += kThreads)
      if (writes_split(i, only_part, p.num_sm_parts, lo, lo + 1)) p.num_splits[i] = i * k;
  }

  // The sum of v over the CTA, in every thread.
  __device__ static unsigned long long block_sum(unsigned long long v, Scratch& sc) {
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
    if (threadIdx.x % 32 == 0) sc.warp_total[threadIdx.x / 32] = v;
    __syncthreads();
    unsigned long long all = 0;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) all += sc.warp_total[k];
    return all;
  }

  // The exclusive prefix sum of v over the CTA in thread order, and the CTA's total in `total`.
  template <typename Pos>
  __device__ static Pos exclusive_sum(Pos v, Scratch& sc, Pos& total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    Pos* warp_sum;
    if constexpr (sizeof(Pos) == 8) warp_sum = sc.warp_sum.u64;
    else warp_sum = sc.warp_sum.u32;
    Pos x = v;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const Pos y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane >= d) x += y;
    }
    if (lane == 31) warp_sum[warp] = x;
    __syncthreads();
    Pos before = 0, all = 0;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) {
      const Pos s = warp_sum[k];
      before += k < warp ? s : Pos(0);
      all += s;
    }
    __syncthreads();  // warp_sum is free for the next scan
    total = all;
    return before + x - v;
  }

  // The planner, one thread per request in rounds of kThreads, with positions on the line in Pos
  // (unsigned or unsigned long long) and Div dividing a position by a width. With 32-bit positions
  // it returns false, having written nothing, for a line of 2^31 units or more.
  template <typename Pos, typename Div>
  __device__ __noinline__ static bool plan_line(const DecodePlanParams& p, int only_part, Scratch& sc, void* costs) {
    MLA_PLAN_STAMP(0);
    Pos* part_cost = reinterpret_cast<Pos*>(costs);
    const int tid = threadIdx.x, f = plan_fixed(p), parts = p.num_sm_parts;
    if (p.b <= 0) return false;
    const int blocks_first = tid < p.b ? request_blocks(p, tid) : 0;
    unsigned long long cost = tid < p.b ? plan_units(blocks_first, f) : 0;
#pragma unroll 1
    for (int i = tid + kThreads; i < p.b; i += kThreads) cost += plan_units(request_blocks(p, i), f);
    const unsigned long long total = block_sum(cost, sc);
    MLA_PLAN_STAMP(1);
    if (sizeof(Pos) < 8 && total >= (1ull << 31)) return false;
    // plan_width (with 32-bit positions total + parts - 1 < 2^32).
    const Pos w0 = (Pos(total) + Pos(parts) - 1) / Pos(parts);
    if (tid == 0) {
      sc.unfit = 0;
      p.num_splits[0] = 0;
      if (only_part >= 0) sc.row = plan_idle(p.b);
    }
    if (only_part < 0)
#pragma unroll 1
      for (int part = tid; part < parts; part += kThreads) plan_idle_row(p, part);
#pragma unroll 1
    for (int k = tid; k < kPlanWidthChoices * parts; k += kThreads) part_cost[k] = 0;
    Div by[kPlanWidthChoices];  // by[c] divides by W + c
#pragma unroll
    for (int c = 0; c < kPlanWidthChoices; ++c) by[c] = Div(w0 + Pos(c));
    __syncthreads();  // sc.unfit, the idle rows, part_cost
    MLA_PLAN_STAMP(2);

    // Each request's position on the line, the widths that cut it and its units in part_cost.
    Pos start_first = 0, units_first = 0, base = 0;
    unsigned cuts = 0;
#pragma unroll 1
    for (int round = 0; round < p.b; round += kThreads) {
      const int i = round + tid;
      const int blocks = round == 0 ? blocks_first : i < p.b ? request_blocks(p, i) : 0;
      const Pos units = i < p.b ? Pos(plan_units(blocks, f)) : Pos(0);
      Pos round_units;
      const Pos start = base + exclusive_sum(units, sc, round_units);
      if (i < p.b) {
        cuts |= plan_cuts_by(by, start, blocks, f);
#pragma unroll
        for (int c = 0; c < kPlanWidthChoices; ++c) {
          const int first_part = plan_first_part_by(by[c], start, f);
          if (c <= f && first_part < parts) atomicAdd(&part_cost[c * parts + first_part], units);
        }
      }
      if (round == 0) start_first = start, units_first = round_units;
      base += round_units;
    }
    __syncthreads();  // every request's units are in part_cost
    MLA_PLAN_STAMP(3);
    unsigned unfit = cuts;
#pragma unroll 1
    for (int c = 0; c <= f; ++c)
#pragma unroll 1
      for (int k = tid; k < parts; k += kThreads)
        if (part_cost[c * parts + k] > w0 + Pos(f)) unfit |= 1u << c;
    unfit = __reduce_or_sync(0xffffffffu, unfit);
    if (tid % 32 == 0 && unfit) atomicOr(&sc.unfit, unfit);
    __syncthreads();
    MLA_PLAN_STAMP(4);
    const long long w = plan_choose_width(w0, sc.unfit, f);
    // A uniform line past plan_uniform's reach may take the even split too.
    if (const int k = plan_even_for(p, f, w0, sc.unfit, w); k > 0) {
      write_even_split(p, only_part, request_blocks(p, 0), k);
      return true;
    }
    const Div by_w(static_cast<Pos>(w));

    // Each request's rows and piece count, and num_splits.
    base = 0;
    unsigned pieces_base = 0;
#pragma unroll 1
    for (int round = 0; round < p.b; round += kThreads) {
      const int i = round + tid;
      const int blocks = round == 0 ? blocks_first : i < p.b ? request_blocks(p, i) : 0;
      Pos start = start_first, round_units = units_first;
      if (round > 0) start = base + exclusive_sum(i < p.b ? Pos(plan_units(blocks, f)) : Pos(0), sc, round_units);
      const int pieces = i < p.b ? plan_request_by(by_w, p, i, start, blocks, w, only_part, &sc.row) : 0;
      unsigned round_pieces;
      const unsigned before = exclusive_sum(unsigned(pieces), sc, round_pieces);
      if (i < p.b) p.num_splits[i + 1] = int(pieces_base + before) + pieces;
      base += round_units;
      pieces_base += round_pieces;
    }
    // (The barriers of the last scan ordered every request's writes to sc.row before this.)
    MLA_PLAN_STAMP(5);
    if (only_part >= 0 && tid == 0) reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)[only_part] = sc.row;
    return true;
  }
};

}  // namespace mla::cuda
