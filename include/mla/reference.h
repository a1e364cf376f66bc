// The CPU backend: every op, multi-threaded, with the exact semantics of SPEC §5. Decode runs
// through the same plan / split / combine structure as the GPU kernels, so a CPU run also tests the
// planner and the combine arithmetic. Slow is fine; unclear is not.
#pragma once

#include <functional>

#include "mla/params.h"
#include "mla/plan.h"

namespace mla::reference {

// "SM count" the CPU backend plans for; a constant so that plans and results are the same on every
// machine, whatever its core count.
constexpr int kVirtualSms = 32;

// Decode with the plan in p.split (made by plan_decode_host for these lengths, possibly by an
// earlier call) and its workspace; writes p.o. A plan that does not match the lengths is an error.
void dense_decode(const DenseDecodeParams& p);
void sparse_decode(const SparseDecodeParams& p);

// Merges split partials (reference/flashmla-semantics.md §5.3); requests with one piece are skipped.
void combine(const CombineParams& p);

void sparse_prefill(const SparsePrefillParams& p);

// Runs fn(i) for i in [0, n) on all hardware threads; rethrows the first exception.
void parallel_for(int n, const std::function<void(int)>& fn);

}  // namespace mla::reference
