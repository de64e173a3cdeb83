"""Time against sequence length: heads' linear attention (causal and not) beside heads' softmax
SDPA (causal), B 1, H 8, D 64, one run, median of repeats.

    python3 bench/linear_scaling.py [--threads N] [--max-len 65536] [--softmax-max-len 16384]

Prints a markdown table (ms) and the growth from each length to the next: ~2× for linear, ~4× for
softmax attention.
"""

import argparse
import statistics
import time

import numpy as np

import heads


def median_ms(fn, min_time=0.5, min_runs=3):
    fn()
    ts = []
    start = time.perf_counter()
    while len(ts) < min_runs or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=65536)
    ap.add_argument("--softmax-max-len", type=int, default=16384)
    a = ap.parse_args()
    heads.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"B 1, H 8, D 64, {a.threads} threads; ms (growth from the previous length)")
    print("| L | linear | linear causal | softmax causal (sdpa) |\n|---|---|---|---|")
    prev = [None, None, None]
    L = 1024
    while L <= a.max_len:
        q, k, v = (rng.standard_normal((8, L, 64)).astype(np.float32) for _ in range(3))
        runs = [lambda: heads.linear_attention(q, k, v), lambda: heads.linear_attention(q, k, v, causal=True),
                (lambda: heads.sdpa(q, k, v, is_causal=True)) if L <= a.softmax_max_len else None]
        cells = []
        for n, fn in enumerate(runs):
            if fn is None:
                cells.append("—")
                continue
            ms = median_ms(fn)
            cells.append(f"{ms:.1f}" + (f" ({ms / prev[n]:.1f}×)" if prev[n] else ""))
            prev[n] = ms
        print(f"| {L} | " + " | ".join(cells) + " |")
        L *= 2


if __name__ == "__main__":
    main()
