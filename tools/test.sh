#!/usr/bin/env bash
# Sets up, builds and runs every test suite: GoogleTest (ctest) and pytest. On a machine without a
# GPU the CUDA suites report themselves skipped, with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh || exit 1

echo "== C++ tests"
ctest --test-dir build/core --output-on-failure || exit 1

echo "== Python tests"
"${PYTHON:-python3}" -m pytest tests/python -q -rs "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: that is a failure"
  exit 1
fi
exit $rc
