// Device planner: one CTA, one thread per request (in rounds of kThreads for larger batches). The
// costs are summed and every row is set idle; a scan of the costs gives each request its position
// on the line (plan.h), from which each thread marks the widths that would cut its request and adds
// its units to the part it would fall in at each width (shared memory), to rule out widths that
// leave a part over the bound; with the width chosen, each thread writes the rows its request
// begins or ends, and a second scan turns the piece counts into num_splits. The same functions
// (plan.h) make the host plan, so device and host plans are identical. The decode kernel that
// follows is a programmatic dependent: its CTAs may start their prologue now and wait for this
// grid before they read the plan.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "mla/mla.h"

namespace mla::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) plan_decode_kernel(DecodePlanParams p) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  using Reduce = cub::BlockReduce<long long, kThreads>;
  using PosScan = cub::BlockScan<long long, kThreads>;
  using CountScan = cub::BlockScan<int, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename PosScan::TempStorage pos;
    typename CountScan::TempStorage count;
  } tmp;
  __shared__ long long total_all;
  __shared__ unsigned unfit_all;
  extern __shared__ unsigned long long part_cost[];  // [width choice][part]: the units of its requests
  const int tid = threadIdx.x;

  // The first round's block counts and positions stay in registers (most batches have one round).
  const int f = plan_fixed(p);
  const int blocks_first = tid < p.b ? request_blocks(p, tid) : 0;
  long long cost = tid < p.b ? plan_units(blocks_first, f) : 0;
  for (int i = tid + kThreads; i < p.b; i += kThreads) cost += plan_units(request_blocks(p, i), f);
  const long long total = Reduce(tmp.reduce).Sum(cost);
  if (tid == 0) total_all = total, unfit_all = 0, p.num_splits[0] = 0;
  for (int part = tid; part < p.num_sm_parts; part += kThreads) plan_idle_row(p, part);
  for (int k = tid; k < kPlanWidthChoices * p.num_sm_parts; k += kThreads) part_cost[k] = 0;
  __syncthreads();  // total_all, unfit_all, part_cost, the idle rows (requests overwrite some fields), tmp

  // Request i's position on the line: start_base (the rounds before) + start.
  auto position = [&](int round, int blocks, long long& start, long long& round_units) {
    const int i = round + tid;
    const long long units = i < p.b ? plan_units(blocks, f) : 0;
    PosScan(tmp.pos).ExclusiveSum(units, start, round_units);
    __syncthreads();
  };
  const long long w0 = plan_width(total_all, p.num_sm_parts);
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
  if (unfit) atomicOr(&unfit_all, unfit);
  __syncthreads();
  const long long w = plan_choose_width(w0, unfit_all, f);

  start_base = 0;
  int pieces_base = 0;
  for (int round = 0; round < p.b; round += kThreads) {
    const int i = round + tid;
    const int blocks = round == 0 ? blocks_first : i < p.b ? request_blocks(p, i) : 0;
    long long start = start_first, round_units = units_first;
    if (round > 0) position(round, blocks, start, round_units);
    const int pieces = i < p.b ? plan_request(p, i, start_base + start, blocks, w) : 0;
    int before, round_pieces;
    CountScan(tmp.count).ExclusiveSum(pieces, before, round_pieces);
    __syncthreads();
    if (i < p.b) p.num_splits[i + 1] = pieces_base + before + pieces;
    start_base += round_units;
    pieces_base += round_pieces;
  }
}

}  // namespace

cudaError_t plan_decode(const DecodePlanParams& params, cudaStream_t stream) {
  if (params.b <= 0 || params.num_sm_parts <= 0) return cudaErrorInvalidValue;
  const size_t smem = size_t(kPlanWidthChoices) * size_t(params.num_sm_parts) * sizeof(unsigned long long);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;  // num_sm_parts is at most the SM count
  plan_decode_kernel<<<1, kThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mla::cuda
