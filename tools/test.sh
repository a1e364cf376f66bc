#!/usr/bin/env bash
# Sets up, builds and runs every test suite: GoogleTest (ctest) and pytest. On a machine without a
# GPU the CUDA suites report themselves skipped, with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh || exit 1

echo "== C++ tests"
ctest --test-dir build/core --output-on-failure || exit 1

echo "== C++ API from another CMake project (install + find_package)"
rm -rf build/install build/consumer
cmake --install build/core --prefix build/install > /dev/null || exit 1
cmake -S tests/consumer -B build/consumer -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build/install" > build/consumer.log 2>&1 &&
  cmake --build build/consumer >> build/consumer.log 2>&1 || { cat build/consumer.log; exit 1; }
build/consumer/consumer || exit 1

echo "== Python tests"
"${PYTHON:-python3}" -m pytest tests/python -q -rs "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: that is a failure"
  exit 1
fi
exit $rc
