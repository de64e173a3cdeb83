#!/usr/bin/env bash
# test.sh — set up (scripts/setup.sh), then run every test:
#   1. the C++ suite (GoogleTest via CTest, CLI exit codes, an install-tree consumer),
#   2. the same C++ suite built with AddressSanitizer + UndefinedBehaviorSanitizer,
#   3. the Python suite (pytest) against live PyTorch 2.13, including the CLI.
# 2 and 3 run with HEADS_SCRATCH_POISON=1: the kernels' reused scratch is NaN-filled on every call.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
scripts/setup.sh

echo "== C++ tests"
ctest --test-dir build --output-on-failure -j2

echo "== C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DHEADS_SANITIZE=address,undefined -DHEADS_BUILD_PYTHON=OFF >/dev/null
cmake --build build-asan
HEADS_SCRATCH_POISON=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp" \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --test-dir build-asan --output-on-failure -j2

# As root (CI), the test of DDP across two network namespaces must run, not skip.
[ "$(id -u)" -eq 0 ] && export HEADS_REQUIRE_NETNS=1
echo "== Python tests (PyTorch $("$PYTHON" -c 'import torch; print(torch.__version__)'))"
HEADS_SCRATCH_POISON=1 HEADS_CLI="$PWD/build/heads" "$PYTHON" -m pytest -q tests/python
