"""heads.ray on local Ray clusters of 1 and 2 nodes: rows/s of embedding a Parquet corpus, beside
`heads embed` in one process on the same texts.

    python3 bench/ray_embed.py                  # 2000 rows (bench/sentences.txt, repeated)
    python3 bench/ray_embed.py --rows 10000 --nodes 1,2,4

Each node of the cluster (ray.cluster_utils.Cluster, loopback) gets 2 logical CPUs: one embedding actor
with `--threads` threads, and one CPU for the read and write tasks. The time is the whole job: read,
embed, write (the cluster and the actors started before the clock, by a warm-up job).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--nodes", default="1,2")
    ap.add_argument("--threads", type=int, default=1, help="threads per actor")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    import heads.ray as hray

    lines = [ln for ln in (HERE / "sentences.txt").read_text().splitlines() if ln.strip()]
    texts = [lines[i % len(lines)] for i in range(args.rows)]
    tmp = Path(tempfile.mkdtemp())
    try:
        src = tmp / "in"
        src.mkdir()
        for f, idx in enumerate(np.array_split(np.arange(args.rows), 16)):
            pq.write_table(pa.table({"id": idx, "text": [texts[i] for i in idx]}), src / f"part-{f:02d}.parquet")
        (tmp / "in.txt").write_text("\n".join(texts) + "\n")
        cli = os.environ.get("HEADS_CLI") or shutil.which("heads") or str(HERE.parent / "build" / "heads")
        t0 = time.perf_counter()
        subprocess.run([cli, "embed", "--quiet", "--input", str(tmp / "in.txt"), "--output", str(tmp / "cli.npy")],
                       check=True)
        cli_s = time.perf_counter() - t0
        print(f"# {os.cpu_count()} cores, {args.rows} rows, batch {args.batch_size}, {args.threads} thread(s) per "
              "actor, one actor per node")
        print("| runner | rows/s | vs 1 node | max diff vs heads embed |")
        print("|---|---|---|---|")
        print(f"| heads embed, 1 process, {os.cpu_count()} threads (model load included) | {args.rows / cli_s:.0f} | | |")
        one = None
        for n in [int(x) for x in args.nodes.split(",")]:
            c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                              "object_store_memory": 200 * 2**20})
            for _ in range(n - 1):
                c.add_node(num_cpus=2, object_store_memory=200 * 2**20)
            c.wait_for_nodes()
            ray.init(address=c.address, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(args.threads)}},
                     log_to_driver=False)
            ray.data.DataContext.get_current().enable_progress_bars = False
            try:
                kw = dict(batch_size=args.batch_size, actors=n, cpus_per_actor=1)
                hray.embed_parquet(str(src), str(tmp / f"warm{n}"), **kw)  # starts workers, loads the model
                t0 = time.perf_counter()
                rows = hray.embed_parquet(str(src), str(tmp / f"out{n}"), **kw)
                dt = time.perf_counter() - t0
            finally:
                ray.shutdown()
                c.shutdown()
            assert rows == args.rows
            t = pq.read_table(tmp / f"out{n}").to_pydict()
            got = np.array([np.asarray(e, dtype=np.float32) for e in t["embedding"]])[np.argsort(t["id"])]
            err = float(np.abs(got - np.load(tmp / "cli.npy")).max())
            one = one or rows / dt
            print(f"| Ray, {n} node(s) | {rows / dt:.0f} | {rows / dt / one:.2f}x | {err:.1e} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
