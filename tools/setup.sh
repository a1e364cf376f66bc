#!/usr/bin/env bash
# Sets up a fresh machine and builds everything: pinned Python dependencies (skipped where already
# importable, e.g. on a GPU machine with its own torch and no package registry), GoogleTest, the
# C++ core with its tests (and the CUDA kernels when nvcc is present), and the torch extension,
# installed into the current Python.
#
# CUDA architectures: MLA_CUDA_ARCHS if set; else the GPU's own (e.g. 90a on an H100/H200); else,
# on a machine without a GPU, 90a alone, which checks that the kernels compile.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}

missing=()
while read -r req; do
  case "$req" in ''|'#'*) continue ;; esac
  name=${req%%==*}
  version=${req#*==}
  module=${name//-/_}
  if [ "$name" = torch ]; then
    # Any build of the pinned torch release will do (the GPU machines ship their own CUDA build).
    "$PY" -c "import torch, sys; sys.exit(not torch.__version__.startswith('${version%.*}'))" 2>/dev/null || missing+=("$req")
  else
    "$PY" -c "import $module" 2>/dev/null || missing+=("$req")
  fi
done < requirements.txt
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]}"
  "$PY" -m pip install -q "${missing[@]}"
fi

if [ -z "${MLA_CUDA_ARCHS:-}" ]; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.' || true)
  case "$cc" in
    9*) MLA_CUDA_ARCHS=90a ;;
    [0-9][0-9]) MLA_CUDA_ARCHS=$cc ;;
    *) MLA_CUDA_ARCHS=90a ;;
  esac
fi

tests=ON
if ! [ -e /usr/src/googletest/CMakeLists.txt ] && ! [ -e /usr/lib/x86_64-linux-gnu/libgtest.a ]; then
  echo "== installing GoogleTest"
  if ! { apt-get update -q && apt-get install -y -q libgtest-dev; } > build-gtest.log 2>&1; then
    echo "GoogleTest cannot be installed here (no package registry?): building the core without its C++ tests"
    tests=OFF
  fi
  rm -f build-gtest.log
fi

echo "== building the C++ core (build/core; CUDA archs $MLA_CUDA_ARCHS; C++ tests $tests)"
mkdir -p build
cmake -S . -B build/core -G Ninja -DMLA_BUILD_TESTS=$tests -DMLA_CUDA_ARCHS="$MLA_CUDA_ARCHS" \
  > build/core.configure.log 2>&1 || {
  cat build/core.configure.log
  exit 1
}
grep "mla_kernels: CUDA kernels" build/core.configure.log || true
cmake --build build/core -j "$JOBS"

echo "== building and installing the torch extension"
CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip install -q --no-build-isolation --no-deps . \
  -C cmake.define.MLA_CUDA_ARCHS="$MLA_CUDA_ARCHS"
