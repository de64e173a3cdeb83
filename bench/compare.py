#!/usr/bin/env python3
"""Compare heads with PyTorch, ONNX Runtime and ggml on the shapes of bench/shapes.json, in one run.

    python3 bench/compare.py [--threads 2] [--min-time 1.0] [--dtype f32|bf16] [--rounds 3] [--only NAME ...]
    python3 bench/compare.py --backward [--dtype f32|bf16] [--only NAME ...]  # training: forward + backward
    python3 bench/compare.py --variants                        # sliding window, ALiBi vs explicit masks
    python3 bench/compare.py --kv-int8 [--rounds 3]            # decode shapes over an int8 / 8-bit K/V cache

Prints one markdown table: GFLOP/s (ms for decode shapes, Lq = 1), the ratio of heads to the best
peer, heads' share of the FMA peak measured here (`heads bench peak`), and the peak extra memory
of each runner (resident-set high-water mark during the calls minus the resident set before them,
inputs and outputs excluded). heads is timed by its CLI (`heads bench ... --json`); the peers by
the same rule (warm-up, repeats for at least --min-time seconds, median). --rounds N times every
runner N times per shape, taking turns, and reports the medians: on a shared machine one runner's
slow spell otherwise decides a ratio.
With --backward: SDPA forward and backward (dq, dk, dv for a random dout) of heads
(`heads bench sdpa --backward`) beside PyTorch's autograd through F.scaled_dot_product_attention;
backward time = (forward + backward) - forward, each a median (the two timed in alternating blocks),
and the backward call alone timed inside the forward + backward loop (the difference also holds
what the forward loses when the backward has evicted its inputs from the caches).
ggml is timed through its fused attention (ggml_flash_attn_ext) on the SDPA shapes, K and V in f32
for --dtype f32 and, for --dtype bf16, the faster of ggml's bf16 and f16 (Q is f32 in ggml's
interface); it has no MultiheadAttention module. ONNX Runtime has no
bf16 CPU attention and is left out of --dtype bf16.
With --kv-int8: the decode shapes (Lq = 1) with the query in f32 and K/V stored in 8 bits — heads'
int8 cache (`heads bench sdpa --kv-dtype int8`: a scale per position and kv head) beside ggml's q8_0
(llama.cpp's `--cache-type-k q8_0 --cache-type-v q8_0`: a scale per 32 values; ggml also rounds Q to
q8_0 for the products), with heads' bf16 K/V, ggml's f16 K/V and PyTorch's bf16 SDPA for scale, and
each result's error against float64 attention over the unrounded K and V.
Needs: torch==2.13.0, onnxruntime, onnx, ggml-python (pip; built from source, -march=native).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def median_ms(fn, min_time):
    """Warm-up, then runs for at least min_time seconds (eight at least); the median in ms."""
    return alternating_ms([fn], min_time)[0]


def alternating_ms(fns, min_time, rounds=8):
    """Medians (ms) of each fn, timed in alternating blocks of at least min_time / rounds seconds (one
    run at least) so that a slow spell of a shared machine weighs on every median alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
                if t0 - start + ts[-1] / 1e3 >= min_time / rounds:
                    break
    return [statistics.median(ts) for ts in times]


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB -> MB
    return float("nan")


class Meter:
    """Peak extra resident memory: VmHWM after the calls minus VmRSS once inputs exist. The peak is
    reset first (/proc/self/clear_refs), so what the process held before does not count."""

    def __init__(self):
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # an older kernel: the peak then also holds what came before
        self.base = _status("VmRSS")

    def extra_mb(self):
        return max(0.0, _status("VmHWM") - self.base)


def heads_cli():
    exe = os.environ.get("HEADS_CLI") or shutil.which("heads")
    if not exe:
        sys.exit("compare: the heads CLI is not on PATH (run scripts/setup.sh) and HEADS_CLI is unset")
    return exe


def run_heads(args, *cmd):
    out = subprocess.run([heads_cli(), "bench", *cmd, "--threads", str(args.threads),
                          "--min-time", str(args.min_time), "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- SDPA runners

def torch_sdpa(s, args, torch):
    import torch.nn.functional as F

    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s["B"], s["H"], s["Lq"], s["D"], generator=g).to(dt)
    k = torch.randn(s["B"], s["H"], s["Lk"], s["D"], generator=g).to(dt)
    v = torch.randn(s["B"], s["H"], s["Lk"], s["D"], generator=g).to(dt)
    out = torch.empty(s["B"], s["H"], s["Lq"], s["D"], dtype=dt)
    meter = Meter()
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"])
    with torch.inference_mode():
        ms = median_ms(fn, args.min_time)
    del out
    return ms, meter.extra_mb()


def bf16_bits(a):
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def ggml_decode_8bit(s, args):
    """ggml_flash_attn_ext on a decode shape with K/V in q8_0 (kind "q8_0") or f16: (ms, max |out - f64|
    / max |out| against attention over the unrounded K and V, kind)."""
    import ctypes

    import ggml

    B, H, Lq, Lk, D = s["B"], s["H"], s["Lq"], s["Lk"], s["D"]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for L in (Lq, Lk, Lk))
    kind = s["kv"]
    kv_type = ggml.GGML_TYPE_Q8_0 if kind == "q8_0" else ggml.GGML_TYPE_F16
    row = ggml.ggml_row_size(kv_type, D)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=q.nbytes * 2 + 2 * B * H * Lk * row + (1 << 20),
                                               mem_buffer=None, no_alloc=False))
    tq = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, D, Lq, H, B)
    tk = ggml.ggml_new_tensor_4d(ctx, kv_type, D, Lk, H, B)
    tv = ggml.ggml_new_tensor_4d(ctx, kv_type, D, Lk, H, B)
    ctypes.memmove(ggml.ggml_get_data(tq), q.ctypes.data, q.nbytes)
    for t, a in ((tk, k), (tv, v)):
        if kind == "q8_0":
            src = np.ascontiguousarray(a.reshape(-1, D))
            ggml.ggml_quantize_chunk(kv_type, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ggml.ggml_get_data(t),
                                     0, src.shape[0], D, None)
        else:
            h = a.astype(np.float16)
            ctypes.memmove(ggml.ggml_get_data(t), h.ctypes.data, h.nbytes)
    out = ggml.ggml_flash_attn_ext(ctx, tq, tk, tv, None, 1.0 / float(np.sqrt(D)), 0.0, 0.0)
    ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
    graph = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(graph, out)
    pool_params = ggml.ggml_threadpool_params_default(args.threads)
    pool = ggml.ggml_threadpool_new(ctypes.byref(pool_params))
    plan = ggml.ggml_graph_plan(graph, args.threads, pool)
    work = (ctypes.c_uint8 * max(plan.work_size, 1))()
    plan.work_data = ctypes.cast(work, ctypes.POINTER(ctypes.c_uint8))
    ms = median_ms(lambda: ggml.ggml_graph_compute(graph, ctypes.byref(plan)), args.min_time)
    res = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                shape=(B, Lq, H, D)).transpose(0, 2, 1, 3).astype(np.float64)
    err = rel_err_f64(res, q, k, v)
    ggml.ggml_threadpool_free(pool)
    ggml.ggml_free(ctx)
    return ms, err, kind


def rel_err_f64(out, q, k, v):
    """max |out - ref| / max |ref|, ref = float64 softmax(q kᵀ / √D) v over the unrounded inputs."""
    sc = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    p = np.exp(sc - sc.max(-1, keepdims=True))
    ref = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def heads_decode_8bit(s, args, torch):
    """heads timed by its CLI (`heads bench sdpa --kv-dtype`), and its error on ggml's inputs: a
    heads.KVCache of that dtype (the same quantiser) read by heads.sdpa as stored: (ms, error, kind)."""
    import heads

    heads.set_num_threads(args.threads)
    B, H, Lq, Lk, D = s["B"], s["H"], s["Lq"], s["Lk"], s["D"]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for L in (Lq, Lk, Lk))
    cmd = ["sdpa", "--batch", B, "--heads", H, "--q-len", Lq, "--kv-len", Lk, "--head-dim", D, "--kv-dtype", s["kv"]]
    ms = run_heads(args, *map(str, cmd))["ms"]
    # the error on these inputs, through a cache of that dtype (the same quantiser and kernel)
    cache = heads.KVCache(1, B, H, D, dtype=s["kv"])
    K, V = cache.append(0, k, v, torch_out=True)
    out = heads.sdpa(torch.from_numpy(q), K, V, k_scale=cache.key_scales(0, torch_out=True),
                     v_scale=cache.value_scales(0, torch_out=True)).double().numpy()
    return ms, rel_err_f64(out, q, k, v), s["kv"]


def torch_decode_bf16(s, args, torch):
    import torch.nn.functional as F

    B, H, Lq, Lk, D = s["B"], s["H"], s["Lq"], s["Lk"], s["D"]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for L in (Lq, Lk, Lk))
    tq, tk, tv = (torch.from_numpy(x).bfloat16() for x in (q, k, v))
    with torch.inference_mode():
        ms = median_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv), args.min_time)
        out = F.scaled_dot_product_attention(tq, tk, tv).double().numpy()
    return ms, rel_err_f64(out, q, k, v), "bf16"


def kv8_table(shapes, args):
    """--kv-int8: decode shapes over 8-bit K/V caches (see the module's docstring)."""
    runners = [("heads int8 K/V", "heads-decode-8bit", "int8"), ("heads bf16 K/V", "heads-decode-8bit", "bf16"),
               ("ggml q8_0 K/V", "ggml-decode-8bit", "q8_0"), ("ggml f16 K/V", "ggml-decode-8bit", "f16"),
               ("PyTorch bf16", "torch-decode-bf16", "bf16")]
    print(f"decode over 8-bit K/V caches, {args.threads} threads; ms per call (medians of {args.rounds} rounds), "
          "error = max |out - f64| / max |out| against attention over the unrounded K/V\n")
    print("| shape | " + " | ".join(r[0] for r in runners) + " |")
    print("|---|" + "---|" * len(runners))
    for s in shapes["sdpa"]:
        if s["Lq"] != 1 or (args.only and s["name"] not in args.only):
            continue
        r = rounds({name: (lambda kind=kind, kv=kv: in_subprocess(kind, dict(s, kv=kv), args))
                    for name, kind, kv in runners}, args.rounds)
        cells = [("—" if r[name][0] is None else f"{r[name][0]:.3f} ms (err {r[name][1]:.1e})") for name, _, _ in runners]
        print(f"| {s['name']} | " + " | ".join(cells) + " |")


def ggml_sdpa(s, args):
    """ggml's fused attention (ggml_flash_attn_ext, CPU backend, through the ggml-python package) on a
    persistent thread pool, as llama.cpp runs it. Q is f32 (ggml's interface; it rounds Q to K's type
    for the products); K and V are f32 for --dtype f32, and for --dtype bf16 both of ggml's 16-bit
    types are timed, bf16 and f16 (llama.cpp's default KV cache), and the faster counts. Causal is an
    explicit f16 mask, ggml's only way. After timing, a few query rows of each result are checked
    against a float64 reference on the same rounded K and V, so the time is for the same result.
    Returns (ms, extra MB, K/V type)."""
    import ctypes

    import ggml

    B, H, Lq, Lk, D, causal = s["B"], s["H"], s["Lq"], s["Lk"], s["D"], s["causal"]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for L in (Lq, Lk, Lk))
    f16 = lambda a: a.astype(np.float16)
    kinds = {"f32": (ggml.GGML_TYPE_F32, lambda a: a, lambda a: a)} if args.dtype == "f32" else {
        "bf16": (ggml.GGML_TYPE_BF16, bf16_bits, lambda a: (bf16_bits(a).astype(np.uint32) << 16).view(np.float32)),
        "f16": (ggml.GGML_TYPE_F16, f16, lambda a: f16(a).astype(np.float32))}
    mask = np.where(np.arange(Lk)[None, :] <= np.arange(Lq)[:, None], 0.0, -np.inf).astype(np.float16) if causal else None
    best = None
    for name, (kv_type, conv, rounded) in kinds.items():
        size = q.nbytes + 2 * k.nbytes + q.nbytes + (mask.nbytes if causal else 0) + (1 << 20)
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        tq = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, D, Lq, H, B)  # ggml's ne: innermost first
        tk = ggml.ggml_new_tensor_4d(ctx, kv_type, D, Lk, H, B)
        tv = ggml.ggml_new_tensor_4d(ctx, kv_type, D, Lk, H, B)
        tm = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, Lk, Lq, 1, 1) if causal else None
        for t, a in ((tq, q), (tk, conv(k)), (tv, conv(v))) + (((tm, mask),) if causal else ()):
            ctypes.memmove(ggml.ggml_get_data(t), a.ctypes.data, a.nbytes)
        out = ggml.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, 1.0 / float(np.sqrt(D)), 0.0, 0.0)
        ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
        graph = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(graph, out)
        meter = Meter()  # inputs and output exist; the pool, plan and work buffer count
        pool_params = ggml.ggml_threadpool_params_default(args.threads)
        pool = ggml.ggml_threadpool_new(ctypes.byref(pool_params))
        plan = ggml.ggml_graph_plan(graph, args.threads, pool)
        work = (ctypes.c_uint8 * max(plan.work_size, 1))()
        plan.work_data = ctypes.cast(work, ctypes.POINTER(ctypes.c_uint8))
        fn = lambda: ggml.ggml_graph_compute(graph, ctypes.byref(plan))
        ms = median_ms(fn, args.min_time)
        mem = meter.extra_mb()
        res = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                    shape=(B, Lq, H, D))  # ggml's output is [B, Lq, H, D]
        rows = np.unique(np.linspace(0, Lq - 1, min(Lq, 8)).astype(int))  # a few rows of head 0, batch 0
        qd = q[0, 0, rows].astype(np.float64)
        kd, vd = (rounded(x[0, 0]).astype(np.float64) for x in (k, v))
        sc = qd @ kd.T / np.sqrt(D) + (mask[rows].astype(np.float64) if causal else 0.0)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        err = float(np.abs(res[0, rows, 0] - (pr / pr.sum(-1, keepdims=True)) @ vd).max())
        ggml.ggml_threadpool_free(pool)
        ggml.ggml_free(ctx)
        if not err < (5e-2 if args.dtype == "bf16" else 1e-4):  # (16-bit K: ggml also rounds Q to it)
            print(f"  ggml ({name} K/V) differs from the reference by {err} on {s['name']}: left out", file=sys.stderr)
            continue
        if best is None or ms < best[0]:
            best = (ms, mem, name)
    if best is None:
        raise SystemExit("ggml: no K/V type gave the reference's result")
    return best


# Position variants (--variants): heads' fused options against PyTorch's SDPA with the explicit
# [Lq, Lk] mask or bias a PyTorch user builds for them.
VARIANTS = [
    {"name": "window256-8k", "B": 1, "H": 8, "Lq": 8192, "Lk": 8192, "D": 64, "causal": True, "window": 255},
    {"name": "full-8k", "B": 1, "H": 8, "Lq": 8192, "Lk": 8192, "D": 64, "causal": True},
    {"name": "alibi-2k", "B": 1, "H": 16, "Lq": 2048, "Lk": 2048, "D": 64, "causal": True, "alibi": True},
]


def torch_variant(s, args, torch):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q = torch.randn(s["B"], s["H"], s["Lq"], s["D"], generator=g)
    k = torch.randn(s["B"], s["H"], s["Lk"], s["D"], generator=g)
    v = torch.randn(s["B"], s["H"], s["Lk"], s["D"], generator=g)
    i = torch.arange(s["Lq"])[:, None]
    j = torch.arange(s["Lk"])[None, :]
    meter = Meter()
    if "window" in s:  # the band as a bool mask
        mask = (j <= i) & (j >= i - s["window"])
    elif s.get("alibi"):  # BLOOM's bias (slope · key position) plus the causal -inf, [H, Lq, Lk]
        import heads

        slopes = torch.from_numpy(heads.alibi_slopes(s["H"]))
        mask = slopes[:, None, None] * j.float() + torch.where(j <= i, 0.0, float("-inf"))
    else:
        mask = None
    causal = mask is None and s["causal"]
    fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    with torch.inference_mode():
        ms = median_ms(fn, args.min_time)
    return ms, meter.extra_mb()


def variants_table(args):
    print("| variant | heads ms | PyTorch ms (explicit mask) | heads ÷ PyTorch |\n|---|---|---|---|")
    for s in VARIANTS:
        if args.only and s["name"] not in args.only:
            continue
        cmd = ["sdpa", "--batch", s["B"], "--heads", s["H"], "--q-len", s["Lq"], "--kv-len", s["Lk"],
               "--head-dim", s["D"]] + (["--causal"] if s["causal"] else [])
        cmd += (["--window", f"{s['window']},-1"] if "window" in s else []) + (["--alibi"] if s.get("alibi") else [])
        h = run_heads(args, *map(str, cmd))
        t_ms, _ = in_subprocess("torch-variant", s, args) or (None, None)
        ratio = f"{t_ms / h['ms']:.2f}×" if t_ms else "—"
        print(f"| {s['name']} | {h['ms']:.2f} | {fmt(t_ms, 'ms')} | {ratio} |")


def torch_sdpa_backward(s, args, torch):
    """(forward ms, forward + backward ms, backward call ms) through torch autograd; the last is the
    median of `out.backward(dout)` alone inside the forward + backward loop."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    q, k, v = (torch.randn(s["B"], s["H"], L, s["D"], generator=g).to(dt).requires_grad_()
               for L in (s["Lq"], s["Lk"], s["Lk"]))
    dout = torch.randn(s["B"], s["H"], s["Lq"], s["D"], generator=g).to(dt)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"])

    calls = []

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"])
        q.grad = k.grad = v.grad = None
        t0 = time.perf_counter()
        out.backward(dout)
        calls.append((time.perf_counter() - t0) * 1e3)

    fwd_ms, both_ms = alternating_ms([fwd, fwd_bwd], args.min_time)
    return fwd_ms, both_ms, statistics.median(calls[1:])  # calls[0]: the warm-up


def heads_sdpa_mem(s, args):
    """Extra memory of one heads.sdpa call (the CLI does the timing)."""
    import heads

    heads.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((s["B"], s["H"], s["Lq"], s["D"]), dtype=np.float32)
    k = rng.standard_normal((s["B"], s["H"], s["Lk"], s["D"]), dtype=np.float32)
    v = rng.standard_normal((s["B"], s["H"], s["Lk"], s["D"]), dtype=np.float32)
    out = np.empty((s["B"], s["H"], s["Lq"], s["D"]), np.float32)
    out.fill(0)
    meter = Meter()
    del out
    heads.sdpa(q, k, v, is_causal=s["causal"])
    return None, meter.extra_mb()


def ort_session(model, args):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def ort_sdpa(s, args):
    """Best of ORT's contrib MultiHeadAttention ([B, L, H*D]) and ONNX Attention (opset 23, [B, H, L, D])."""
    from onnx import TensorProto, helper

    B, H, Lq, Lk, D, causal = s["B"], s["H"], s["Lq"], s["Lk"], s["D"], s["causal"]
    rng = np.random.default_rng(0)
    variants = [  # (name, node, q / k / v / o shapes, opsets)
        ("MultiHeadAttention",
         helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=H,
                          unidirectional=int(causal)),
         [[B, Lq, H * D], [B, Lk, H * D], [B, Lk, H * D], [B, Lq, H * D]],
         [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]),
        ("Attention-23", helper.make_node("Attention", ["q", "k", "v"], ["o"], is_causal=int(causal)),
         [[B, H, Lq, D], [B, H, Lk, D], [B, H, Lk, D], [B, H, Lq, D]], [helper.make_opsetid("", 23)]),
    ]
    results = []
    for name, node, shapes, opsets in variants:
        info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, sh) for n, sh in zip("qkvo", shapes)]
        model = helper.make_model(helper.make_graph([node], name, info[:3], info[3:]), ir_version=10,
                                  opset_imports=opsets)
        feeds = {n: rng.standard_normal(sh, dtype=np.float32) for n, sh in zip("qkv", shapes)}
        try:
            sess = ort_session(model, args)
            out = np.zeros(shapes[3], np.float32)
            meter = Meter()
            del out
            fn = lambda: sess.run(None, feeds)
            results.append((name, median_ms(fn, args.min_time), meter.extra_mb()))
            del sess
        except Exception as e:  # an op/shape ORT cannot run here is reported, not hidden
            print(f"  ORT {name} failed on {s['name']}: {e}", file=sys.stderr)
    if not results:
        return None, None, None
    return min(results, key=lambda r: r[1])


# ---------------------------------------------------------------- MHA runners

def torch_mha(m, args, torch):
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    mod = torch.nn.MultiheadAttention(m["E"], m["H"], batch_first=True).eval().to(dt)
    x = torch.randn(m["B"], m["L"], m["E"]).to(dt)
    meter = Meter()
    fn = lambda: mod(x, x, x, need_weights=False)
    with torch.inference_mode():
        return median_ms(fn, args.min_time), meter.extra_mb()


def ort_mha(m, args):
    """contrib Attention (fused QKV projection) followed by the output projection."""
    from onnx import TensorProto, helper, numpy_helper

    B, L, E, H = m["B"], m["L"], m["E"], m["H"]
    rng = np.random.default_rng(0)
    w_qkv = numpy_helper.from_array(rng.standard_normal((E, 3 * E), dtype=np.float32) * 0.02, "w_qkv")
    b_qkv = numpy_helper.from_array(np.zeros(3 * E, np.float32), "b_qkv")
    w_o = numpy_helper.from_array(rng.standard_normal((E, E), dtype=np.float32) * 0.02, "w_o")
    b_o = numpy_helper.from_array(np.zeros(E, np.float32), "b_o")
    nodes = [helper.make_node("Attention", ["x", "w_qkv", "b_qkv"], ["a"], domain="com.microsoft", num_heads=H),
             helper.make_node("MatMul", ["a", "w_o"], ["p"]),
             helper.make_node("Add", ["p", "b_o"], ["y"])]
    graph = helper.make_graph(nodes, "mha", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, L, E])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, L, E])],
                              initializer=[w_qkv, b_qkv, w_o, b_o])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    sess = ort_session(model, args)
    feeds = {"x": rng.standard_normal((B, L, E), dtype=np.float32)}
    meter = Meter()
    fn = lambda: sess.run(None, feeds)
    return median_ms(fn, args.min_time), meter.extra_mb()


# ---------------------------------------------------------------- workers
# Every measurement runs in a fresh process: thread pools of one runner never compete with the
# next, and the memory high-water mark belongs to that runner alone.

def worker(kind, spec, args):
    if kind == "torch-sdpa":
        import torch

        torch.set_num_threads(args.threads)
        return torch_sdpa(spec, args, torch)
    if kind == "torch-variant":
        import torch

        torch.set_num_threads(args.threads)
        return torch_variant(spec, args, torch)
    if kind == "torch-sdpa-backward":
        import torch

        torch.set_num_threads(args.threads)
        return torch_sdpa_backward(spec, args, torch)
    if kind == "torch-mha":
        import torch

        torch.set_num_threads(args.threads)
        return torch_mha(spec, args, torch)
    if kind == "ort-sdpa":
        name, ms, mem = ort_sdpa(spec, args)
        return ms, mem, name
    if kind == "ggml-sdpa":
        return ggml_sdpa(spec, args)
    if kind == "ggml-decode-8bit":
        return ggml_decode_8bit(spec, args)
    if kind in ("heads-decode-8bit", "torch-decode-bf16"):
        import torch

        torch.set_num_threads(args.threads)
        return (heads_decode_8bit if kind == "heads-decode-8bit" else torch_decode_bf16)(spec, args, torch)
    if kind == "ort-mha":
        return ort_mha(spec, args)
    if kind == "heads-sdpa-mem":
        return heads_sdpa_mem(spec, args)
    raise SystemExit(f"unknown worker {kind}")


def in_subprocess(kind, spec, args):
    cmd = [sys.executable, __file__, "--worker", kind, json.dumps(spec), "--threads", str(args.threads),
           "--min-time", str(args.min_time), "--dtype", args.dtype]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  {kind} failed on {spec.get('name')}: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def rounds(runners, n):
    """Each runner (a function giving (ms, extra MB[, what ran]), or None on failure; None: not run) is
    called once per round, the first of a round rotating, so that a slow spell of a shared machine
    weighs on every runner alike; per runner (median ms, median MB, what ran in its fastest round),
    Nones where it never ran. (ggml's K/V type is the same in every round unless the times of its two
    types cross.)"""
    names = list(runners)
    got = {name: [] for name in names}
    for r in range(n):
        for name in names[r % len(names):] + names[:r % len(names)]:
            res = runners[name]() if runners[name] else None
            if res is not None:
                got[name].append((res[0], res[1], res[2] if len(res) > 2 else None))
    med = lambda xs: statistics.median(xs) if xs and None not in xs else None
    kind = lambda v: min((x for x in v if x[0] is not None), key=lambda x: x[0], default=(None, None, None))[2]
    return {name: (med([x[0] for x in v]), med([x[1] for x in v]), kind(v)) for name, v in got.items()}


def fmt(x, unit):
    if x is None:
        return "—"
    return f"{x:.2f} ms" if unit == "ms" else f"{x:.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--only", nargs="*", help="shape names to run (default: all)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every runner this many times per shape, taking turns; medians (default 1)")
    ap.add_argument("--shapes", default=str(HERE / "shapes.json"))
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--backward", action="store_true",
                    help="forward + backward (training) of heads and PyTorch autograd, in --dtype")
    ap.add_argument("--variants", action="store_true",
                    help="sliding window and ALiBi in heads' kernel against PyTorch with the explicit mask, f32")
    ap.add_argument("--kv-int8", action="store_true",
                    help="decode shapes with 8-bit K/V: heads int8 against ggml q8_0 (and 16-bit K/V for scale)")
    ap.add_argument("--memory-only", action="store_true",
                    help="only heads' extra memory per shape, plus L = 32768 (B 1, H 8, D 128)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]), args)))
        return

    import torch

    shapes = json.loads(Path(args.shapes).read_text())
    if args.memory_only:
        long = {"name": "long32k", "B": 1, "H": 8, "Lq": 32768, "Lk": 32768, "D": 128, "causal": False}
        print("| shape | heads extra memory (MB) |\n|---|---|")
        for s in shapes["sdpa"] + [long]:
            r = in_subprocess("heads-sdpa-mem", s, args)
            print(f"| {s['name']} | {'—' if r is None else f'{r[1]:.1f}'} |")
        return
    if args.backward:
        backward_table(shapes, args)
        return
    if args.variants:
        variants_table(args)
        return
    if args.kv_int8:
        kv8_table(shapes, args)
        return
    pk = run_heads(args, "peak")
    # bf16: the best bf16 unit the path has (AMX tiles, else vdpbf16ps), else the f32 FMA peak.
    bf16_peak = max(pk.get("amx_bf16_gflops", 0), pk.get("bf16_gflops", 0))
    peak = bf16_peak if args.dtype == "bf16" and bf16_peak else pk["gflops"]
    print(f"machine: f32 FMA peak {pk['gflops']:.0f} GFLOP/s, bf16 dot peak {pk.get('bf16_gflops', 0):.0f}, "
          f"AMX bf16 peak {pk.get('amx_bf16_gflops', 0):.0f} on {args.threads} threads (heads bench peak); torch {torch.__version__}; dtype {args.dtype}; "
          f"% of peak is of the {args.dtype} peak\n")
    rows = []
    for s in shapes["sdpa"]:
        if args.only and s["name"] not in args.only:
            continue
        flops = 4.0 * s["B"] * s["H"] * s["Lq"] * s["Lk"] * s["D"] / (2 if s["causal"] else 1)
        decode = s["Lq"] == 1
        cmd = ["sdpa", "--batch", s["B"], "--heads", s["H"], "--q-len", s["Lq"], "--kv-len", s["Lk"],
               "--head-dim", s["D"], "--dtype", args.dtype] + (["--causal"] if s["causal"] else [])
        hm = in_subprocess("heads-sdpa-mem", s, args) if args.dtype == "f32" else None
        h_mem = hm[1] if hm else float("nan")
        r = rounds({"heads": lambda: (run_heads(args, *map(str, cmd))["ms"], None),
                    "torch": lambda: in_subprocess("torch-sdpa", s, args),
                    "ort": (lambda: in_subprocess("ort-sdpa", s, args)) if args.dtype == "f32" else None,
                    "ggml": lambda: in_subprocess("ggml-sdpa", s, args)}, args.rounds)
        (h_ms, _, _), (t_ms, t_mem, _), (o_ms, o_mem, _), (g_ms, g_mem, _) = r["heads"], r["torch"], r["ort"], r["ggml"]
        g_kind = r["ggml"][2]
        rows.append((s["name"], decode, flops, h_ms, h_mem, t_ms, t_mem, o_ms, o_mem, g_ms, g_mem, g_kind))
        print(f"  {s['name']}: heads {h_ms:.3f} ms, torch {t_ms} ms, ORT {o_ms} ms, ggml {g_ms} ms ({g_kind} K/V)",
              file=sys.stderr)
    for m in shapes["mha_module"]:
        if args.only and m["name"] not in args.only:
            continue
        flops = 4.0 * m["B"] * m["L"] * m["L"] * m["E"] + 4 * 2.0 * m["B"] * m["L"] * m["E"] ** 2
        cmd = ["mha", "--batch", m["B"], "--seq", m["L"], "--embed", m["E"], "--heads", m["H"], "--dtype", args.dtype]
        r = rounds({"heads": lambda: (run_heads(args, *map(str, cmd))["ms"], None),
                    "torch": lambda: in_subprocess("torch-mha", m, args),
                    "ort": (lambda: in_subprocess("ort-mha", m, args)) if args.dtype == "f32" else None}, args.rounds)
        (h_ms, _, _), (t_ms, t_mem, _), (o_ms, o_mem, _) = r["heads"], r["torch"], r["ort"]
        rows.append((m["name"], False, flops, h_ms, float("nan"), t_ms, t_mem, o_ms, o_mem, None, None, None))
        print(f"  {m['name']}: heads {h_ms:.3f} ms, torch {t_ms} ms, ORT {o_ms} ms", file=sys.stderr)

    print("| shape | heads | PyTorch | ONNX Runtime | ggml | heads ÷ best peer | % of peak | "
          "extra memory heads / torch / ORT / ggml (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, decode, flops, h_ms, h_mem, t_ms, t_mem, o_ms, o_mem, g_ms, g_mem, g_kind in rows:
        unit = "ms" if decode else "gf"
        val = (lambda ms: ms) if decode else (lambda ms: None if ms is None else flops / ms / 1e6)
        peers = [x for x in (t_ms, o_ms, g_ms) if x is not None]
        ratio = min(peers) / h_ms if peers else float("nan")  # > 1: heads is faster
        pct = flops / h_ms / 1e6 / peak * 100
        mem = " / ".join("—" if x is None or x != x else f"{x:.0f}" for x in (h_mem, t_mem, o_mem, g_mem))
        kind = f" ({g_kind} K/V)" if g_ms is not None and args.dtype == "bf16" else ""
        print(f"| {name} | {fmt(val(h_ms), unit)} | {fmt(val(t_ms), unit)} | {fmt(val(o_ms), unit)} | {fmt(val(g_ms), unit)}{kind} | "
              f"{ratio:.2f}× | {pct:.0f}% | {mem} |")
    print("\nGFLOP/s unless marked ms (decode shapes: time per call). flops = 4·B·H·Lq·Lk·D (half when causal); "
          "mha adds 2·B·L·E² per projection.")


def backward_table(shapes, args):
    import torch

    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}; times are medians in ms; bwd = (fwd + bwd) "
          "- fwd, bwd call = the backward call alone, timed inside the fwd + bwd loop\n")
    print("| shape | heads fwd | heads bwd | heads bwd call | heads bwd ÷ fwd | heads bwd call ÷ fwd | PyTorch fwd | "
          "PyTorch bwd | PyTorch bwd call | PyTorch ÷ heads (bwd) | PyTorch ÷ heads (bwd call) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in shapes["sdpa"]:
        if args.only and s["name"] not in args.only:
            continue
        cmd = ["sdpa", "--batch", s["B"], "--heads", s["H"], "--q-len", s["Lq"], "--kv-len", s["Lk"],
               "--head-dim", s["D"], "--dtype", args.dtype] + (["--causal"] if s["causal"] else [])
        j = run_heads(args, *map(str, cmd + ["--backward"]))  # times the forward alone first
        both, h_call = j["ms"], j["backward_call_ms"]
        fwd = both - j["backward_ms"]
        t = in_subprocess("torch-sdpa-backward", s, args)
        h_bwd = both - fwd
        t_fwd, t_both, t_call = (None, None, None) if t is None else t
        t_bwd = None if t is None else t_both - t_fwd
        f = lambda x: "—" if x is None else f"{x:.2f}"
        over = lambda a, b: "—" if a is None else f"{a / b:.2f}×"
        print(f"| {s['name']} | {f(fwd)} | {f(h_bwd)} | {f(h_call)} | {h_bwd / fwd:.2f} | {h_call / fwd:.2f} | "
              f"{f(t_fwd)} | {f(t_bwd)} | {f(t_call)} | {over(t_bwd, h_bwd)} | {over(t_call, h_call)} |", flush=True)

if __name__ == "__main__":
    main()
