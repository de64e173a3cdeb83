#!/usr/bin/env bash
# bench-bundle.sh — pack the built CLI and C++ test binary, the shared libraries they need (all but
# glibc's and the C++ runtime's, which any newer x86-64 Linux has) and bench/, into one tar.xz that
# runs on another x86-64 Linux machine with none of heads' dependencies installed: to test the AMX
# tiles and measure many cores where such a machine is at hand for a short while.
#
#   bash scripts/bench-bundle.sh OUT.tar.xz          (after scripts/setup.sh: reads build/)
#
# On the other machine (Python with torch, and onnxruntime for the f32 tables, for bench/compare.py):
#   mkdir b && tar -C b -xJf OUT.tar.xz && bash b/run.sh [MAX_SECONDS]
# run.sh prints the CPU, `heads bench peak`, the whole C++ suite on real hardware (one process per
# core, the tests that need the MiniLM model left out: it is not packed), then bench/compare.py's
# tables (bf16 forward and backward at all cores and at 2, f32 at all cores), each cut off at its
# share of MAX_SECONDS (default 480) so that a short lease still returns whole tables for the first.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench-bundle.sh OUT.tar.xz}
case "$OUT" in /*) ;; *) OUT=$PWD/$OUT ;; esac
for f in build/heads build/tests/heads_tests; do
  [ -x "$f" ] || { echo "bench-bundle: $f is missing: run scripts/setup.sh first" >&2; exit 1; }
done
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/lib" "$STAGE/bench"
cp build/heads build/tests/heads_tests "$STAGE/"
strip "$STAGE/heads" "$STAGE/heads_tests"
cp bench/compare.py bench/shapes.json "$STAGE/bench/"
ldd build/heads build/tests/heads_tests | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    case "$name" in libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libgcc_s.so*|libstdc++.so*) continue ;; esac
    cp -L "$path" "$STAGE/lib/$name"
  done
cat >"$STAGE/run.sh" <<'EOF'
#!/usr/bin/env bash
# The bundle's run (scripts/bench-bundle.sh): tests on this machine's hardware, then the tables.
cd "$(dirname "$0")"
B=$PWD
BUDGET=${1:-480}
export LD_LIBRARY_PATH=$B/lib HEADS_CLI=$B/heads PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "== $(($(date +%s) - T0)) s: $*"; }
say machine
lscpu | grep -E 'Model name|^CPU\(s\)|Thread\(s\) per core|Socket|NUMA node\(s\)|L2|L3'
echo "flags: $(grep -o -w 'amx[a-z_0-9]*\|avx512_bf16\|avx512_fp16\|avx512_vnni\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
N=$(nproc)
"$B/heads" bench peak --threads 1
"$B/heads" bench peak --threads "$N"
say "C++ suite, $N shards (the MiniLM tests left out)"
mkdir -p "$B/tests-out"
pids=()
for ((i = 0; i < N; i++)); do
  GTEST_TOTAL_SHARDS=$N GTEST_SHARD_INDEX=$i OMP_NUM_THREADS=1 timeout 120 "$B/heads_tests" --gtest_brief=1 \
    --gtest_filter='-SentenceEncoder.*:Tokenizer.*:Quantize.ModelDirectories*:Quantize.BrokenDirectories*:Precision.SentenceEmbeddings*' \
    >"$B/tests-out/$i.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"   # not a bare `wait`: it would also wait for a caller's `> >(tee ...)`
grep -h -A12 'Failure$' "$B"/tests-out/*.log | head -80
grep -h '^\[  FAILED  \]\|^\[  PASSED  \]' "$B"/tests-out/*.log | sort | uniq -c
table() {  # SECONDS ARGS...: one bench/compare.py table, cut off after SECONDS
  local t=$1; shift
  say "compare.py $*"
  timeout "$t" python3 "$B/bench/compare.py" --min-time 0.3 "$@"
}
LEFT=$((BUDGET - ($(date +%s) - T0)))
table $((LEFT * 25 / 100)) --dtype bf16 --threads "$N"
table $((LEFT * 20 / 100)) --backward --dtype bf16 --threads "$N"
table $((LEFT * 20 / 100)) --dtype bf16 --threads 2
table $((LEFT * 20 / 100)) --threads "$N"
table $((LEFT * 15 / 100)) --backward --dtype bf16 --threads 2
say done
EOF
chmod +x "$STAGE/run.sh"
tar -C "$STAGE" -cf - . | xz -T0 -6 >"$OUT"
echo "bench-bundle: $OUT ($(du -h "$OUT" | cut -f1)): mkdir b && tar -C b -xJf $(basename "$OUT") && bash b/run.sh"
