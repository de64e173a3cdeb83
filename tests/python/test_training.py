"""Training pieces against PyTorch 2.13: AdamW, embedding and cross-entropy (forward and backward),
and a few optimisation steps of a heads encoder layer against the same steps in torch."""

import numpy as np
import pytest
import torch

import heads
from heads import _heads


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch(amsgrad, maximize, weight_decay, check):
    g = torch.Generator().manual_seed(7)
    shapes = {"w": (33, 17), "b": (5,), "big": (300, 257)}
    ref = {k: torch.randn(s, generator=g).requires_grad_() for k, s in shapes.items()}
    mine = {k: v.detach().numpy().copy() for k, v in ref.items()}
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    opt_ref = torch.optim.AdamW(ref.values(), **kw)
    opt = heads.AdamW(mine, **kw)
    for step in range(12):
        grads = {k: torch.randn(s, generator=g) * (1 + step % 3) for k, s in shapes.items()}
        if step == 4:
            del grads["b"]  # a parameter without a gradient is skipped, as torch skips grad=None
        for k, p in ref.items():
            p.grad = grads.get(k)
        opt_ref.step()
        opt.step({k: v.numpy() for k, v in grads.items()})
    assert opt.steps == 12
    for k in shapes:
        check("AdamW parameters", mine[k], ref[k], f"{k} amsgrad={amsgrad} maximize={maximize} wd={weight_decay}",
              tol=1e-6)


def test_adamw_updates_module_in_place_and_validates():
    layer = heads.TransformerEncoderLayer(8, 2, 16, dropout=0.0, seed=1)
    before = {k: v.copy() for k, v in layer.state_dict().items()}
    opt = heads.AdamW(layer, lr=0.1)
    with pytest.raises(ValueError, match="unknown parameter \"nope\""):
        opt.step({"nope": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"linear1.weight.*expected \[16, 8\]"):
        opt.step({"linear1.weight": np.zeros((8, 16), np.float32)})
    assert all(np.array_equal(before[k], v) for k, v in layer.state_dict().items()), "a failed step changed nothing"
    x = np.random.default_rng(0).standard_normal((5, 2, 8)).astype(np.float32)
    tape = heads.Tape()
    layer(x, tape=tape)
    _, grads = layer.backward(tape, np.ones_like(x))
    opt.step(grads)
    changed = [k for k, v in layer.state_dict().items() if not np.array_equal(before[k], v)]
    assert "self_attn.in_proj_weight" in changed and "linear2.weight" in changed


def test_embedding_and_cross_entropy_match_torch(check):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(11, 7, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (4, 9), generator=g)
    y = torch.nn.functional.embedding(ids, w)
    dy = torch.randn(y.shape, generator=g)
    (y * dy).sum().backward()
    check("embedding", _heads.embedding(w.detach().numpy(), ids.numpy()), y, "4x9 ids")
    check("embedding grad", _heads.embedding_backward(dy.numpy(), ids.numpy(), 11), w.grad, "4x9 ids")

    logits = (torch.randn(37, 13, generator=g) * 4).requires_grad_()
    target = torch.randint(0, 13, (37,), generator=g)
    target[::5] = -100
    loss = torch.nn.functional.cross_entropy(logits, target)
    loss.backward()
    mine = _heads.cross_entropy(logits.detach().numpy(), target.numpy())
    assert abs(mine - loss.item()) <= 1e-6 * abs(loss.item())
    check("cross_entropy grad", _heads.cross_entropy_backward(logits.detach().numpy(), target.numpy()),
          logits.grad, "37x13, ignore_index")


def test_embedding_and_cross_entropy_errors():
    w = np.zeros((5, 3), np.float32)
    with pytest.raises(ValueError, match=r"id 5 at flat index 1 is out of range \[0, 5\)"):
        _heads.embedding(w, np.array([0, 5]))
    with pytest.raises(ValueError, match="expected int64 ids"):
        _heads.embedding(w, np.array([0, 1], np.int32).astype(np.float32))
    with pytest.raises(ValueError, match=r"target: expected \[2\]"):
        _heads.cross_entropy(np.zeros((2, 4), np.float32), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="id -3"):
        _heads.cross_entropy(np.zeros((2, 4), np.float32), np.array([0, -3]))


def test_training_steps_track_torch(check):
    """Ten AdamW steps on a causal encoder layer, heads vs torch from the same start: the
    parameters stay within float32 noise of each other."""
    torch.manual_seed(0)
    kw = dict(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True)
    ref = torch.nn.TransformerEncoderLayer(**kw)
    mine = heads.TransformerEncoderLayer(**kw)
    mine.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = heads.AdamW(mine, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(6)
    for _ in range(10):
        x = torch.randn(3, 6, 16, generator=g)
        target = torch.randn(3, 6, 16, generator=g)
        opt_ref.zero_grad()
        out = ref(x, src_mask=mask, is_causal=True)
        ((out - target) ** 2).mean().backward()
        opt_ref.step()
        tape = heads.Tape()
        out_h = mine(x.numpy(), src_mask=mask.numpy(), is_causal=True, tape=tape)
        dout = 2 * (out_h - target.numpy()) / out_h.size
        _, grads = mine.backward(tape, dout)
        opt.step(grads)
    E = 16
    for k, v in ref.state_dict().items():
        got = mine.state_dict()[k]
        if k == "self_attn.in_proj_bias":
            # The key bias shifts every score of a row equally: its exact gradient is zero, both
            # sides hold rounding noise, and Adam's normalisation turns noise into lr-sized steps.
            got, v = np.delete(got, np.s_[E:2 * E]), np.delete(v.numpy(), np.s_[E:2 * E])
        check("training steps vs torch", got, v, k, tol=1e-4)
