#!/usr/bin/env bash
# test.sh — set up (scripts/setup.sh), then run every test:
#   1. the C++ suite (GoogleTest via CTest, CLI exit codes, an install-tree consumer),
#   2. the same C++ suite built with AddressSanitizer + UndefinedBehaviorSanitizer (-O1; the kernels
#      of the ISAs this CPU runs, avx512 left out beside avx512bf16; a third of each long sweep's cases, HEADS_TEST_SAMPLE=3),
#   3. the Python suite (pytest, a process per core up to 4) against live PyTorch 2.13, including the CLI,
#      and tests/portable (numpy float64 references alone; scripts/test-aarch64.sh runs them on arm64),
#   4. its bf16 tests again on the AMX kernels (over the tile emulator where the CPU has no tiles).
# 2 and 3 run with HEADS_SCRATCH_POISON=1: the kernels' reused scratch is NaN-filled on every call.
# Ends with a table of its steps' times.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source scripts/steps.sh
trap 'steps_finish test.sh' EXIT

scripts/setup.sh
# As setup.sh: through ccache where it is installed (CMAKE_CXX_COMPILER_LAUNCHER= turns it off).
if [ -z "${CMAKE_CXX_COMPILER_LAUNCHER+set}" ] && command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache
fi

# Two tests at a time, each with a team of every core's threads: OpenMP's waiting threads sleep
# (OMP_WAIT_POLICY=passive) instead of spinning on the cores the other test is working on (the
# release run on a 2-core Xeon: 240 -> 171 s). The kernels' results do not depend on it.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
step ctest "C++ tests"
ctest --test-dir build --output-on-failure -j2

step asan:build "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer: build (scripts/asan-build.sh)"
bash scripts/asan-build.sh
# The long sweeps check a third of their cases here (HEADS_TEST_SAMPLE, tests/common/testing.h), a
# share drawn from each test's seed: every case costs 5-10x under the sanitizers, and the release
# run above checked them all.
step asan:ctest "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer: run"
HEADS_TEST_SAMPLE=3 HEADS_SCRATCH_POISON=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp" \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --test-dir build-asan --output-on-failure -j2

# As root (CI), the test of DDP across two network namespaces must run, not skip.
[ "$(id -u)" -eq 0 ] && export HEADS_REQUIRE_NETNS=1
# One process per core (at most 4: each holds PyTorch and a model), one thread each (OMP_NUM_THREADS,
# which heads and PyTorch follow; the tests that compare thread counts set theirs); a test file stays
# in one process, so its module fixtures (models, servers, the Ray cluster) are made once. The ten
# slowest tests are listed at the end (what to look at when CI nears its time budget).
WORKERS=$(nproc)
((WORKERS <= 4)) || WORKERS=4
step pytest "Python tests (PyTorch $("$PYTHON" -c 'import torch; print(torch.__version__)'), $WORKERS processes)"
HEADS_SCRATCH_POISON=1 HEADS_CLI="$PWD/build/heads" OMP_NUM_THREADS=1 \
  "$PYTHON" -m pytest -q -n "$WORKERS" --dist loadfile --durations=10 tests/python tests/portable

# The Python bf16 tests again on the AMX kernels: over the tile emulator where the CPU has no tiles
# (any CPU with AVX2 and FMA: docs/architecture.md), on the tiles where it has them.
if grep -q -w avx2 /proc/cpuinfo && grep -q -w fma /proc/cpuinfo; then
  step pytest:amx "Python bf16 tests on the amx path (HEADS_ISA=amx, HEADS_AMX_EMULATE=1)"
  HEADS_SCRATCH_POISON=1 HEADS_AMX_EMULATE=1 HEADS_ISA=amx HEADS_CLI="$PWD/build/heads" OMP_NUM_THREADS=1 \
    "$PYTHON" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadfile -k bf16 tests/python
else
  echo "== Python bf16 tests on the amx path: skipped, this CPU has no AVX2 and FMA (the emulated AMX build's)"
fi
