"""Reduced-precision models from Python: `heads quantize` / heads.quantize directories, and
heads.torch.quantize_dynamic module by module, against float64 evaluations of what each stores and
beside torch's own quantize_dynamic."""

import io
import os
import pickle
import shutil
import subprocess
import warnings

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import heads
import heads.torch as ht

HEADS = os.environ.get("HEADS_CLI") or shutil.which("heads")
TEXTS = ["The cat sat on the mat.", "Quantized weights, loaded exactly as they were stored!", "x",
         "Attention is all you need."]


def cli(*args):
    assert HEADS, "the heads CLI is not on PATH (run the README's set-up) and HEADS_CLI is unset"
    return subprocess.run([HEADS, *map(str, args)], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "int8"
    r = cli("quantize", heads.SentenceEncoder().model_dir, out, "--dtype", "int8")
    assert r.returncode == 0, r.stderr
    assert "36 in int8" in r.stderr
    return out


def test_cli_int8_directory_embeds_as_load_time_int8(int8_dir, tmp_path):
    """`heads embed` on the quantized directory runs int8 (the default dtype follows it) and gives
    exactly the embeddings of quantizing at load time; --dtype f32 runs the stored values in f32."""
    r = cli("embed", "--dtype", "int8", "--quiet", "--output", tmp_path / "at_load.npy", *TEXTS)
    assert r.returncode == 0, r.stderr
    r = cli("embed", "--model", int8_dir, "--quiet", "--output", tmp_path / "stored.npy", *TEXTS)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(tmp_path / "at_load.npy"), np.load(tmp_path / "stored.npy"))
    r = cli("embed", "--model", int8_dir, "--dtype", "f32", "--quiet", "--output", tmp_path / "deq.npy", *TEXTS)
    assert r.returncode == 0, r.stderr
    r = cli("embed", "--quiet", "--output", tmp_path / "f32.npy", *TEXTS)
    assert r.returncode == 0, r.stderr
    deq, f32 = np.load(tmp_path / "deq.npy"), np.load(tmp_path / "f32.npy")
    cos = (deq.astype(np.float64) * f32).sum(1)
    assert cos.min() > 0.998 and not np.array_equal(deq, f32), cos
    # The file holds what the docs say: int8 [out, in] and float32 [out] scales, weight = int8 * scale.
    t = load_file(str(int8_dir / "model.safetensors"))
    src = load_file(os.path.join(heads.SentenceEncoder().model_dir, "model.safetensors"))
    name = "encoder.layer.5.attention.self.value.weight"
    assert t[name].dtype == np.int8 and t[name + "_scale"].shape == (384,) and t[name + "_scale"].dtype == np.float32
    deq_w = t[name].astype(np.float64) * t[name + "_scale"][:, None]
    # The calibrated outlier channels: zero in the int8 weight, their columns stored as they are in f32
    # (every feed-forward output layer has some: its hidden units carry dozens).
    assert all(f"encoder.layer.{i}.output.dense.weight_outlier_channels" in t for i in range(6))
    if name + "_outlier_channels" in t:
        oc = t[name + "_outlier_channels"]
        assert oc.dtype == np.int64 and (np.diff(oc) > 0).all() and (t[name][:, oc] == 0).all()
        assert np.array_equal(t[name + "_outlier_weight"], src[name][:, oc])
        deq_w[:, oc] = t[name + "_outlier_weight"]
    step = t[name + "_scale"][:, None]
    # Each weight inside the clip range is within half a step of the original; the ones at ±127 steps
    # had at least 126.5 steps of magnitude (the clipped end of the row).
    inside = np.abs(t[name]) < 127
    assert (np.abs(deq_w - src[name])[inside] <= (step / 2 * (1 + 1e-6) + 0 * deq_w)[inside]).all()
    assert (np.abs(src[name])[~inside] >= ((126.5 - 1e-3) * step + 0 * deq_w)[~inside]).all()
    assert np.abs(deq_w - src[name]).max() > 0
    # bench embed reports the precision in force.
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(TEXTS) + "\n")
    r = cli("bench", "embed", "--model", int8_dir, "--dtype", "auto", "--input", lines, "--min-time", 0, "--json")
    assert r.returncode == 0, r.stderr
    assert '"dtype":"int8"' in r.stdout


def test_cli_quantize_errors(int8_dir, tmp_path):
    r = cli("quantize", heads.SentenceEncoder().model_dir, int8_dir)
    assert r.returncode == 1 and "exists and is not an empty directory" in r.stderr, r.stderr
    r = cli("quantize", int8_dir, tmp_path / "again")
    assert r.returncode == 1 and "is already int8" in r.stderr and not (tmp_path / "again").exists(), r.stderr
    r = cli("quantize", heads.SentenceEncoder().model_dir, tmp_path / "x", "--dtype", "int4")
    assert r.returncode == 2 and "--dtype" in r.stderr
    r = cli("quantize", tmp_path / "missing", tmp_path / "y")
    assert r.returncode == 1 and "model directory not found" in r.stderr
    r = cli("quantize", "--help")
    assert r.returncode == 0 and "_scale" in r.stdout


def test_python_quantize_and_sentence_encoder(tmp_path):
    model = heads.SentenceEncoder().model_dir
    info = heads.quantize(model, tmp_path / "q8")
    assert info["converted"] == 36 and info["bytes_out"] < info["bytes_in"]
    enc = heads.SentenceEncoder(tmp_path / "q8")
    assert enc.dtype == "int8"
    e = enc.encode(TEXTS)
    assert np.array_equal(e, heads.SentenceEncoder(model, dtype="int8").encode(TEXTS))
    again = pickle.loads(pickle.dumps(enc))
    assert again.dtype == "int8" and np.array_equal(again.encode(TEXTS), e)
    assert heads.SentenceEncoder(tmp_path / "q8", dtype="f32").dtype == "f32"
    # f16: the weights rounded once; embeddings within f16's rounding of f32.
    heads.quantize(model, tmp_path / "h", dtype="f16")
    h = heads.SentenceEncoder(tmp_path / "h")
    assert h.dtype == "f32"
    cos = (h.encode(TEXTS).astype(np.float64) * heads.SentenceEncoder(model).encode(TEXTS)).sum(1)
    assert cos.min() > 0.99999, cos
    with pytest.raises(ValueError, match="dtype"):
        heads.quantize(model, tmp_path / "z", dtype="fp8")


def _f64_reference(module):
    m = module.double().eval()
    return m


def _dequantized(qsd):
    """A float64 state dict from a quantized one: each int8 weight times its scales, plus the
    residual term on its rows."""
    out = {}
    for k, v in qsd.items():
        if k.endswith(("_scale", "_residual", "_residual_rows")):
            continue
        if v.dtype == torch.int8:
            v = v.double() * qsd[k + "_scale"].double()[:, None]
            if k + "_residual_rows" in qsd:
                v[qsd[k + "_residual_rows"]] += qsd[k + "_residual"].double() * qsd[k + "_residual_scale"].double()[:, None]
        out[k] = v.double()
    return out


INT8_ACTIVATION_ERROR = 0.0  # heads/precision.h: PackedLinear's default activation_error (two terms on every row)


def _activation_bound(x, w):
    """heads' int8 linear vs x·Wᵀ in float64 with the stored W: each row of x is off by at most half
    a step of its last int8 term (docs/numerics.md) — the asymmetric term's (max(0, max x) −
    min(0, min x)) / 255, or, on the rows whose estimated rounding loss sqrt(K / (12·Σ (q − z)²))
    exceeds the weight's activation_error, the residual term's max|r| / 127 — times Σ|W| of the output."""
    xs = x.float().reshape(-1, x.shape[-1])
    lo, hi = xs.amin(-1).clamp(max=0), xs.amax(-1).clamp(min=0)
    s = hi / 255 - lo / 255
    zero = ~(s >= torch.finfo(torch.float32).tiny)
    s = torch.where(zero, torch.ones_like(s), s)
    inv = 1 / s
    zp = torch.where(zero, torch.zeros_like(s), (-lo * inv).round().clamp(0, 255))
    t = ((xs * inv[:, None]).round() + zp[:, None]).clamp(0, 255) - zp[:, None]
    e2 = (t.double() ** 2).sum(-1)
    two = (e2 > 0) & (xs.shape[-1] > 12 * INT8_ACTIVATION_ERROR**2 * e2)
    sr = (xs.double() - t.double() * s.double()[:, None]).abs().amax(-1) / 127
    half = torch.where(two, sr, s.double()) / 2 * (1 + 1e-5)
    return half.reshape(*x.shape[:-1], 1) * w.abs().sum(1).double()


@pytest.mark.parametrize("shape", [(1, 7), (3, 129), (2, 5, 33)])
def test_quantized_linear_follows_its_definition(shape):
    torch.manual_seed(sum(shape))
    lin = torch.nn.Linear(shape[-1], 19)
    x = torch.randn(*shape) * 3
    x[..., 0] *= 40  # an outlier in some rows: their rounding loses more, so they get the second term
    q = ht.QuantizedLinear.from_float(lin)
    with torch.no_grad():
        y = q(x)
    w = q.weight().double()
    ref = x.double() @ w.T + lin.bias.double()
    bound = _activation_bound(x, w) + 1e-6 * (x.double().abs() @ w.abs().T + 1)
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], 19)
    assert ((y.double() - ref).abs() <= bound).all()
    # The stored weight is the per-channel rounding of the float one: within one step.
    sd = q.state_dict()
    assert sd["weight"].dtype == torch.int8 and sd["weight_scale"].shape == (19,)
    inside = sd["weight"].abs() < 127
    err = (w - lin.weight.double()).abs()
    assert (err <= sd["weight_scale"].double()[:, None] / 2 * (1 + 1e-6))[inside].all()
    qb = ht.QuantizedLinear.from_float(lin, torch.bfloat16)
    with torch.no_grad():
        yb = qb(x)
    refb = x.bfloat16().double() @ lin.weight.bfloat16().double().T + lin.bias.double()
    assert torch.allclose(yb.double(), refb, rtol=1e-5, atol=1e-5 * refb.abs().max().item())


def test_quantized_linear_errors():
    q = ht.QuantizedLinear.from_float(torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 8\]"):
        with torch.no_grad():
            q(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="for inference"):
        q(torch.randn(3, 8, requires_grad=True))
    with pytest.raises(ValueError, match="nn.Linear"):
        ht.QuantizedLinear.from_float(torch.nn.Conv1d(2, 2, 1))
    sd = q.state_dict()
    del sd["weight_scale"]
    with pytest.raises(RuntimeError, match="its scales \"weight_scale\" are missing"):
        q.load_state_dict(sd)
    with pytest.raises(ValueError, match="dtype"):
        ht.quantize_dynamic(torch.nn.Linear(2, 2), dtype=torch.quint4x2)


@pytest.mark.parametrize("kind", ["self", "cross", "bias_kv", "heads_torch"])
def test_quantized_multihead_attention(kind):
    """The int8 module equals float64 attention with the weights it stores, up to the activations'
    two-term rounding; bf16 stays near the float module."""
    torch.manual_seed(3)
    if kind == "heads_torch":
        m = ht.MultiheadAttention(24, 4, batch_first=True)
        ref_module = torch.nn.MultiheadAttention(24, 4, batch_first=True)
    else:
        kw = dict(kdim=10, vdim=6) if kind == "cross" else dict(add_bias_kv=True) if kind == "bias_kv" else {}
        m = torch.nn.MultiheadAttention(24, 4, batch_first=True, **kw)
        ref_module = torch.nn.MultiheadAttention(24, 4, batch_first=True, **kw)
    q = ht.quantize_dynamic(torch.nn.ModuleList([m]))[0]
    assert isinstance(q, ht.QuantizedMultiheadAttention) and q.dtype == "int8"
    x = torch.randn(2, 7, 24)
    k = torch.randn(2, 9, 10 if kind == "cross" else 24)
    v = torch.randn(2, 9, 6 if kind == "cross" else 24)
    if kind != "cross":
        k = v = x
    mask = torch.rand(2, 9 if kind == "cross" else 7) < 0.2
    mask[:, 0] = False
    ref_module.load_state_dict(_dequantized(q.state_dict()))
    ref_module = _f64_reference(ref_module)
    with torch.no_grad():
        out, w = q(x, k, v, key_padding_mask=mask)
        ref, rw = ref_module(x.double(), k.double(), v.double(), key_padding_mask=mask)
        fl, _ = m(x, k, v, key_padding_mask=mask)
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2e-4 * scale
    assert (w.double() - rw).abs().max().item() <= 2e-4
    assert 0 < (out - fl).abs().max().item() <= 3e-2 * fl.abs().max().item()  # the weights did change
    qb = ht.QuantizedMultiheadAttention.from_float(m, torch.bfloat16)
    with torch.no_grad():
        ob, _ = qb(x, k, v, key_padding_mask=mask)
    assert (ob - fl).abs().max().item() <= 3e-2 * fl.abs().max().item()


@pytest.mark.parametrize("batch_first,norm_first,activation", [(False, False, "relu"), (True, True, "gelu"),
                                                               (True, False, "gelu")])
def test_quantize_dynamic_encoder_beside_torch(batch_first, norm_first, activation):
    """A small model: encoder layers and a head. heads' int8 equals float64 with its stored weights
    (up to the activations' rounding) and is closer to the float model than torch's quantize_dynamic."""
    torch.manual_seed(5)
    layer = torch.nn.TransformerEncoderLayer(48, 4, 80, dropout=0.0, batch_first=batch_first, norm_first=norm_first,
                                             activation=activation)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(48, 5)).eval()
    x = torch.randn(3, 11, 48) if batch_first else torch.randn(11, 3, 48)
    q = ht.quantize_dynamic(model)
    assert type(q[0]) is ht.QuantizedTransformerEncoder and type(q[1]) is ht.QuantizedLinear
    assert type(model[1]) is torch.nn.Linear  # not in place
    ref = _f64_reference(torch.nn.Sequential(
        torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(48, 4, 80, dropout=0.0, batch_first=batch_first,
                                                                     norm_first=norm_first, activation=activation),
                                    2, enable_nested_tensor=False), torch.nn.Linear(48, 5)))
    ref.load_state_dict(_dequantized(q.state_dict()))
    with torch.no_grad():
        y = q(x)
        r = ref(x.double())
        f = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tq = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        # torch's quantized Linear breaks the layer's own fast path in eval (its weight is a method):
        # run it in training mode, which skips that path (dropout is 0, so the same computation).
        t = tq.train()(x)
    assert (y.double() - r).abs().max().item() <= 5e-4 * r.abs().max().item()
    heads_err = (y - f).norm().item()
    torch_err = (t - f).norm().item()
    assert 0 < heads_err < torch_err, (heads_err, torch_err)
    # State dicts and pickles give the same module back, bit for bit.
    again = ht.quantize_dynamic(torch.nn.Sequential(
        torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(48, 4, 80, dropout=0.0, batch_first=batch_first,
                                                                     norm_first=norm_first, activation=activation),
                                    2, enable_nested_tensor=False), torch.nn.Linear(48, 5)).eval())
    again.load_state_dict(q.state_dict())
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(again(x), y) and torch.equal(loaded(x), y)
    with pytest.raises(RuntimeError, match="for inference"):
        q(x.clone().requires_grad_())


def test_quantized_state_dict_of_native_modules():
    """heads.MultiheadAttention in int8: its quantized state dict loads into another module as the same
    int8 module; the int8 parts are read-only views (writing them would change the packed weights)."""
    m = heads.MultiheadAttention(16, 2, batch_first=True).eval()
    m.to("int8")
    sd = m.quantized_state_dict()
    assert sd["in_proj_weight"].dtype == np.int8 and sd["in_proj_weight_scale"].shape == (48,)
    with pytest.raises(ValueError, match="read-only"):
        sd["in_proj_weight"][0, 0] = 1
    other = heads.MultiheadAttention(16, 2, batch_first=True).eval()
    other.load_state_dict(sd)
    assert other.dtype == "int8"
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    assert np.array_equal(other(x, x, x)[0], m(x, x, x)[0])


@pytest.mark.parametrize("dtype", ["bf16", torch.bfloat16, "int8", torch.qint8, "f32", torch.float32])
def test_constructor_dtype_is_to_dtype(dtype):
    """MultiheadAttention(..., dtype=) and TransformerEncoderLayer(..., dtype=) give the module that
    .to(dtype) gives (same seed, same bits); a TransformerEncoder keeps its layer's precision (int8:
    the layer's stored weights, as they are)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 7, 16)).astype(np.float32)
    made = heads.MultiheadAttention(16, 2, batch_first=True, seed=5, dtype=dtype).eval()
    converted = heads.MultiheadAttention(16, 2, batch_first=True, seed=5).eval().to(dtype)
    assert made.dtype == converted.dtype == heads._precision(dtype)
    assert np.array_equal(made(x, x, x)[0], converted(x, x, x)[0])
    layer = heads.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, seed=6, dtype=dtype).eval()
    plain = heads.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, seed=6).eval().to(dtype)
    assert layer.dtype == heads._precision(dtype)
    assert np.array_equal(layer(x), plain(x))
    enc = heads.TransformerEncoder(layer, 2).eval()
    assert enc.dtype == layer.dtype
    if layer.dtype == "int8":  # the layers hold the layer's int8 weights, bit for bit
        qsd = enc.quantized_state_dict()
        for k, v in layer.quantized_state_dict().items():
            assert np.array_equal(qsd[f"layers.1.{k}"], v), k
    y = np.asarray(layer(x))
    assert np.array_equal(np.asarray(enc(x)), np.asarray(layer(y)))
    with pytest.raises(ValueError, match="dtype: expected f32, bf16 or int8"):
        heads.MultiheadAttention(16, 2, dtype="fp8")


def test_quantize_dynamic_spec_and_inplace():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    q = ht.quantize_dynamic(model, {"2"})
    assert type(q[0]) is torch.nn.Linear and type(q[2]) is ht.QuantizedLinear
    same = ht.quantize_dynamic(model, {torch.nn.Linear}, inplace=True)
    assert same is model and type(model[0]) is ht.QuantizedLinear
    # A layer left as it is keeps its own attention (its fast path reads those weights).
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    ql = ht.quantize_dynamic(torch.nn.Sequential(layer), {torch.nn.MultiheadAttention, torch.nn.Linear})
    assert type(ql[0].self_attn) is torch.nn.MultiheadAttention and type(ql[0].linear1) is torch.nn.Linear
    with torch.no_grad():  # torch's fast path (eval, batch_first, even heads) still runs
        assert torch.equal(ql(torch.ones(2, 3, 16)), layer(torch.ones(2, 3, 16)))
    # float32 stays float32 through a state dict; a missing bias is reported.
    lin = torch.nn.Linear(6, 3)
    qf = ht.QuantizedLinear.from_float(lin, torch.float32)
    sd = qf.state_dict()
    assert sd["weight"].dtype == torch.float32 and torch.equal(sd["weight"], lin.weight.detach())
    result = qf.load_state_dict({"weight": sd["weight"]}, strict=False)
    assert result.missing_keys == ["bias"]


def test_torch_module_factory_arguments():
    # heads.torch.MultiheadAttention takes torch's device= and dtype=: float32 on the CPU is the
    # trainable module; another dtype is a clear error that points to quantize_dynamic, which
    # makes the reduced-precision module (equal to the native module's .to(dtype))
    torch.manual_seed(0)
    m = ht.MultiheadAttention(16, 4, 0.0, True, False, False, None, None, True, "cpu", torch.float32)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in m.parameters())
    for dtype in (torch.bfloat16, torch.qint8, torch.float64):
        with pytest.raises(ValueError, match=r"dtype.*quantize_dynamic"):
            ht.MultiheadAttention(16, 4, dtype=dtype)
    with pytest.raises(ValueError, match="device"):
        ht.MultiheadAttention(16, 4, device="meta")
    x = torch.randn(2, 5, 16)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.qint8, "int8")):
        q = ht.quantize_dynamic(m, dtype=dtype)
        native = heads.MultiheadAttention(16, 4, batch_first=True, dtype=name)
        native.load_state_dict({k: v.detach() for k, v in m.state_dict().items()})
        native.eval()
        with torch.no_grad():
            got = q(x, x, x, need_weights=False)[0]
        want = native(x, x, x, need_weights=False)[0]
        assert np.array_equal(np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)), name
