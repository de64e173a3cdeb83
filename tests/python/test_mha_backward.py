"""Gradients of heads.MultiheadAttention against PyTorch 2.13 autograd (float64) on random configurations."""

import numpy as np
import pytest
import torch

import heads
import heads.torch
from test_mha import make_config, make_inputs, make_modules

N_CONFIGS = 120


@pytest.mark.parametrize("i", range(N_CONFIGS))
def test_gradients_match_torch_autograd(i, check):
    cfg = make_config(i)
    g = torch.Generator().manual_seed(cfg["seed"])
    ref, mine = make_modules(cfg, g)
    q, k, v, kw = make_inputs(cfg, g)
    self_attn = k is q
    # float64 reference: where a gradient is zero in exact arithmetic (a row seeing one key), the
    # comparison then measures heads' rounding only.
    ref = ref.double()
    kw64 = {a: b.double() if torch.is_tensor(b) and b.is_floating_point() else b for a, b in kw.items()}
    qt = q.double().requires_grad_()
    kt, vt = (qt, qt) if self_attn else (k.double().requires_grad_(), v.double().requires_grad_())
    out_ref, _ = ref(qt, kt, vt, **kw64)
    dout = torch.randn(out_ref.shape, generator=g)
    (out_ref * dout.double()).sum().backward()

    tape = heads.Tape()
    out, _ = mine(q, q if self_attn else k, q if self_attn else v, **kw, tape=tape)
    (dq, dk, dv), grads = mine.backward(tape, dout)
    what = ", ".join(f"{a}={b}" for a, b in cfg.items())
    check("MultiheadAttention output", out, out_ref, what)
    # Gradients that are zero in exact arithmetic (a row seeing one key) hold rounding noise only;
    # they are compared on the scale of the largest gradient of the call.
    refs = [qt.grad, kt.grad, vt.grad] + [p.grad for p in ref.parameters()]
    floor = 1e-3 * max(float(r.norm()) for r in refs)
    check("MHA grad input", dq, qt.grad, what, tol=1e-4, floor=floor)
    if self_attn:
        assert dk is None and dv is None
    else:
        check("MHA grad input", dk, kt.grad, what, tol=1e-4, floor=floor)
        check("MHA grad input", dv, vt.grad, what, tol=1e-4, floor=floor)
    names = [n for n, _ in ref.named_parameters()]
    assert list(grads) == [n for n in ref.state_dict()], "gradients in state_dict order"
    assert sorted(grads) == sorted(names)
    for name, p in ref.named_parameters():
        assert isinstance(grads[name], torch.Tensor)
        check("MHA grad parameter", grads[name], p.grad, f"{name}: {what}", tol=1e-4, floor=floor)


def test_dropout_gradient_matches_finite_differences():
    """With dropout the masks are heads' own; fixing the seed makes the forward a function whose
    directional derivative the backward must give."""
    E, H = 16, 4
    mine = heads.MultiheadAttention(E, H, dropout=0.3, batch_first=True, seed=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, E))
    d = rng.standard_normal(x.shape)
    w = rng.standard_normal((2, 9, E)).astype(np.float32)

    def loss(xx):
        heads.manual_seed(11)
        out, _ = mine(xx.astype(np.float32), xx.astype(np.float32), xx.astype(np.float32), need_weights=False)
        return float((out.astype(np.float64) * w).sum())

    heads.manual_seed(11)
    tape = heads.Tape()
    xf = x.astype(np.float32)
    mine(xf, xf, xf, need_weights=False, tape=tape)
    (dq, _, _), _ = mine.backward(tape, w)
    h = 1e-2
    fd = (loss(x + h * d) - loss(x - h * d)) / (2 * h)
    an = float((dq.astype(np.float64) * d).sum())
    assert abs(fd - an) <= 2e-3 * max(1.0, abs(an)), (fd, an)
    # Same seed, different draws: dropout really acted (the output differs from eval mode).
    heads.manual_seed(11)
    out_train, _ = mine(xf, xf, xf, need_weights=False)
    out_eval, _ = mine.eval()(xf, xf, xf, need_weights=False)
    assert not np.allclose(out_train, out_eval)


def test_backward_errors():
    mine = heads.MultiheadAttention(8, 2)
    x = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="empty tape"):
        mine.backward(heads.Tape(), x)
    tape = heads.Tape()
    mine(x, x, x, tape=tape)
    with pytest.raises(ValueError, match=r"dout: expected \[3, 2, 8\].*got \[3, 8\]"):
        mine.backward(tape, x[:, 0])
    other = heads.MultiheadAttention(8, 2)
    with pytest.raises(ValueError, match="another module"):
        other.backward(tape, x)


def test_torch_module_second_backward_is_a_clear_error():
    # retain_graph=True keeps torch's graph, but the module's saved activations are freed by the first
    # backward: the second one says so instead of failing inside the binding.
    mha = heads.torch.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    out, _ = mha(x, x, x)
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    assert torch.isfinite(first).all() and first.abs().sum() > 0
    with pytest.raises(RuntimeError, match="second time.*retain_graph=True.*run the forward again"):
        out.sum().backward()
    assert torch.equal(x.grad, first)  # nothing accumulated by the refused backward


@pytest.mark.parametrize("i", range(0, N_CONFIGS, 6))
def test_torch_module_trains_like_nn_multihead_attention(i, check):
    """heads.torch.MultiheadAttention: an nn.Module whose forward and backward run in heads; the
    same parameters, gradients and optimizer steps as nn.MultiheadAttention."""
    ht = heads.torch

    cfg = make_config(i)
    g = torch.Generator().manual_seed(cfg["seed"])
    ref, _ = make_modules(cfg, g)
    kw = dict(bias=cfg["bias"], add_bias_kv=cfg["add_bias_kv"], add_zero_attn=cfg["add_zero_attn"],
              kdim=cfg["kdim"], vdim=cfg["vdim"], batch_first=cfg["batch_first"])
    mine = ht.MultiheadAttention(cfg["E"], cfg["H"], **kw)
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in ref.named_parameters()]
    mine.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    what = ", ".join(f"{a}={b}" for a, b in cfg.items())
    for step in range(3):
        q, k, v, fkw = make_inputs(cfg, g)
        self_attn = k is q
        qa = q.clone().requires_grad_()
        qb = q.clone().requires_grad_()
        ka, kb = (qa, qb) if self_attn else (k.clone().requires_grad_(), k.clone().requires_grad_())
        va, vb = (qa, qb) if self_attn else (v.clone().requires_grad_(), v.clone().requires_grad_())
        out_ref, _ = ref(qa, ka, va, **fkw)
        out, _ = mine(qb, kb, vb, **fkw)
        w = torch.randn(out_ref.shape, generator=g)
        opt_ref.zero_grad()
        opt.zero_grad()
        (out_ref * w).sum().backward()
        (out * w).sum().backward()
        check("MultiheadAttention output", out, out_ref, what)
        floor = 1e-3 * max(float(p.grad.norm()) for p in ref.parameters())
        check("torch-module grad", qb.grad, qa.grad, what, tol=1e-3, floor=floor)
        for (name, p), (_, pr) in zip(mine.named_parameters(), ref.named_parameters()):
            check("torch-module grad", p.grad, pr.grad, f"{name}: {what}", tol=1e-3, floor=floor)
        opt_ref.step()
        opt.step()



def test_tape_keeps_its_inputs_alive():
    # The backward must not read the caller's input arrays, which may be freed, reused or overwritten
    # between forward and backward: a tape keeps copies. Self-attention, cross-attention
    # with a padding mask, and the encoder layer; numpy and torch inputs. (Found under DDP: a
    # pre-norm block's LayerNorm output, freed after the forward, gave NaN in_proj_weight gradients.)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 11, 32, generator=g)
    mem = torch.randn(3, 7, 32, generator=g)
    pad = torch.rand(3, 7, generator=g) < 0.3
    pad[:, 0] = False
    dout = torch.randn(3, 11, 32, generator=g).numpy()
    mha = heads.MultiheadAttention(32, 4, batch_first=True)
    layer = heads.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)

    def run(module, make, keep: bool):
        tape = heads.Tape()
        args, kw = make()
        out = module(*args, **kw, tape=tape)
        out = np.asarray(out[0] if isinstance(out, tuple) else out)
        if not keep:  # the caller reuses its arrays (overwrites them) before the backward
            for a in list(args) + list(kw.values()):
                if a.dtype in (np.bool_, torch.bool):
                    a[...] = True  # every key padded: a tape that read this mask would see no keys
                else:
                    a[...] = float("nan")
        grads = module.backward(tape, dout)
        inputs = grads[0] if isinstance(grads[0], tuple) else (grads[0],)
        return out, [np.asarray(a) for a in inputs if a is not None] + [np.asarray(v) for v in grads[1].values()]

    cases = [
        (mha, lambda: ((x.numpy().copy(),) * 3, {}), "self-attention, numpy"),
        (mha, lambda: ((lambda y: (y, y, y))(x.clone()), {}), "self-attention, torch"),
        (mha, lambda: ((x.clone(), mem.clone(), mem.clone() * 2), {"key_padding_mask": pad.clone()}),
         "cross-attention with a padding mask, torch"),
        (layer, lambda: ((x.clone(),), {}), "encoder layer (norm_first), torch"),
    ]
    for module, make, what in cases:
        out_a, grads_a = run(module, make, keep=True)
        out_b, grads_b = run(module, make, keep=False)
        assert np.array_equal(out_a, out_b) and len(grads_a) == len(grads_b), what
        for a, b in zip(grads_a, grads_b):
            assert np.isfinite(b).all() and np.array_equal(a, b), what
