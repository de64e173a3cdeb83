"""heads' sentence encoder on Ray: embedding a corpus across a cluster (Ray Data), and serving it
with replicas (Ray Serve). Needs ``pip install "ray[data,serve]"`` (the ``ray`` extra of heads).

    import ray, heads.ray
    ray.init()                                       # or ray.init(address="auto") on a cluster
    heads.ray.embed_parquet("corpus/", "embedded/", text_column="text")   # Parquet in, Parquet out

    ds = heads.ray.embed(ray.data.read_parquet("corpus/"))    # a Dataset with an "embedding" column

    from ray import serve
    handle = serve.run(heads.ray.deployment(num_replicas=4))  # replicas across the cluster
    vectors = handle.remote(["a sentence", "another"]).result()

Each actor of the pool (and each Serve replica) loads one ``heads.SentenceEncoder`` and runs it on the
CPUs Ray gives it (``num_cpus`` threads); the model directory must be readable on every node (the
default is the installed all-MiniLM-L6-v2 package). A batch is embedded as ``heads embed`` embeds it,
so the rows equal ``heads embed``'s: bit for bit with ``batch_invariant=True`` and ``heads embed
--batch-invariant`` (heads.set_batch_invariant: a text's embedding does not depend on the batch
Ray puts it in), else to the last bits of float32. Ray retries the batches of an actor that dies
(a node lost, a process killed) on a new one: every row is written once.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import numpy as np

import ray

__all__ = ["Embedder", "embed", "embed_parquet", "deployment"]


class Embedder:
    """The callable class of the actor pool: one SentenceEncoder per actor, `threads` threads."""

    def __init__(self, model_dir: Optional[str] = None, dtype: Any = None, text_column: str = "text",
                 output_column: str = "embedding", threads: Optional[int] = None,
                 batch_invariant: bool = False) -> None:
        import heads

        if batch_invariant:  # for this actor's process
            heads.set_batch_invariant(True)
        self.threads = threads or max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        heads.set_num_threads(self.threads)
        self.encoder = heads.SentenceEncoder(model_dir, dtype=dtype)
        self.text_column, self.output_column = text_column, output_column
        hook = os.environ.get("HEADS_RAY_ACTOR_HOOK")  # tests: a file each actor notes its pid in
        if hook:
            with open(hook, "a") as f:
                f.write(f"{os.getpid()}\n")

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        import heads

        heads.set_num_threads(self.threads)  # per calling thread: Ray may call from another than __init__'s
        texts = batch[self.text_column]
        if len(texts) and not all(isinstance(t, str) for t in texts):
            bad = next(type(t).__name__ for t in texts if not isinstance(t, str))
            raise TypeError(f"heads.ray: column {self.text_column!r} must hold strings, found a {bad}")
        vectors = self.encoder.encode([str(t) for t in texts], batch_size=max(1, len(texts)))
        out = dict(batch)
        out[self.output_column] = list(vectors)  # one float32 array per row (Arrow: a list<float> column)
        return out


def embed(ds: "ray.data.Dataset", model_dir: Optional[str] = None, *, dtype: Any = None, text_column: str = "text",
          output_column: str = "embedding", batch_size: int = 64, actors: Optional[int] = None,
          cpus_per_actor: float = 1, max_restarts: int = 3, batch_invariant: bool = False) -> "ray.data.Dataset":
    """`ds` with an `output_column` of embeddings of its `text_column`, computed by a pool of actors.

    ``actors``: the pool's size (default: as many as the cluster's CPUs allow, cpus_per_actor each,
    less one CPU left to the tasks that read and write the data: a pool holding every CPU starves them).
    ``max_restarts``: how often an actor that died is restarted (its batches are run again).
    ``batch_invariant``: each row's embedding the same bits whatever batch it lands in
    (heads.set_batch_invariant in every actor; slower).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    if actors is None:
        actors = max(1, int((ray.cluster_resources().get("CPU", 1) - 1) // cpus_per_actor))
    return ds.map_batches(
        Embedder,
        fn_constructor_kwargs={"model_dir": model_dir, "dtype": dtype, "text_column": text_column,
                               "output_column": output_column, "batch_invariant": bool(batch_invariant)},
        batch_size=batch_size, batch_format="numpy", concurrency=actors, num_cpus=cpus_per_actor,
        max_restarts=max_restarts, max_task_retries=-1)


def embed_parquet(input_path: str, output_path: str, model_dir: Optional[str] = None, **kw) -> int:
    """Reads Parquet files with a text column, writes them with an embedding column (streaming: the
    corpus is never held whole); returns the rows written, from the written files' metadata."""
    import pyarrow.parquet as pq

    embed(ray.data.read_parquet(input_path), model_dir, **kw).write_parquet(output_path)
    files = [os.path.join(output_path, f) for f in os.listdir(output_path) if f.endswith(".parquet")]
    return sum(pq.read_metadata(f).num_rows for f in files)


def deployment(model_dir: Optional[str] = None, *, dtype: Any = None, num_replicas: int = 1,
               cpus_per_replica: float = 1, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.005,
               batch_invariant: bool = False):
    """A Ray Serve application: replicas of the encoder, requests (lists of texts) batched together
    by ``@serve.batch``. ``serve.run(deployment(...))`` returns a handle; ``handle.remote(texts)``
    answers a float32 array [len(texts), dim]. ``batch_invariant``: a request's answer does not
    depend on the requests it was batched with (bit for bit)."""
    from ray import serve

    @serve.deployment(num_replicas=num_replicas, ray_actor_options={"num_cpus": cpus_per_replica})
    class HeadsEncoder:
        def __init__(self) -> None:
            self.embedder = Embedder(model_dir, dtype, threads=max(1, int(cpus_per_replica)),
                                     batch_invariant=batch_invariant)

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_timeout_s)
        async def _batch(self, requests: List[List[str]]) -> List[np.ndarray]:
            texts = [t for r in requests for t in r]
            out = self.embedder({"text": np.array(texts, dtype=object)})["embedding"]
            vectors, i = [], 0
            for r in requests:
                vectors.append(np.array(out[i:i + len(r)], dtype=np.float32).reshape(len(r), self.dim))
                i += len(r)
            return vectors

        @property
        def dim(self) -> int:
            return self.embedder.encoder.dim

        async def _embed(self, texts) -> np.ndarray:
            texts = [texts] if isinstance(texts, str) else list(texts)
            if not texts:  # answered here: an empty request must not join (and fail) a batch
                return np.zeros((0, self.dim), dtype=np.float32)
            if not all(isinstance(t, str) for t in texts):
                raise TypeError("heads.ray deployment: expected a text or a list of texts")
            return await self._batch(texts)

        async def __call__(self, texts) -> np.ndarray:
            if hasattr(texts, "json"):  # an HTTP request through Serve's proxy: {"input": [...]}
                body = await texts.json()
                return (await self._embed(body["input"] if isinstance(body, dict) else body)).tolist()
            return await self._embed(texts)

    return HeadsEncoder.bind()
