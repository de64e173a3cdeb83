"""Bad, odd and hostile input through the Python module, each case against PyTorch where it has an
answer: no keys, non-finite numbers, torch's CausalBias, argument errors, threads, copies."""

import copy
import io
import os
import pickle
import shutil
import subprocess
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import heads
import heads.torch as ht

HEADS_CLI = os.environ.get("HEADS_CLI") or shutil.which("heads")


def rnd(*shape, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


# --- no keys -------------------------------------------------------------------------------------

@pytest.mark.parametrize("lq", [1, 3, 4, 5, 33])
def test_no_keys_gives_zero_rows(lq):
    # Lq <= 4 takes the decode kernel, which once divided by a chunk size of 0 (SIGFPE)
    q = np.ones((2, lq, 8), np.float32)
    kv = np.ones((2, 0, 8), np.float32)
    out, w = heads.sdpa(q, kv, kv, need_weights=True)
    assert out.shape == (2, lq, 8) and w.shape == (2, lq, 0)
    assert (out == 0).all()


def test_mha_with_no_keys_gives_the_output_bias():
    m = heads.MultiheadAttention(8, 2)
    x = np.random.default_rng(1).standard_normal((1, 3, 8)).astype(np.float32)
    y = np.zeros((0, 3, 8), np.float32)
    out, w = m(x, y, y)
    np.testing.assert_array_equal(out, np.broadcast_to(m.state_dict()["out_proj.bias"], out.shape))
    assert w.shape == (3, 1, 0)


def test_cli_mha_with_no_keys(tmp_path):
    from safetensors.numpy import load_file, save_file

    assert HEADS_CLI, "the heads CLI is not on PATH (run the README's set-up) and HEADS_CLI is unset"

    ref = torch.nn.MultiheadAttention(8, 2).eval()
    save_file({k: v.numpy() for k, v in ref.state_dict().items()}, str(tmp_path / "s.safetensors"))
    save_file({"query": np.ones((1, 1, 8), np.float32), "key": np.ones((0, 1, 8), np.float32),
               "value": np.ones((0, 1, 8), np.float32)}, str(tmp_path / "i.safetensors"))
    r = subprocess.run([HEADS_CLI, "mha", "--state", str(tmp_path / "s.safetensors"), "--input",
                        str(tmp_path / "i.safetensors"), "--output", str(tmp_path / "o.safetensors"),
                        "--num-heads", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = load_file(str(tmp_path / "o.safetensors"))["output"]
    np.testing.assert_array_equal(out[0, 0], ref.state_dict()["out_proj.bias"].numpy())


# --- non-finite inputs ---------------------------------------------------------------------------

def nan_rows(x):
    return torch.as_tensor(x).isnan().any(-1)


@pytest.mark.parametrize("lq,lk", [(2, 40), (2, 1300), (40, 70), (40, 300)])
@pytest.mark.parametrize("case", ["query", "key", "value", "inf_score", "float_mask"])
def test_non_finite_inputs_reach_the_rows_torch_finds(lq, lk, case):
    """NaN rows where PyTorch (math SDPA) has them, the other rows equal to PyTorch's; decode
    (Lq = 2, keys split in chunks at 1300) and tiled shapes."""
    q, k, v = rnd(1, 2, lq, 16, seed=1), rnd(1, 2, lk, 16, seed=2), rnd(1, 2, lk, 16, seed=3)
    mask = None
    if case == "query":
        q[0, 1, 1, 5] = float("nan")
    elif case == "key":
        k[0, 0, lk - 3, 2] = float("nan")
    elif case == "value":
        v[0, 1, 7, 0] = float("nan")
    elif case == "inf_score":
        k[..., 0] = k[..., 0].abs() + 0.5
        q[0, 0, 1, 0] = float("inf")
    else:
        mask = rnd(lq, lk, seed=4)
        mask[1, 3] = float("nan")
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                         attn_mask=None if mask is None else mask.double())
    out = heads.sdpa(q, k, v, attn_mask=mask)
    assert nan_rows(ref).any()
    assert torch.equal(nan_rows(out), nan_rows(ref)), (nan_rows(out), nan_rows(ref))
    fin = ~nan_rows(ref)
    torch.testing.assert_close(out[fin].double(), ref[fin], rtol=1e-5, atol=1e-6)


def test_nan_key_hidden_by_a_bool_mask_does_not_reach_the_row():
    q, k, v = rnd(1, 1, 6, 8, seed=1), rnd(1, 1, 9, 8, seed=2), rnd(1, 1, 9, 8, seed=3)
    k[0, 0, 4, 1] = float("nan")
    m = torch.ones(6, 9, dtype=torch.bool)
    m[:3, 4] = False  # rows 0-2 do not see key 4
    out = heads.sdpa(q, k, v, attn_mask=m)
    assert nan_rows(out).tolist() == [[[False] * 3 + [True] * 3]]
    kf = k.clone()
    kf[0, 0, 4] = 0.0  # the rows that do not see key 4 are what they would be without the NaN
    torch.testing.assert_close(out[0, 0, :3], heads.sdpa(q, kf, v, attn_mask=m)[0, 0, :3], rtol=0, atol=0)


def test_nan_query_gives_nan_gradients_where_torch_does():
    q, k, v = rnd(1, 2, 40, 16, seed=1), rnd(1, 2, 50, 16, seed=2), rnd(1, 2, 50, 16, seed=3)
    q[0, 0, 7, 3] = float("nan")
    g = rnd(1, 2, 40, 16, seed=4)
    grads = []
    for fn in (F.scaled_dot_product_attention, ht.scaled_dot_product_attention):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv).backward(g)
        grads.append((qq.grad, kk.grad, vv.grad))
    for ours, ref in zip(grads[1], grads[0]):
        assert torch.equal(ours.isnan(), ref.isnan())
        fin = ~ref.isnan()
        torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-4, atol=1e-5)


# --- torch's CausalBias and bottom-right alignment --------------------------------------------------

@pytest.mark.parametrize("lq,lk", [(4, 6), (6, 6), (3, 40), (40, 70)])
@pytest.mark.parametrize("variant", [causal_upper_left, causal_lower_right])
def test_causal_bias_as_torch_reads_it(lq, lk, variant):
    q, k, v = rnd(2, 2, lq, 16, seed=1), rnd(2, 2, lk, 16, seed=2), rnd(2, 2, lk, 16, seed=3)
    bias = variant(lq, lk)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(heads.sdpa(q, k, v, attn_mask=bias), ref, rtol=1e-5, atol=1e-6)
    name = "lower_right" if variant is causal_lower_right else "upper_left"
    torch.testing.assert_close(heads.sdpa(q, k, v, is_causal=True, causal_variant=name), ref, rtol=1e-5, atol=1e-6)
    # training: forward and backward through heads.torch, against torch autograd
    g = rnd(2, 2, lq, 16, seed=4)
    grads = []
    for fn in (F.scaled_dot_product_attention, ht.scaled_dot_product_attention):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv, attn_mask=bias).backward(g)
        grads.append((qq.grad, kk.grad, vv.grad))
    for ours, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_causal_bias_errors_and_other_tensor_subclasses():
    q = rnd(1, 1, 4, 8)
    k = rnd(1, 1, 6, 8)
    with pytest.raises(ValueError, match="CausalBias for Lq=4, Lk=7 does not match query Lq=4 and key Lk=6"):
        heads.sdpa(q, k, k, attn_mask=causal_lower_right(4, 7))
    with pytest.raises(ValueError, match="already causal"):
        heads.sdpa(q, k, k, attn_mask=causal_lower_right(4, 6), is_causal=True)
    with pytest.raises(ValueError, match="causal_variant: expected 'upper_left' or 'lower_right'"):
        heads.sdpa(q, k, k, is_causal=True, causal_variant="bottom")

    class Odd(torch.Tensor):
        pass

    with pytest.raises(ValueError, match="attn_mask: tensor subclass Odd is not supported"):
        heads.sdpa(q, k, k, attn_mask=torch.zeros(4, 6).as_subclass(Odd))
    with pytest.raises(ValueError, match="key: tensor subclass Odd is not supported"):
        heads.sdpa(q, k.as_subclass(Odd), k)
    # nn.Parameter is a plain tensor to read
    heads.sdpa(q, torch.nn.Parameter(k), k)


# --- argument errors are ValueError naming the argument ----------------------------------------------

def test_bad_arguments_are_value_errors():
    enc = heads.SentenceEncoder()
    x = np.zeros((3, 2, 8), np.float32)
    m = heads.MultiheadAttention(8, 2)
    cases = [
        (lambda: enc.encode(["a\ud800b"]), r"sentences\[0\]: not valid Unicode text .*'\\ud800' at position 1"),
        (lambda: enc.encode("a\udfffb"), "sentences: not valid Unicode"),
        (lambda: enc.tokenize("\ud800"), "text: not valid Unicode"),
        (lambda: enc.encode([3]), r"sentences\[0\]: expected a str, got int"),
        (lambda: enc.encode(["a"], batch_size=0), "batch_size: expected an integer in"),
        (lambda: heads.sdpa(x, x, x, dropout_p=0.5, seed=-1), r"seed: expected an integer in \[0, 18446744073709551615\], got -1"),
        (lambda: heads.sdpa(x, x, x, seed=2**70), "seed: expected an integer in"),
        (lambda: heads.manual_seed(-5), "manual_seed: seed: expected an integer"),
        (lambda: heads.MultiheadAttention(8, 2, seed=-1), "seed: expected an integer"),
        (lambda: m(x, None, x), "key: expected an array or tensor, got None"),
        (lambda: m(x, x, None), "value: expected an array or tensor, got None"),
        (lambda: heads.sdpa("abc", x, x), "query: expected a numeric array or tensor, got str"),
        (lambda: heads.sdpa(x, [["a"]], x), "key: expected a numeric array or tensor"),
        (lambda: heads.MultiheadAttention(1 << 62, 1), r"embed_dim: expected an integer in \[1, 16777216\]"),
        (lambda: heads.MultiheadAttention(8.5, 2), "embed_dim: expected an integer, got float 8.5"),
        (lambda: heads.TransformerEncoderLayer(8, 2, dim_feedforward=-4), "dim_feedforward: expected an integer"),
        (lambda: heads.set_num_threads(100000), r"set_num_threads: n: expected an integer in \[1, 1024\]"),
        (lambda: heads.set_num_threads(0), "set_num_threads"),
        (lambda: heads.sdpa(x, x, x, dropout_p=1.5), r"dropout_p must be in \[0, 1\], got 1.5"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()


def test_thread_count_limit_in_the_native_layer():
    before = heads.get_num_threads()
    with pytest.raises(ValueError, match=r"set_num_threads: expected 1 to 1024 threads, got 100000"):
        heads._heads.set_num_threads(100000)
    assert heads.get_num_threads() == before


# --- dtypes and dropout that PyTorch accepts --------------------------------------------------------

@pytest.mark.parametrize("lq", [3, 40])
def test_f64_and_f16_inputs_against_torch(lq):
    q, k, v = rnd(2, 2, lq, 16, seed=1), rnd(2, 2, 50, 16, seed=2), rnd(2, 2, 50, 16, seed=3)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    out = heads.sdpa(q.double(), k.double(), v.double(), is_causal=True)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # computed in f32
    o16 = heads.sdpa(q.half(), k.half(), v.half(), is_causal=True)
    t16 = F.scaled_dot_product_attention(q.half(), k.half(), v.half(), is_causal=True)
    assert o16.dtype == torch.float16
    assert (o16.double() - ref).abs().max() <= 2 * (t16.double() - ref).abs().max() + 1e-3
    n64 = heads.sdpa(q.double().numpy(), k.double().numpy(), v.double().numpy(), is_causal=True)
    assert n64.dtype == np.float64
    # training in f64 through heads.torch: gradients in f64, as torch's
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    ht.scaled_dot_product_attention(qq, kk, vv, is_causal=True).sum().backward()
    q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True).sum().backward()
    assert qq.grad.dtype == torch.float64
    torch.testing.assert_close(qq.grad, q2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kk.grad, k2.grad, rtol=1e-4, atol=1e-5)


def test_dropout_of_one_drops_everything_as_torch():
    q, k, v = rnd(1, 2, 5, 8), rnd(1, 2, 7, 8), rnd(1, 2, 7, 8)
    ref = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    out = heads.sdpa(q, k, v, dropout_p=1.0)
    assert torch.equal(out, ref) and (out == 0).all()
    m = heads.MultiheadAttention(8, 2, dropout=1.0).train()
    x = rnd(4, 1, 8).numpy()
    out, w = m(x, x, x)
    np.testing.assert_allclose(out, np.broadcast_to(m.state_dict()["out_proj.bias"], out.shape), atol=1e-7)


# --- concurrency -------------------------------------------------------------------------------------

def test_concurrent_calls_of_many_shapes():
    """Python threads (the GIL is released in the core) run modules of many shapes at once, past
    the 256 matmul primitives the projection cache keeps before it is cleared."""
    mods = [heads.MultiheadAttention(8 * (1 + i % 4), 2, batch_first=True, seed=i) for i in range(8)]
    errors = []

    def work(t):
        try:
            rng = np.random.default_rng(t)
            for it in range(60):
                m = mods[(t + it) % len(mods)]
                length = 1 + (t * 61 + it * 7) % 97  # many distinct shapes across the threads
                x = rng.standard_normal((2, length, m.embed_dim)).astype(np.float32)
                out, _ = m(x, x, x, need_weights=False)
                ref = m(x.copy(), x.copy(), x.copy(), need_weights=False)[0]
                if not np.allclose(out, ref, rtol=1e-5, atol=1e-6):
                    errors.append(f"thread {t}: results differ")
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {t}: {e!r}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


# --- initialisation, copies and pickles -------------------------------------------------------------

def test_torch_modules_draw_their_initialisation_from_torch():
    for kw in ({}, {"kdim": 6, "vdim": 5}, {"add_bias_kv": True, "bias": True}):
        torch.manual_seed(0)
        a = ht.MultiheadAttention(8, 2, **kw)
        torch.manual_seed(0)
        b = ht.MultiheadAttention(8, 2, **kw)
        torch.manual_seed(0)
        ref = torch.nn.MultiheadAttention(8, 2, **kw)
        sa, sb, sr = a.state_dict(), b.state_dict(), ref.state_dict()
        assert list(sa) == list(sr)
        for name in sr:
            assert torch.equal(sa[name], sb[name]) and torch.equal(sa[name], sr[name]), name


def test_modules_copy_and_pickle(tmp_path):
    x = rnd(5, 2, 8).numpy()
    layer = heads.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, seed=3).eval()
    mods = [heads.MultiheadAttention(8, 2, add_bias_kv=True, seed=1).eval(), layer,
            heads.TransformerEncoder(layer, 2).eval()]
    for m in mods:
        want = m(x, x, x)[0] if isinstance(m, heads.MultiheadAttention) else m(x)
        for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m)), copy.copy(m)):
            got = twin(x, x, x)[0] if isinstance(m, heads.MultiheadAttention) else twin(x)
            np.testing.assert_array_equal(got, want)
            assert twin.training == m.training
        twin = copy.deepcopy(m)
        for v in twin.state_dict().values():
            v[...] = 0  # the copy owns its parameters
        assert any(np.abs(v).sum() > 0 for v in m.state_dict().values())
    tm = ht.MultiheadAttention(8, 2, batch_first=True)
    xt = rnd(2, 5, 8)
    buf = io.BytesIO()
    torch.save(tm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(xt, xt, xt)[0], tm(xt, xt, xt)[0], rtol=0, atol=0)
    torch.testing.assert_close(copy.deepcopy(tm)(xt, xt, xt)[0], tm(xt, xt, xt)[0], rtol=0, atol=0)
    enc = heads.SentenceEncoder()
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(enc)).encode(["a cat"]), enc.encode(["a cat"]))
