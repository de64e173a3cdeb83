"""Ring attention (heads.distributed) on this machine: time, bytes moved and memory per rank, and what
overlapping the transfers with the compute saves.

    python3 bench/ring_attention.py                      # 2 and 4 ranks, L = 4096 and 8192
    python3 bench/ring_attention.py --ranks 2 --L 16384 --repeat 3

Every rank is a process (gloo over loopback TCP) with cores/ranks threads. Per (ranks, L, mask) it
prints medians over --repeat runs, each started by a barrier:
  compute    the rank's kernel calls of the forward alone (its own K/V in place of the travelling ones)
  comm       the forward's W-1 shifts of K/V alone
  fwd        the ring forward, transfers overlapped with compute (and, in brackets, waited for first)
  fwd+bwd    forward and backward, overlapped (and not)
beside one process attending the whole sequence on every core, and the bytes each rank sends and the
memory it holds against docs/distributed.md's model. With more ranks than cores the times are
oversubscribed: they check the model's bytes and memory, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np


def median_time(f, repeat: int, barrier=None) -> float:
    if barrier:
        barrier()
    f()  # warm-up: first-touch of buffers, thread pools, connections
    ts = []
    for _ in range(repeat):
        if barrier:
            barrier()
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def model(B, H, Hkv, L, D, Dv, W):
    """docs/distributed.md: bytes one rank sends per forward / backward, and its working set."""
    ls = L // W
    kv = 4 * B * Hkv * ls * (D + Dv)  # one rank's K and V shard
    mine = 4 * B * ls * (H * (D + Dv) + H) + kv  # q, out, lse and its own K/V
    return {"fwd_bytes": (W - 1) * kv, "bwd_bytes": (2 * W - 1) * kv,
            "fwd_mem": mine + 3 * kv,  # + the shard held, the one arriving, the packed copy being sent
            "bwd_mem": mine + 4 * B * ls * H * (D + Dv) + 6 * kv}  # + dout, dq; K/V: held, arriving, sent;
    # dK/dV: accumulating, arriving, sent


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import heads.distributed as hd
    from heads import _heads
    from heads.distributed import _pack, _pairs, chunks_of, ring_attention

    sent = [0]
    isend = dist.isend

    def counting_isend(tensor, *a, **kw):  # the bytes ring_attention actually sends
        sent[0] += tensor.numel() * tensor.element_size()
        return isend(tensor, *a, **kw)

    hd._dist.isend = counting_isend

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    B, H, Hkv, D = 1, args.heads, args.heads, args.dim
    rows = []
    base_rss = rss_mb("VmRSS")
    for L in args.L:
        for causal in (False, True):
            layout = "zigzag" if causal else "contiguous"
            ls = L // world
            g = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn(B, h, ls, D, generator=g) for h in (H, Hkv, Hkv))
            dout = torch.randn(B, H, ls, D, generator=g)
            n = len(chunks_of(rank, world, layout))
            qs, ks, vs = (t.chunk(n, dim=2) for t in (q, k, v))

            def compute():
                for step in range(world):
                    src = (rank - step) % world
                    for a, b, diag in _pairs(chunks_of(rank, world, layout), chunks_of(src, world, layout), causal):
                        _heads.sdpa_train_forward(qs[a].contiguous(), ks[b], vs[b], None, 0.0, diag)

            def comm():
                buf = _pack(k, v)
                for step in range(world - 1):
                    reqs = [dist.isend(buf, (rank + 1) % world, tag=step),
                            dist.irecv(torch.empty_like(buf), (rank - 1) % world, tag=step)]
                    for r in reqs:
                        r.wait()

            def fwd(overlap):
                return lambda: ring_attention(q, k, v, is_causal=causal, layout=layout, overlap=overlap)

            def fwd_bwd(overlap):
                def f():
                    x = [t.clone().requires_grad_() for t in (q, k, v)]
                    ring_attention(*x, is_causal=causal, layout=layout, overlap=overlap).backward(dout)
                return f

            sent[0] = 0
            fwd(True)()
            fwd_sent = sent[0]
            fwd_bwd(True)()
            bwd_sent = sent[0] - 2 * fwd_sent  # fwd_bwd runs the forward again
            bar = dist.barrier
            r = {"fwd_sent": fwd_sent, "bwd_sent": bwd_sent, "L": L, "causal": causal, "layout": layout,
                 "compute": median_time(compute, args.repeat, bar), "comm": median_time(comm, args.repeat, bar),
                 "fwd": median_time(fwd(True), args.repeat, bar), "fwd_seq": median_time(fwd(False), args.repeat, bar),
                 "fwd_bwd": median_time(fwd_bwd(True), args.repeat, bar),
                 "fwd_bwd_seq": median_time(fwd_bwd(False), args.repeat, bar)}
            # the slowest rank sets the pace: report the maximum over the ranks
            t = torch.tensor([r[x] for x in ("compute", "comm", "fwd", "fwd_seq", "fwd_bwd", "fwd_bwd_seq")],
                             dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            for i, x in enumerate(("compute", "comm", "fwd", "fwd_seq", "fwd_bwd", "fwd_bwd_seq")):
                r[x] = float(t[i])
            rows.append(r)
    peak = torch.tensor([rss_mb("VmHWM") - base_rss], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"rows": rows, "peak_growth_mb": float(peak[0])}), flush=True)
    dist.destroy_process_group()


def single(args, L: int, causal: bool):
    """One process, every core, the whole sequence: forward and forward + backward (heads.torch)."""
    import torch

    import heads.torch as ht

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, L, args.dim, generator=g) for _ in range(3))
    dout = torch.randn(1, args.heads, L, args.dim, generator=g)

    def fb():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        ht.scaled_dot_product_attention(*x, is_causal=causal).backward(dout)

    return (median_time(lambda: ht.scaled_dot_product_attention(q, k, v, is_causal=causal), args.repeat),
            median_time(fb, args.repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--L", default="4096,8192")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.L = [int(x) for x in str(args.L).split(",")]
    if args.worker:
        return worker(args)
    if args.single:
        print(json.dumps([(L, c, single(args, L, c)) for L in args.L for c in (False, True)]))
        return
    cores = os.cpu_count() or 1
    print(f"# {cores} cores; B=1 H={args.heads} D=Dv={args.dim}; medians of {args.repeat}; seconds; gloo over "
          f"loopback; the slowest rank's time")
    print("| ranks | L | mask | compute | comm | fwd (not overlapped) | fwd+bwd (not overlapped) | 1 process fwd | "
          "1 process fwd+bwd | MB sent per rank fwd / bwd (model) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    # the one-process baselines run in a child too: a parent holding torch and heads thread pools
    # would compete with the ranks for the cores
    argv = [sys.executable, __file__, "--single", "--L", ",".join(map(str, args.L)), "--heads", str(args.heads),
            "--dim", str(args.dim), "--repeat", str(args.repeat)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    base = {(L, c): tuple(t) for L, c, t in json.loads(out.strip().splitlines()[-1])}
    for W in [int(x) for x in args.ranks.split(",")]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        threads = max(1, cores // W)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   WORLD_SIZE=str(W))
        argv = [sys.executable, __file__, "--worker", "--L", ",".join(map(str, args.L)), "--heads", str(args.heads),
                "--dim", str(args.dim), "--repeat", str(args.repeat)]
        procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True)
                 for r in range(W)]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"ring_attention bench: a rank failed at {W} ranks")
        res = json.loads([ln for ln in outs[0].splitlines() if ln.startswith("{")][-1])
        for r in res["rows"]:
            m = model(1, args.heads, args.heads, r["L"], args.dim, args.dim, W)
            f1, fb1 = base[(r["L"], r["causal"])]
            print(f"| {W} ({threads} thr) | {r['L']} | {'causal, zigzag' if r['causal'] else 'none'} | "
                  f"{r['compute']:.3f} | {r['comm']:.3f} | {r['fwd']:.3f} ({r['fwd_seq']:.3f}) | "
                  f"{r['fwd_bwd']:.3f} ({r['fwd_bwd_seq']:.3f}) | {f1:.3f} | {fb1:.3f} | "
                  f"{r['fwd_sent'] / 2**20:.1f} / {r['bwd_sent'] / 2**20:.1f} "
                  f"({m['fwd_bytes'] / 2**20:.1f} / {m['bwd_bytes'] / 2**20:.1f}) |", flush=True)
        m = model(1, args.heads, args.heads, args.L[-1], args.dim, args.dim, W)
        print(f"# {W} ranks: peak RSS growth of the largest rank over its start {res['peak_growth_mb']:.0f} MB "
              f"(the benchmark's own inputs and clones included); model at L={args.L[-1]}: forward "
              f"{m['fwd_mem'] / 2**20:.1f} MB, forward + backward {m['bwd_mem'] / 2**20:.1f} MB")


if __name__ == "__main__":
    main()
