// The decode planner run by the kThreads threads of one CTA, one thread per request (in rounds of
// kThreads for larger batches): by the planner kernel, for every row, and by attention kernels
// that plan for themselves, each CTA for its own part's row (the same computation, so the rows
// agree). The costs are summed and the rows set idle; a scan of the costs gives each request its
// position on the line (plan.h), from which each thread marks the widths that would cut its
// request and adds its units to the part it would fall in at each width (part_cost), to rule out
// widths that leave a part over the bound; with the width chosen, each thread writes the rows its
// request begins or ends, and a second scan turns the piece counts into num_splits (every caller
// writes all of them: the same values). The same functions (plan.h) make the host plan, so device
// and host plans are identical.
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
  };
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
    run(copy, part, *reinterpret_cast<Scratch*>(scratch), reinterpret_cast<unsigned long long*>(costs));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }

  // Plans p: num_splits and every row (only_part < 0) or row only_part alone (made in shared memory
  // and stored once with its final values, so that CTAs of one part, which store the same row,
  // never expose an idle or half-made one to each other). Every thread of the CTA calls it; the
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
