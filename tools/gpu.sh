#!/usr/bin/env bash
# On a GPU machine, in one command: build and install the package with its CUDA kernels, run the
# C++ test binaries (carried from a build machine or built here), the whole pytest suite (CUDA
# included), compute-sanitizer memcheck over a representative subset (out-of-range indices, page
# size 1, unaligned MODEL1 pages), then the benchmark, whose table it prints last.
#
#   bash tools/gpu.sh                      # everything
#   STEPS=build,pytest bash tools/gpu.sh   # a subset of: build, ctest, pytest, sanitize, bench, profile
#   STEPS=profile PROFILE_CASE=dense_b128_h16_sk8192 PROFILE_KERNEL=dense_decode_kernel bash tools/gpu.sh
#   PYTEST_ARGS="-m cuda -k 'sparse or graph'" BENCH_ARGS=--no-torch bash tools/gpu.sh
# Logs go to $OUT when set (the device tool's output folder), else build/gpu-logs. The C++ test
# binaries link CUDA and GoogleTest statically, so they can be built on a machine without a GPU
# (cmake -S . -B build/cuda && cmake --build build/cuda) and carried (build/cuda/mla_*_tests).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-build/gpu-logs}
mkdir -p "$LOG"
STEPS=${STEPS:-build,ctest,pytest,sanitize,bench}
export PYTHONUNBUFFERED=1
status=0
has() { [[ ",$STEPS," == *",$1,"* ]]; }

if has build; then
  echo "== build (CUDA archs ${MLA_CUDA_ARCHS:-90a})"
  python3 -m pip install --no-build-isolation --no-deps -q . -C cmake.define.MLA_CUDA_ARCHS="${MLA_CUDA_ARCHS:-90a}" \
    > "$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; echo "build failed"; exit 1; }
fi

if has ctest; then
  echo "== C++ tests"
  for bin in build/core/mla_core_tests build/core/mla_cuda_tests build/cuda/mla_core_tests build/cuda/mla_cuda_tests; do
    [ -x "$bin" ] || continue
    "$bin" --gtest_brief=1 2>&1 | tee "$LOG/$(basename "$bin").log" | tail -3 || status=1
  done
fi

if has pytest; then
  echo "== pytest (CPU and CUDA)"
  eval "set -- ${PYTEST_ARGS:-}"  # PYTEST_ARGS may hold quoted arguments, e.g. -k 'cuda and sparse'
  python3 -m pytest tests/python -q -p no:cacheprovider -rfs "$@" 2>&1 | tee "$LOG/pytest.log" | grep -E "passed|failed|FAILED|ERROR" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has sanitize; then
  echo "== compute-sanitizer memcheck"
  compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -p no:cacheprovider \
    tests/python/test_sparse_decode.py tests/python/test_dense_decode.py tests/python/test_sparse_prefill.py tests/python/test_dense_sm90.py tests/python/test_sparse_sm90.py \
    -k "cuda and (invalid or pg1 or page1 or topk_gt or garbage or h1)" 2>&1 | tee "$LOG/sanitizer.log" | tail -4
  grep -q "ERROR SUMMARY: 0 errors" "$LOG/sanitizer.log" || status=1
fi

if has bench; then
  echo "== benchmark"
  python3 bench/bench_decode.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG/bench.log" || status=1
fi
if has profile; then
  # Nsight Compute on one launch of one kernel: the summary sections, then the per-source-line
  # stall samples (the kernels are built with -lineinfo), both as text in $LOG.
  case_name=${PROFILE_CASE:-dense_b128_h16_sk8192}
  kernel=${PROFILE_KERNEL:-dense_decode_kernel}
  echo "== ncu: $kernel in $case_name"
  ncu --clock-control none -k "regex:$kernel" -c 1 --set full --import-source yes -o "$LOG/profile" -f \
    python3 bench/profile_case.py "$case_name" > "$LOG/profile-run.log" 2>&1 || status=1
  ncu -i "$LOG/profile.ncu-rep" --page details > "$LOG/profile-details.txt" 2>&1 || status=1
  ncu -i "$LOG/profile.ncu-rep" --page source --csv --print-source sass > "$LOG/profile-source.csv" 2>&1 || status=1
  grep -E "Duration|Throughput|Warp Cycles|Stall" "$LOG/profile-details.txt" | head -20
fi
exit $status
