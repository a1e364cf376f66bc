#!/usr/bin/env bash
# On a GPU machine: times builds of the library against each other. Each build is a directory
# holding one wheel (built elsewhere, e.g. `pip wheel . -w build/wheels/<name>`); it is installed
# into a directory of its own, and bench/bench_decode.py then runs once per build in turn, ROUNDS
# times over (A B A B ...), each run importing its build through PYTHONPATH. Give the benchmark
# `--flashmla DIR` so that every run also times FlashMLA: the card's clocks drift from run to run,
# and the ratio to FlashMLA in the same run is what compares the builds.
#
#   bash bench/compare_builds.sh build/wheels/main build/wheels/new -- --no-torch --reuse-plan \
#       --flashmla build/flashmla --cases dense_b128_h128_sk512,dense_b128_h128_sk4096_varlen
#
# Every run is under `timeout` (RUN_TIMEOUT seconds, default 120), so that a build that hangs costs
# one run, not the machine's remaining time; its output goes to $OUT/compare.log (else
# build/compare.log) as it comes, each run under a header naming its build (the directory's name)
# and round. PYTHON (default python3) runs pip and the benchmark, BENCH (default
# bench/bench_decode.py) is the script run.
set -uo pipefail
shopt -s nullglob
builds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do builds+=("$(realpath -m "$1")"); shift; done
[ $# -gt 0 ] && shift  # the "--"
if [ ${#builds[@]} -eq 0 ]; then
  echo "usage: $0 BUILD_DIR... [-- bench_decode.py arguments]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
LOG=${OUT:-build}/compare.log
mkdir -p "$(dirname "$LOG")"
ROUNDS=${ROUNDS:-2}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
PYTHON=${PYTHON:-python3}
BENCH=${BENCH:-bench/bench_decode.py}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT

names=$(for b in "${builds[@]}"; do basename "$b"; done | sort | uniq -d)
if [ -n "$names" ]; then
  echo "builds must have distinct directory names: $names" >&2
  exit 2
fi
for b in "${builds[@]}"; do
  wheels=("$b"/*.whl)
  if [ ${#wheels[@]} -ne 1 ]; then
    echo "$b: expected one wheel, found ${#wheels[@]}" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-deps --no-index --target "$site/$(basename "$b")" "${wheels[0]}" || exit 1
done

status=0
for round in $(seq 1 "$ROUNDS"); do
  for b in "${builds[@]}"; do
    name=$(basename "$b")
    echo "== $name, round $round" | tee -a "$LOG"
    PYTHONPATH="$site/$name" timeout -k 10 "$RUN_TIMEOUT" "$PYTHON" "$BENCH" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
      echo "== $name, round $round: exit status $rc$([ "$rc" -eq 124 ] && echo " (timed out)")" | tee -a "$LOG"
      status=1
    fi
  done
done
exit $status
