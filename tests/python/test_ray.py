"""heads.ray on a local two-node Ray cluster (ray.cluster_utils.Cluster: a head and a worker node, each
its own raylet and object store, loopback only): Parquet in and out through an actor pool, a killed
actor mid-job, and the Ray Serve deployment. Embeddings are compared with `heads embed --batch-invariant`'s:
bit for bit where the cluster runs batch-invariant too, within float32 rounding where it does not."""

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import ray
from ray.cluster_utils import Cluster

import heads.ray as hray

SENTENCES = Path(__file__).parents[2] / "bench" / "sentences.txt"


@pytest.fixture(scope="module")
def texts():
    lines = [ln for ln in SENTENCES.read_text().splitlines() if ln.strip()]
    return lines[:240]


@pytest.fixture(scope="module")
def cli_embeddings(texts, tmp_path_factory):
    """`heads embed --batch-invariant` of the same texts: the reference the cluster must reproduce."""
    d = tmp_path_factory.mktemp("cli")
    (d / "in.txt").write_text("\n".join(texts) + "\n")
    cli = os.environ.get("HEADS_CLI", "heads")
    subprocess.run([cli, "embed", "--batch-invariant", "--input", str(d / "in.txt"), "--output", str(d / "out.npy")],
                   check=True, capture_output=True)
    return np.load(d / "out.npy")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    hook = tmp_path_factory.mktemp("hook") / "actors.txt"
    # two logical CPUs per node (the machine has 2 cores in all): one for an embedding actor, one
    # for the reads and writes around it (an actor pool that takes every CPU starves them)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 150 * 2**20,
                                                      "include_dashboard": False})
    try:
        c.add_node(num_cpus=2, object_store_memory=150 * 2**20)
        c.wait_for_nodes()
        ray.init(address=c.address, runtime_env={"env_vars": {"HEADS_RAY_ACTOR_HOOK": str(hook),
                                                              "OMP_NUM_THREADS": "1"}},
                 log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield c, hook
    finally:
        ray.shutdown()
        c.shutdown()


def write_corpus(path: Path, texts, files: int = 3) -> None:
    import pyarrow as pa

    path.mkdir(parents=True, exist_ok=True)
    for f, idx in enumerate(np.array_split(np.arange(len(texts)), files)):
        pq.write_table(pa.table({"id": idx.astype(np.int64), "text": [texts[i] for i in idx]}),
                       path / f"part-{f}.parquet")


def read_embedded(path: Path):
    t = pq.read_table(path).to_pydict()
    return np.array(t["id"]), np.array([np.asarray(e, dtype=np.float32) for e in t["embedding"]])


def expect_every_row_once(ids, vectors, cli_embeddings, n: int, bitwise: bool) -> None:
    """Rows 0..n-1 once each; row i is text i % len(texts)."""
    assert sorted(ids.tolist()) == list(range(n)), "every row exactly once"
    got = vectors[np.argsort(ids)]
    cli_embeddings = cli_embeddings[np.arange(n) % len(cli_embeddings)]
    assert got.shape == cli_embeddings.shape
    err = np.abs(got - cli_embeddings).max()
    if bitwise:  # batch-invariant on both sides: the batches Ray made do not matter
        assert np.array_equal(got, cli_embeddings), f"max |ray - heads embed| = {err:.3g}, expected 0"
    else:  # oneDNN's GEMM: equal up to the rounding of a different batch composition
        assert err <= 1e-6, f"max |ray - heads embed| = {err:.3g}"


def test_embed_parquet_on_two_nodes_equals_heads_embed(cluster, texts, cli_embeddings, tmp_path):
    write_corpus(tmp_path / "in", texts)
    n = hray.embed_parquet(str(tmp_path / "in"), str(tmp_path / "out"), batch_size=32, actors=2,
                           batch_invariant=True)
    assert n == len(texts)
    ids, vectors = read_embedded(tmp_path / "out")
    expect_every_row_once(ids, vectors, cli_embeddings, len(texts), bitwise=True)
    assert len(ray.nodes()) == 2 and all(nd["Alive"] for nd in ray.nodes())


def test_killed_actor_mid_job_every_row_once(cluster, texts, cli_embeddings, tmp_path):
    _, hook = cluster
    rows = texts * 2  # 240 batches of 2: both actors stay busy for seconds
    write_corpus(tmp_path / "in", rows, files=6)
    hook.write_text("")
    result = {}

    def job():
        try:
            result["n"] = hray.embed_parquet(str(tmp_path / "in"), str(tmp_path / "out"), batch_size=2, actors=2)
        except Exception as e:  # reported below
            result["error"] = e

    t = threading.Thread(target=job, daemon=True)
    t.start()
    deadline = time.time() + 600  # generous: a loaded machine starts actors slowly
    while time.time() < deadline and len([p for p in hook.read_text().split() if p]) < 2:
        time.sleep(0.05)
    pids = [int(p) for p in hook.read_text().split()]
    assert len(pids) >= 2, "the actor pool did not start"
    time.sleep(0.5)  # the actors are embedding
    assert t.is_alive(), "the job ended before an actor could be killed: make it longer"
    os.kill(pids[0], signal.SIGKILL)
    t.join(1200)
    assert not t.is_alive() and "error" not in result, result.get("error")
    assert result["n"] == len(rows)
    # Not asserted: that Ray restarted the killed actor (max_restarts) before the job ended. The
    # surviving actor may finish the job first: CI saw no restart in 1 of about 20 runs, and so did 1
    # of 2 runs with a job 3x longer and a 60 s wait after it (cause not pinned down). What must
    # hold is below: the job succeeds, every row once, none lost or repeated.
    ids, vectors = read_embedded(tmp_path / "out")
    expect_every_row_once(ids, vectors, cli_embeddings, len(rows), bitwise=False)


def test_serve_deployment_batches_requests(cluster, texts, cli_embeddings):
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    try:
        handle = serve.run(hray.deployment(num_replicas=2, max_batch_size=8, batch_wait_timeout_s=0.01,
                                           batch_invariant=True), name="heads", route_prefix=None)
        chunks = [texts[i:i + 3] for i in range(0, 60, 3)]
        responses = [handle.remote(c) for c in chunks]  # concurrent: batched by @serve.batch
        got = np.concatenate([r.result() for r in responses])
        assert got.dtype == np.float32 and got.shape == (60, cli_embeddings.shape[1])
        assert np.array_equal(got, cli_embeddings[:60])  # whatever requests were batched together
        one = handle.remote(texts[7]).result()
        assert one.shape == (1, cli_embeddings.shape[1]) and np.array_equal(one[0], cli_embeddings[7])
        # an empty request beside others: answered empty, the others unharmed
        mixed = [handle.remote([]), handle.remote(texts[:2])]
        assert mixed[0].result().shape == (0, cli_embeddings.shape[1])
        assert np.array_equal(mixed[1].result(), cli_embeddings[:2])
    finally:
        serve.shutdown()
