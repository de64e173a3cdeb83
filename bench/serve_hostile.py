"""`heads serve` under hostile clients, on loopback, for a bounded time: normal clients beside
clients that hang up right after sending, slowloris connections and health probes.

    python3 bench/serve_hostile.py                       # 3 minutes: 40 clients, 200 hang-ups/s, 120 slowloris
    python3 bench/serve_hostile.py --seconds 20 --clients 8 --hangups 50 --slowloris 30

The normal clients keep one connection each and send 1 to 4 sentences of bench/sentences.txt per
request; every answer is compared bit for bit with `heads embed` of the same sentences. The hang-up
clients open a connection, send a request and close at once. The slowloris clients send one header
line every 2 s and never finish (opening a new connection whenever the server closes one). A probe
opens a new connection for GET /health every 50 ms, as a load balancer would.

Prints the normal answers (ok / errors / wrong), /health latency (p50, p99, max), failed probes,
the server's open descriptors and RSS (max), and how the slow connections ended. Exits 1 if a
normal answer was wrong or lost, or a probe failed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import random
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SENTENCES = [s for s in (HERE / "sentences.txt").read_text().splitlines() if s.strip()][:200]


def start_server(heads: str, model: str | None, extra: list[str]):
    cmd = [heads, "serve", "--http-port", "0", "--grpc-port", "-1", *extra]
    if model:
        cmd += ["--model", model]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    m = re.fullmatch(r"listening http=(\d+) grpc=-?\d+\n", line)
    if not m:
        proc.kill()
        sys.exit(f"server did not start: {line!r}\n{Path(log.name).read_text()}")
    return proc, int(m[1]), log.name


def reference(heads: str, model: str | None) -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ref.npy"
        cmd = [heads, "embed", "--output", str(out), "--quiet", *SENTENCES]
        if model:
            cmd[2:2] = ["--model", model]
        subprocess.run(cmd, check=True)
        ref = np.load(out)
    return {s: ref[i] for i, s in enumerate(SENTENCES)}


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = self.errors = self.wrong = self.resent = 0
        self.health: list[float] = []
        self.health_failed = 0
        self.hangups = 0
        self.slow_opened = self.slow_closed_by_server = 0
        self.fds: list[int] = []
        self.rss: list[int] = []
        self.error_samples: list[str] = []


def normal_client(port, ref, stop, st: Stats, seed):
    rng = random.Random(seed)
    conn = None
    while not stop.is_set():
        texts = rng.sample(SENTENCES, rng.randint(1, 4))
        body = json.dumps({"input": texts})
        for attempt in range(2):  # a kept-alive connection closed as idle: send once more on a new one
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                raw = r.read()
                break
            except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError) as e:
                conn = None
                if attempt == 1:
                    with st.lock:
                        st.errors += 1
                        st.error_samples.append(repr(e))
                    raw = None
                else:
                    with st.lock:
                        st.resent += 1
        if raw is None:
            continue
        if r.status != 200:
            with st.lock:
                st.errors += 1
                st.error_samples.append(f"{r.status} {raw[:200]!r}")
            continue
        got = np.float32([d["embedding"] for d in json.loads(raw)["data"]])
        good = all(np.array_equal(got[i], ref[t]) for i, t in enumerate(texts))
        with st.lock:
            st.ok += good
            st.wrong += not good


def hangups(port, rate, stop, st: Stats):
    body = json.dumps({"input": ["a request whose client left at once"]}).encode()
    req = (b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    t0, n = time.time(), 0
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(req)
            n += 1
        except OSError:
            pass
        with st.lock:
            st.hangups = n
        delay = t0 + n / rate - time.time()
        if delay > 0:
            time.sleep(delay)


def slowloris(port, count, stop, st: Stats):
    socks: dict[socket.socket, float] = {}

    def open_one():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            s.setblocking(False)
            socks[s] = time.time()
            with st.lock:
                st.slow_opened += 1
        except OSError:
            pass

    for _ in range(count):
        open_one()
    while not stop.is_set():
        now = time.time()
        for s, last in list(socks.items()):
            gone = False
            try:
                if s.recv(4096, socket.MSG_DONTWAIT) == b"":
                    gone = True
            except BlockingIOError:
                pass
            except OSError:
                gone = True
            if not gone and now - last >= 2:
                try:
                    s.send(b"X-Slow-%d: x\r\n" % random.randrange(10**6))
                    socks[s] = now
                except OSError:
                    gone = True
            if gone:
                s.close()
                del socks[s]
                with st.lock:
                    st.slow_closed_by_server += 1
                open_one()
        time.sleep(0.05)
    for s in socks:
        s.close()


def health_probe(port, stop, st: Stats):
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            c.close()
            ok = r.status == 200
        except OSError:
            ok = False
        dt = time.perf_counter() - t0
        with st.lock:
            if ok:
                st.health.append(dt)
            else:
                st.health_failed += 1
        time.sleep(max(0.0, 0.05 - dt))


def sample_server(pid, stop, st: Stats):
    while not stop.is_set():
        try:
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            rss = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
            with st.lock:
                st.fds.append(fds)
                st.rss.append(rss)
        except (OSError, StopIteration):
            pass
        time.sleep(1)


def run_kind(kind, args, deadline, results):
    st, stop = Stats(), threading.Event()
    if kind == "normal":
        port, ref, n = args
        threads = [threading.Thread(target=normal_client, args=(port, ref, stop, st, i)) for i in range(n)]
    else:
        fn = {"hangups": hangups, "slowloris": slowloris, "health": health_probe, "sample": sample_server}[kind]
        threads = [threading.Thread(target=fn, args=(*args, stop, st))]
    for t in threads:
        t.start()
    time.sleep(max(0.0, deadline - time.time()))
    stop.set()
    for t in threads:
        t.join()
    results.put({k: v for k, v in vars(st).items() if k != "lock"})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default=os.environ.get("HEADS_CLI") or shutil.which("heads"))
    ap.add_argument("--model", default=None, help="model directory (default: the server's default)")
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--clients", type=int, default=40)
    ap.add_argument("--hangups", type=float, default=200, help="hang-ups per second")
    ap.add_argument("--slowloris", type=int, default=120)
    ap.add_argument("--server-args", default="", help="more flags for heads serve, e.g. '--threads 2'")
    a = ap.parse_args()
    ref = reference(a.heads, a.model)
    proc, port, log = start_server(a.heads, a.model, a.server_args.split())
    # One process per kind of client, so that none waits for another's share of the interpreter.
    results = mp.Queue()
    kinds = [("normal", (port, ref, a.clients)), ("hangups", (port, a.hangups)), ("slowloris", (port, a.slowloris)),
             ("health", (port,)), ("sample", (proc.pid,))]
    deadline = time.time() + a.seconds
    procs = [mp.Process(target=run_kind, args=(k, args, deadline, results)) for k, args in kinds]
    for p in procs:
        p.start()
    st = Stats()
    for _ in procs:
        for k, v in results.get().items():
            setattr(st, k, getattr(st, k) + v if isinstance(v, (int, list)) else v)
    for p in procs:
        p.join()
    alive = proc.poll() is None
    proc.terminate()
    code = proc.wait(120)
    h = np.array(st.health) * 1000 if st.health else np.array([float("nan")])
    print(f"{a.seconds:.0f} s: {a.clients} clients, {a.hangups:.0f} hang-ups/s, {a.slowloris} slowloris")
    print(f"normal answers: {st.ok} ok, {st.errors} errors, {st.wrong} wrong, {st.resent} sent again on a new connection")
    print(f"hang-ups sent: {st.hangups} ({st.hangups / a.seconds:.0f}/s)")
    print(f"slowloris: {st.slow_opened} opened, {st.slow_closed_by_server} closed by the server")
    print(f"/health: {len(st.health)} ok, {st.health_failed} failed; p50 {np.percentile(h, 50):.1f} ms, "
          f"p99 {np.percentile(h, 99):.1f} ms, max {h.max():.1f} ms")
    print(f"server: open descriptors max {max(st.fds, default=0)} (last {st.fds[-1] if st.fds else 0}), "
          f"RSS max {max(st.rss, default=0) / 1024:.0f} MiB; alive at the end: {alive}; exit code {code}")
    for e in st.error_samples[:5]:
        print("  error:", e)
    os.unlink(log)
    bad = st.wrong or st.errors or st.health_failed or not alive or code != 0 or st.ok == 0
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
