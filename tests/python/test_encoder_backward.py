"""Gradients of heads.TransformerEncoderLayer / TransformerEncoder against PyTorch 2.13 autograd.

The reference runs in float64: with small d_model a LayerNorm makes some gradients nearly vanish,
and torch's float32 autograd is then further from the exact value than heads is."""

import numpy as np
import pytest
import torch

import heads
from test_encoder import config, make_inputs, randomise

LAYER_KEYS = ["d_model", "nhead", "dim_feedforward", "activation", "layer_norm_eps", "batch_first",
              "norm_first", "bias"]


def compare_grads(check, ref, src, fkw, mine, g, what, **call):
    ref = ref.double()
    srct = src.double().requires_grad_()
    fkw64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in fkw.items()}
    out_ref = ref(srct, **fkw64, **call)
    dout = torch.randn(out_ref.shape, generator=g)
    (out_ref * dout.double()).sum().backward()
    tape = heads.Tape()
    out = mine(src, **fkw, **call, tape=tape)
    dsrc, grads = mine.backward(tape, dout)
    check("encoder output (train)", out, out_ref, what)
    floor = 1e-3 * float(dout.norm())
    check("encoder grad input", dsrc, srct.grad, what, tol=1e-4, floor=floor)
    assert list(grads) == list(ref.state_dict())
    for name, p in ref.named_parameters():
        check("encoder grad parameter", grads[name], p.grad, f"{name}: {what}", tol=1e-4, floor=floor)


@pytest.mark.parametrize("i", range(60))
def test_encoder_layer_gradients_match_torch(i, check):
    cfg = config(i)
    g = torch.Generator().manual_seed(cfg["seed"])
    kw = {k: cfg[k] for k in LAYER_KEYS}
    ref = torch.nn.TransformerEncoderLayer(**kw, dropout=0.0).train()
    randomise(ref, g)
    mine = heads.TransformerEncoderLayer(**kw, dropout=0.0).train()
    mine.load_state_dict(ref.state_dict())
    src, fkw = make_inputs(cfg, g)
    compare_grads(check, ref, src, fkw, mine, g, str(cfg))


@pytest.mark.parametrize("i", range(8))
def test_encoder_stack_gradients_match_torch(i, check):
    cfg = config(200 + i)
    g = torch.Generator().manual_seed(cfg["seed"])
    kw = {k: cfg[k] for k in LAYER_KEYS}
    layer = torch.nn.TransformerEncoderLayer(**kw, dropout=0.0)
    final = torch.nn.LayerNorm(cfg["d_model"], eps=cfg["layer_norm_eps"], bias=cfg["bias"]) if i % 2 else None
    ref = torch.nn.TransformerEncoder(layer, num_layers=2 + i % 2, norm=final, enable_nested_tensor=False)
    randomise(ref, g)
    mine = heads.TransformerEncoder(heads.TransformerEncoderLayer(**kw, dropout=0.0), num_layers=2 + i % 2,
                                    norm=final is not None)
    mine.load_state_dict(ref.state_dict())
    src, fkw = make_inputs(cfg, g)
    fkw["mask"] = fkw.pop("src_mask", None)
    compare_grads(check, ref, src, fkw, mine, g, str(cfg))


@pytest.mark.parametrize("norm_first", [False, True])
def test_dropout_gradient_matches_finite_differences(norm_first):
    """With dropout (heads' own masks, fixed by the seed) the backward must give the directional
    derivative of the forward."""
    layer = heads.TransformerEncoderLayer(16, 4, 32, dropout=0.2, activation="gelu", batch_first=True,
                                          norm_first=norm_first, seed=5)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 7, 16))
    d = rng.standard_normal(x.shape)
    w = rng.standard_normal(x.shape).astype(np.float32)

    def loss(xx):
        heads.manual_seed(7)
        return float((layer(xx.astype(np.float32), is_causal=True).astype(np.float64) * w).sum())

    heads.manual_seed(7)
    tape = heads.Tape()
    layer(x.astype(np.float32), is_causal=True, tape=tape)
    dsrc, _ = layer.backward(tape, w)
    h = 1e-2
    fd = (loss(x + h * d) - loss(x - h * d)) / (2 * h)
    an = float((dsrc.astype(np.float64) * d).sum())
    assert abs(fd - an) <= 2e-3 * max(1.0, abs(an)), (fd, an)


def test_backward_errors():
    layer = heads.TransformerEncoderLayer(8, 2, 16)
    x = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="empty tape"):
        layer.backward(heads.Tape(), x)
    tape = heads.Tape()
    layer(x, tape=tape)
    with pytest.raises(ValueError, match=r"dout: expected \[3, 2, 8\]"):
        layer.backward(tape, x[:2])
    enc = heads.TransformerEncoder(layer, 2)
    with pytest.raises(ValueError, match="another module"):
        enc.backward(tape, x)
