#!/usr/bin/env bash
# Compile launcher of the CUDA kernels (mla_cuda's CUDA_COMPILER_LAUNCHER): runs the compiler
# command it is given and fails it when ptxas reports that it serialised wgmma instructions (C7520
# and kin: a barrier, call or compiler-inserted warpgroup.arrive on a path it cannot prove
# warp-uniform). The kernel still compiles then, but every wgmma of it waits for the one before:
# tens of percent slower, and nothing else would say so. The Hopper sources are compiled with
# ptxas -v for this; its per-kernel info lines are dropped here, everything else the compiler
# prints is passed on.
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2> "$log"
rc=$?
grep -v -E "^ptxas info|^    [0-9]+ bytes (stack|gmem)" "$log" >&2
if grep -q -E "wgmma.mma_async instructions are serialized" "$log"; then
  grep -E "wgmma.mma_async instructions are serialized" "$log" >&2
  echo "error: ptxas serialised wgmma instructions in a Hopper kernel (see above); make the branch," \
       "barrier or call it names warp-uniform (e.g. through __shfl_sync)" >&2
  exit 1
fi
exit $rc
