#!/usr/bin/env bash
# asan-build.sh — configure and build build-asan/: the C++ library, tools and tests under AddressSanitizer
# + UndefinedBehaviorSanitizer (-O1; the kernel builds of the ISAs this CPU runs, avx512 left out beside
# avx512bf16). scripts/test.sh runs it as its step asan:build and then the tests; .ci/run runs it first
# on the CPU the fresh root leaves idle (SCHED_IDLE), and test.sh's step then finds it done. Needs the
# packages of scripts/setup.sh --deps-only.
set -euo pipefail
cd "$(dirname "$0")/.."
# As setup.sh and test.sh: through ccache where it is installed (CMAKE_CXX_COMPILER_LAUNCHER= turns it
# off). The same choice whoever runs it: a configure with another launcher would compile it all again.
if [ -z "${CMAKE_CXX_COMPILER_LAUNCHER+set}" ] && command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache
fi

# -O1: the sanitizers' checks are the same at any level; -O1 builds in half the time of -O2, and -g1
# keeps the line tables their reports need. -fexpensive-optimizations: GCC inserts vzeroupper after
# AVX code only with it (an -O2 flag); without, the AVX kernels leave the registers' upper halves
# dirty and every SSE instruction after them (the portable path, libm) pays for it on Intel cores: the
# suite took 1,040 s instead of 201 on a 2-core Xeon with AMX. Only the kernel builds this CPU runs are compiled
# (HEADS_KERNEL_ISAS): the tests run every ISA of the build the CPU has, and could run no other.
has() { grep -q -w "$1" /proc/cpuinfo; }
ISAS=()
# amx_emu: the AMX kernels over the tile emulator, their AVX-512 code written over AVX2 (any such CPU).
has avx2 && has fma && ISAS+=(avx2 amx_emu)
# Where the CPU has AVX512_BF16, its build alone of the two AVX-512 ones: the avx512 build is the same
# source at the same width (the avx512bf16 tests visit its widened bf16 products too), and the release
# run tests it.
if has avx512f && has avx512bw && has avx512vl && has avx512dq; then
  if has avx512_bf16; then ISAS+=(avx512bf16); else ISAS+=(avx512); fi
fi
has avx512_bf16 && has amx_tile && has amx_bf16 && ISAS+=(amx)
ISA_LIST=$(IFS=';'; echo "${ISAS[*]}")
echo "   build-asan/: kernels scalar${ISA_LIST:+;$ISA_LIST}"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -fexpensive-optimizations -DNDEBUG" \
  -DHEADS_SANITIZE=address,undefined -DHEADS_BUILD_PYTHON=OFF "-DHEADS_KERNEL_ISAS=${ISA_LIST:-none}" >/dev/null
cmake --build build-asan
