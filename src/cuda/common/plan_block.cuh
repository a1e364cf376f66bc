// The decode planner run by the kThreads threads of one CTA, one thread per request (in rounds of
// kThreads for larger batches): by the planner kernel, for every row, and by attention kernels
// that plan for themselves, each CTA for its own part's row (the same computation, so the rows
// agree). The costs are summed and the rows set idle; a scan of the costs gives each request its
// position on the line (plan.h), from which each thread marks the widths that would cut its
// request and adds its units to the part it would fall in at each width (part_cost), to rule out
// widths that leave a part over the bound; with the width chosen, each thread writes the rows its
// request begins or ends, and a second scan turns the piece counts into num_splits (every caller
// writes all of them: the same values). The same functions (plan.h) make the host plan, so device
// and host plans are identical. Two implementations: run_fast() for lines under 2^31 units (32-bit
// positions, divisions by the few candidate widths as multiplications, warp-shuffle scans) and
// run() for any line (64-bit positions, cub scans); plan() takes the first that applies.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "mla/plan.h"

namespace mla::cuda {

// Parts whose costs fit 64 KB (the smallest key buffer of the attention kernels that plan in it):
// more than any GPU has SMs. The dispatcher plans elsewhere beyond it; the kernels check it.
constexpr int kPlanMaxPartsIn64KB = 65536 / (kPlanWidthChoices * 8);

template <int kThreads>
struct BlockPlanner {
  using Reduce = cub::BlockReduce<long long, kThreads>;
  using PosScan = cub::BlockScan<long long, kThreads>;
  using CountScan = cub::BlockScan<int, kThreads>;
  struct Scratch {
    union {
      typename Reduce::TempStorage reduce;
      typename PosScan::TempStorage pos;
      typename CountScan::TempStorage count;
    } tmp;
    long long total;
    unsigned unfit;
    PlanRow row;  // row only_part, made here and stored once with its final values
    unsigned warp_sum[kThreads / 32];                 // the fast planner's scans
    unsigned long long warp_total[kThreads / 32];     // and its sum of the costs
  };
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  // Bytes of part_cost, [width choice][part]: the units of the requests each part would run.
  static size_t part_cost_bytes(int num_sm_parts) {
    return size_t(kPlanWidthChoices) * size_t(num_sm_parts) * sizeof(unsigned long long);
  }

  // An attention kernel's prologue with a fresh plan: plans for `part` with its (not yet used) key
  // buffers as scratch, `scratch` for Scratch and `costs` for the part costs (64 KB at least: at
  // most kPlanMaxPartsIn64KB parts). Ends with the proxy fence (TMA or a peer's bulk copies write
  // the same bytes next); the caller synchronises after.
  __device__ static void run_in(const DecodePlanParams& p, int part, void* scratch, void* costs) {
    // A copy for the out-of-line planner: the kernel's own params stay in registers.
    const DecodePlanParams copy = p;
    plan(copy, part, *reinterpret_cast<Scratch*>(scratch), costs);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }

  // Plans p as run() below does, by run_fast() where the line is shorter than 2^31 units (any
  // batch a GPU holds). `costs` holds part_cost_bytes().
  __device__ static void plan(const DecodePlanParams& p, int only_part, Scratch& sc, void* costs) {
    if (!run_fast(p, only_part, sc, reinterpret_cast<unsigned*>(costs)))
      run(p, only_part, sc, reinterpret_cast<unsigned long long*>(costs));
  }

  // The sum of v over the CTA, in every thread.
  __device__ static unsigned long long block_sum(unsigned long long v, Scratch& sc) {
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
    if (threadIdx.x % 32 == 0) sc.warp_total[threadIdx.x / 32] = v;
    __syncthreads();
    unsigned long long all = 0;
#pragma unroll
    for (int k = 0; k < kThreads / 32; ++k) all += sc.warp_total[k];
    return all;
  }

  // The exclusive prefix sum of v over the CTA in thread order, and the CTA's total in `total`.
  __device__ static unsigned exclusive_sum(unsigned v, Scratch& sc, unsigned& total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned x = v;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const unsigned y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane >= d) x += y;
    }
    if (lane == 31) sc.warp_sum[warp] = x;
    __syncthreads();
    unsigned before = 0, all = 0;
#pragma unroll
    for (int k = 0; k < kThreads / 32; ++k) {
      const unsigned s = sc.warp_sum[k];
      before += k < warp ? s : 0u;
      all += s;
    }
    __syncthreads();  // warp_sum is free for the next scan
    total = all;
    return before + x - v;
  }

  // run() for a line of fewer than 2^31 units: the same plan with 32-bit positions, the divisions
  // by the candidate widths as multiplications (PlanInvariantDiv) and warp-shuffle scans, in about
  // a tenth of run()'s instructions (at the head of every CTA of a self-planning kernel, with a
  // cold instruction cache). Returns false, having written nothing, for a longer line.
  __device__ __noinline__ static bool run_fast(const DecodePlanParams& p, int only_part, Scratch& sc, unsigned* part_cost) {
    const int tid = threadIdx.x, f = plan_fixed(p), parts = p.num_sm_parts;
    if (p.b <= 0) return false;
    const int blocks_first = tid < p.b ? request_blocks(p, tid) : 0;
    unsigned long long cost = tid < p.b ? plan_units(blocks_first, f) : 0;
#pragma unroll 1
    for (int i = tid + kThreads; i < p.b; i += kThreads) cost += plan_units(request_blocks(p, i), f);
    const unsigned long long total = block_sum(cost, sc);
    if (total >= (1ull << 31)) return false;
    // plan_width, in 32 bits: total + parts - 1 < 2^32.
    const unsigned w0 = (unsigned(total) + unsigned(parts) - 1u) / unsigned(parts);
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
    PlanInvariantDiv by[kPlanWidthChoices];  // by[c] divides by W + c
#pragma unroll
    for (int c = 0; c < kPlanWidthChoices; ++c) by[c] = PlanInvariantDiv(w0 + unsigned(c));
    __syncthreads();  // sc.unfit, the idle rows, part_cost

    // Each request's position on the line, the widths that cut it and its units in part_cost.
    unsigned start_first = 0, units_first = 0, base = 0, cuts = 0;
#pragma unroll 1
    for (int round = 0; round < p.b; round += kThreads) {
      const int i = round + tid;
      const int blocks = round == 0 ? blocks_first : i < p.b ? request_blocks(p, i) : 0;
      const unsigned units = i < p.b ? unsigned(plan_units(blocks, f)) : 0u;
      unsigned round_units;
      const unsigned start = base + exclusive_sum(units, sc, round_units);
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
    unsigned unfit = cuts;
#pragma unroll 1
    for (int c = 0; c <= f; ++c)
#pragma unroll 1
      for (int k = tid; k < parts; k += kThreads)
        if (part_cost[c * parts + k] > w0 + unsigned(f)) unfit |= 1u << c;
    unfit = __reduce_or_sync(0xffffffffu, unfit);
    if (tid % 32 == 0 && unfit) atomicOr(&sc.unfit, unfit);
    __syncthreads();
    const long long w = plan_choose_width(w0, sc.unfit, f);
    const PlanInvariantDiv by_w{unsigned(w)};

    // Each request's rows and piece count, and num_splits.
    base = 0;
    unsigned pieces_base = 0;
#pragma unroll 1
    for (int round = 0; round < p.b; round += kThreads) {
      const int i = round + tid;
      const int blocks = round == 0 ? blocks_first : i < p.b ? request_blocks(p, i) : 0;
      unsigned start = start_first, round_units = units_first;
      if (round > 0) start = base + exclusive_sum(i < p.b ? unsigned(plan_units(blocks, f)) : 0u, sc, round_units);
      const int pieces = i < p.b ? plan_request_by(by_w, p, i, start, blocks, w, only_part, &sc.row) : 0;
      unsigned round_pieces;
      const unsigned before = exclusive_sum(unsigned(pieces), sc, round_pieces);
      if (i < p.b) p.num_splits[i + 1] = int(pieces_base + before) + pieces;
      base += round_units;
      pieces_base += round_pieces;
    }
    // (The barriers of the last scan ordered every request's writes to sc.row before this.)
    if (only_part >= 0 && tid == 0) reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)[only_part] = sc.row;
    return true;
  }

  // The general planner (64-bit positions). Plans p: num_splits and every row (only_part < 0) or row
  // only_part alone (made in shared memory and stored once with its final values, so that CTAs of
  // one part, which store the same row, never expose an idle or half-made one to each other). Every thread of the CTA calls it; the
  // caller synchronises the CTA before it reads what was written.
  __device__ __noinline__ static void run(const DecodePlanParams& p, int only_part, Scratch& sc, unsigned long long* part_cost) {
    const int tid = threadIdx.x;
    // The first round's block counts and positions stay in registers (most batches have one round).
    const int f = plan_fixed(p);
    const int blocks_first = tid < p.b ? request_blocks(p, tid) : 0;
    long long cost = tid < p.b ? plan_units(blocks_first, f) : 0;
    for (int i = tid + kThreads; i < p.b; i += kThreads) cost += plan_units(request_blocks(p, i), f);
    const long long total = Reduce(sc.tmp.reduce).Sum(cost);
    if (tid == 0) sc.total = total, sc.unfit = 0, p.num_splits[0] = 0;
    if (only_part >= 0) {
      if (tid == 0) sc.row = plan_idle(p.b);
    } else {
      for (int part = tid; part < p.num_sm_parts; part += kThreads) plan_idle_row(p, part);
    }
    for (int k = tid; k < kPlanWidthChoices * p.num_sm_parts; k += kThreads) part_cost[k] = 0;
    __syncthreads();  // sc.total, sc.unfit, part_cost, the idle rows (requests overwrite some fields), tmp

    // Request i's position on the line: start_base (the rounds before) + start.
    auto position = [&](int round, int blocks, long long& start, long long& round_units) {
      const int i = round + tid;
      const long long units = i < p.b ? plan_units(blocks, f) : 0;
      PosScan(sc.tmp.pos).ExclusiveSum(units, start, round_units);
      __syncthreads();
    };
    const long long w0 = plan_width(sc.total, p.num_sm_parts);
    long long start_first = 0, units_first = 0, start_base = 0;
    unsigned cuts = 0;
    for (int round = 0; round < p.b; round += kThreads) {
      const int i = round + tid;
      const int blocks = round == 0 ? blocks_first : i < p.b ? request_blocks(p, i) : 0;
      long long start, round_units;
      position(round, blocks, start, round_units);
      if (i < p.b) {
        cuts |= plan_cuts(start_base + start, blocks, w0, f);
        for (int c = 0; c <= f; ++c) {
          const int first_part = plan_first_part(start_base + start, w0, c, f);
          if (first_part < p.num_sm_parts)
            atomicAdd(&part_cost[c * p.num_sm_parts + first_part], (unsigned long long)plan_units(blocks, f));
        }
      }
      if (round == 0) start_first = start, units_first = round_units;
      start_base += round_units;
    }
    __syncthreads();  // every request's units are in part_cost
    unsigned unfit = cuts;
    for (int k = tid; k < kPlanWidthChoices * p.num_sm_parts; k += kThreads)
      if (part_cost[k] > (unsigned long long)(w0 + f)) unfit |= 1u << (k / p.num_sm_parts);
    if (unfit) atomicOr(&sc.unfit, unfit);
    __syncthreads();
    const long long w = plan_choose_width(w0, sc.unfit, f);

    start_base = 0;
    int pieces_base = 0;
    for (int round = 0; round < p.b; round += kThreads) {
      const int i = round + tid;
      const int blocks = round == 0 ? blocks_first : i < p.b ? request_blocks(p, i) : 0;
      long long start = start_first, round_units = units_first;
      if (round > 0) position(round, blocks, start, round_units);
      const int pieces = i < p.b ? plan_request(p, i, start_base + start, blocks, w, only_part, &sc.row) : 0;
      int before, round_pieces;
      CountScan(sc.tmp.count).ExclusiveSum(pieces, before, round_pieces);
      __syncthreads();
      if (i < p.b) p.num_splits[i + 1] = pieces_base + before + pieces;
      start_base += round_units;
      pieces_base += round_pieces;
    }
    // (The barrier of the last round ordered every request's writes to sc.row before this.)
    if (only_part >= 0 && tid == 0) reinterpret_cast<PlanRow*>(p.tile_scheduler_metadata)[only_part] = sc.row;
  }
};

}  // namespace mla::cuda
