#!/usr/bin/env bash
# test-aarch64.sh — heads for 64-bit ARM, built and tested on an x86-64 Debian 12 host: the library
# and its kernels' C++ tests (HEADS_TEST_SUITES=kernels: the only suites run here) cross-compiled (g++-aarch64-linux-gnu, the arm64 libraries of Debian's
# multiarch, cmake/aarch64-linux-gnu.cmake), the kernel tests run under qemu-user with every
# extension QEMU 7.2 implements (`-cpu max`). Every test visits each ISA the CPU offers (scalar, neon,
# neonbf16; bf16 attention on neonbf16 both with BFDOT and widened), forward and backward, f32,
# bf16 and int8; the long sweeps check a share of their cases
# (HEADS_TEST_SAMPLE, as under the sanitizers): QEMU runs NEON code 20-50x slower than the hardware.
# Then the Python module, cross-built against Debian's arm64 Python 3.11 headers, runs tests/portable
# (numpy float64 references, no PyTorch) in Debian's arm64 Python and numpy under qemu-aarch64.
# Installs what it needs (root: apt); builds in build-aarch64/. nanobind comes from HEADS_NANOBIND_DIR
# (its cmake directory) or else from `python3 -m nanobind --cmake_dir` (pip install nanobind).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
trap 'steps_finish test-aarch64.sh' EXIT
BUILD=${BUILD:-build-aarch64}
# A twelfth of each long sweep under QEMU (a third under the sanitizers; all of it in the x86 release run),
# another twelfth each run (the share is drawn from the test's seed): the NEON paths share the sweeps' code
# with the x86 ones, and a sweep given its length (testing::Sample(count)) still checks one case at least.
# The QEMU step is this script's largest cost: 260 s with a sixth, 185 s with a twelfth (AMD Zen 3, 2 cores).
SAMPLE=${HEADS_TEST_SAMPLE:-12}
NANOBIND_DIR=${HEADS_NANOBIND_DIR:-$(python3 -m nanobind --cmake_dir 2>/dev/null || true)}
[ -n "$NANOBIND_DIR" ] && [ -f "$NANOBIND_DIR/nanobind-config.cmake" ] || {
  echo "test-aarch64: no nanobind (pip install nanobind, or HEADS_NANOBIND_DIR=<its cmake dir>): '$NANOBIND_DIR'" >&2
  exit 1
}

step aarch64:deps "aarch64: cross compiler, qemu-user and the arm64 libraries (Debian multiarch)"
PKGS=(cmake ninja-build g++-aarch64-linux-gnu qemu-user libgomp1:arm64 libstdc++6:arm64 libdnnl2:arm64 libgtest-dev:arm64
      libgmock-dev:arm64 libicu-dev:arm64 libpcre2-dev:arm64 libcairo2-dev:arm64 nlohmann-json3-dev libcli11-dev
      python3 libexpat1:arm64 zlib1g:arm64 libffi8:arm64 libblas3:arm64 liblapack3:arm64)  # python3: for CMake (nanobind);
                                                                                           # the rest: arm64 Python, numpy
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64
  apt_get update -qq
  DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# libdnnl-dev cannot be installed for two architectures at once (its headers differ in one GPU
# setting): the arm64 package's CMake files and headers are unpacked into the build tree instead,
# beside the arm64 library that libdnnl2:arm64 installed.
DNNL=$PWD/$BUILD/deps
if [ ! -f "$DNNL/usr/lib/aarch64-linux-gnu/cmake/dnnl/dnnl-config.cmake" ]; then
  mkdir -p "$DNNL"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download libdnnl-dev:arm64 >/dev/null 2>&1)
  dpkg-deb -x "$tmp"/libdnnl-dev_*_arm64.deb "$DNNL"
  rm -rf "$tmp"
  for so in /usr/lib/aarch64-linux-gnu/libdnnl.so.*; do ln -sf "$so" "$DNNL/usr/lib/aarch64-linux-gnu/"; done
fi

# Debian's arm64 Python 3.11 (interpreter, standard library, headers), numpy and pytest, unpacked into the
# build tree: the interpreter cannot be installed beside the host's, and the libraries would have to
# match the host's Python packages version for version.
PYROOT=$PWD/$BUILD/python-root
if [ ! -x "$PYROOT/usr/bin/python3.11" ] || [ ! -d "$PYROOT/usr/lib/python3/dist-packages/pytest" ]; then
  rm -rf "$PYROOT"
  mkdir -p "$PYROOT"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 \
     libpython3.11:arm64 libpython3.11-dev:arm64 python3-numpy:arm64 python3-pytest python3-pluggy python3-iniconfig \
     python3-packaging python3-attr python3-more-itertools python3-pkg-resources python3-py >/dev/null 2>&1)
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$PYROOT"; done
  rm -rf "$tmp"
fi

step aarch64:build "aarch64: cross build of the library, the kernels' C++ tests, the CLI and the Python module ($BUILD/)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_BUILD_TYPE=Release \
  -DHEADS_BUILD_CLI=ON -DHEADS_BUILD_SERVE=OFF -DHEADS_BUILD_PYTHON=ON -DHEADS_TEST_SUITES=kernels \
  -Ddnnl_DIR="$DNNL/usr/lib/aarch64-linux-gnu/cmake/dnnl" -Dnanobind_DIR="$NANOBIND_DIR" \
  -DPython_INCLUDE_DIR="$PYROOT/usr/include/python3.11" -DSKBUILD_SOABI=cpython-311-aarch64-linux-gnu >/dev/null
cmake --build "$BUILD" --target heads_tests heads_cli _heads

step aarch64:qemu "aarch64: kernel tests under qemu-aarch64 -cpu max (HEADS_TEST_SAMPLE=$SAMPLE)"
# The paths offered follow the emulated CPU: neonbf16 (BFDOT) under -cpu max, which has FEAT_BF16 (HEADS_ISA
# fails where a path is not offered), not under -cpu neoverse-n1, which lacks it.
HEADS_ISA=neonbf16 qemu-aarch64 -cpu max "$BUILD/tests/heads_tests" --gtest_filter='Dispatch.*' --gtest_brief=1
qemu-aarch64 -cpu neoverse-n1 "$BUILD/tests/heads_tests" --gtest_filter='Dispatch.*' --gtest_brief=1
# The CLI names the path it runs (emulated rates mean nothing).
for cpu_isa in max:neonbf16 neoverse-n1:neon; do
  qemu-aarch64 -cpu "${cpu_isa%%:*}" "$BUILD/heads" bench peak --min-time 0.05 --json >"$BUILD/peak.json"
  echo "   -cpu ${cpu_isa%%:*}: $(cat "$BUILD/peak.json")"
  grep -q "\"isa\":\"${cpu_isa#*:}\"" "$BUILD/peak.json"
done
# The kernels' suites: attention forward, backward, variants, decode and KV cache, the elementwise
# and decoder ops, linear attention, the linear layers in every precision.
FILTER='Sdpa.*:SdpaBackward.*:SdpaVariants.*:SdpaSplit.*:SdpaMerge.*:SdpaKv.*:QuantizeKv.*:Ops.*:OpsBackward.*'
FILTER+=':Rope.*:RmsNorm.*:GatedActivation.*:KVCache.*:LinearAttention.*:Linear.*:Precision.*:PrecisionOutliers.*'
# Not the model's embeddings (all-MiniLM-L6-v2 through every layer: minutes under QEMU; the x86 runs have it).
FILTER+=':-Precision.SentenceEmbeddingsStayCloseToF32'
# Eight processes of an eighth of the tests each (gtest sharding), two at a time (one per core), the next
# starting as one ends: the tests' times differ by 50x, and two halves had ended 60 s apart.
SHARDS=8
run_shard() {
  GTEST_TOTAL_SHARDS=$SHARDS GTEST_SHARD_INDEX=$1 HEADS_TEST_SAMPLE=$SAMPLE OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive \
    qemu-aarch64 -cpu max "$BUILD/tests/heads_tests" --gtest_filter="$FILTER" --gtest_brief=1 >"$BUILD/qemu-shard$1.log" 2>&1
}
rc=0
running=0
for ((shard = 0; shard < SHARDS; ++shard)); do
  if ((running == 2)); then
    wait -n || rc=1
    running=$((running - 1))
  fi
  run_shard "$shard" &
  running=$((running + 1))
done
while ((running > 0)); do
  wait -n || rc=1
  running=$((running - 1))
done
for ((shard = 0; shard < SHARDS; ++shard)); do
  tail -n 3 "$BUILD/qemu-shard$shard.log" | grep -v '^$' | sed "s/^/   shard $shard: /"
done
if ((rc)); then
  cat "$BUILD"/qemu-shard*.log
  exit 1
fi

step aarch64:python "aarch64: the Python module in Debian's arm64 Python and numpy under qemu-aarch64 (tests/portable)"
rm -rf "$BUILD/py" && mkdir -p "$BUILD/py"
cp -r python/heads "$BUILD/py/heads"
cp "$BUILD"/_heads.cpython-311-aarch64-linux-gnu.so "$BUILD/py/heads/"
PYTHONHOME=$PYROOT/usr PYTHONPATH=$PWD/$BUILD/py OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive \
  qemu-aarch64 -cpu max "$PYROOT/usr/bin/python3.11" -c \
  'import platform, heads, numpy; print("   python", platform.python_version(), platform.machine(), "numpy", numpy.__version__)'
PYTHONHOME=$PYROOT/usr PYTHONPATH=$PWD/$BUILD/py OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive \
  qemu-aarch64 -cpu max "$PYROOT/usr/bin/python3.11" -m pytest -q -p no:cacheprovider tests/portable
