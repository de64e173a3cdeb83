"""Linear attention against a direct PyTorch formula (the full [L, L] matrix), forward and backward."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import heads
import heads.torch as ht


def _phi(x, fm):
    return F.elu(x) + 1 if fm == "elu" else F.relu(x) if fm == "relu" else x


def _direct(q, k, v, fm, causal, eps=1e-6):
    a = _phi(q, fm) @ _phi(k, fm).transpose(-1, -2)
    if causal:
        a = a * torch.tril(torch.ones(a.shape[-2:], dtype=a.dtype))
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("fm", ["elu", "relu", "identity"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 7, 5, 9), (1, 2, 129, 63, 17)])
def test_matches_direct_formula(fm, causal, shape):
    B, H, L, D, Dv = shape
    g = torch.Generator().manual_seed(L * 7 + D)
    pos = fm != "elu"  # relu / identity: positive features keep the denominators away from 0
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    if pos:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    v = torch.randn(B, H, L, Dv, generator=g, dtype=torch.float64)
    want = _direct(q, k, v, fm, causal)
    got = heads.linear_attention(q.float(), k.float(), v.float(), feature_map=fm, causal=causal)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # gradients through heads.torch against autograd of the formula (float64)
    qf, kf, vf = [t.float().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(B, H, L, Dv, generator=g, dtype=torch.float64)
    ht.linear_attention(qf, kf, vf, fm, causal).backward(dout.float())
    q6, k6, v6 = [t.clone().requires_grad_() for t in (q, k, v)]
    _direct(q6, k6, v6, fm, causal).backward(dout)
    for a, b in ((qf, q6), (kf, k6), (vf, v6)):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)


def test_numpy_and_errors():
    q = np.random.default_rng(0).standard_normal((4, 10, 8)).astype(np.float32)
    out = heads.linear_attention(q, q, q)
    assert isinstance(out, np.ndarray) and out.shape == (4, 10, 8)
    with pytest.raises(ValueError, match="feature_map must be"):
        heads.linear_attention(q, q, q, feature_map="softmax")
    with pytest.raises(ValueError, match="causal needs as many queries as keys"):
        heads.linear_attention(q[:, :3], q, q, causal=True)


def test_recurrent_state_equals_causal_rows():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 11, 8, generator=g) for _ in range(3))
    full = heads.linear_attention(q, k, v, causal=True)
    st = heads.LinearAttentionState(2, 3, 8, 8)
    for t in range(11):
        torch.testing.assert_close(st.step(q[:, :, t], k[:, :, t], v[:, :, t]), full[:, :, t],
                                   rtol=1e-5, atol=1e-6)
    assert len(st) == 11


def test_multi_chunk_lq_ne_lk_gradients():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 150, 24, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 300, 24, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 300, 40, generator=g, dtype=torch.float64)
    dout = torch.randn(1, 2, 150, 40, generator=g, dtype=torch.float64)
    qf, kf, vf = [t.float().requires_grad_() for t in (q, k, v)]
    ht.linear_attention(qf, kf, vf).backward(dout.float())
    q6, k6, v6 = [t.clone().requires_grad_() for t in (q, k, v)]
    _direct(q6, k6, v6, "elu", False).backward(dout)
    for a, b in ((qf, q6), (kf, k6), (vf, v6)):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)


def test_non_finite_values_respect_causality():
    # An inf in value row t (or a NaN in a relu feature) reaches rows >= t only, as the definition says.
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 200, 8, generator=g) for _ in range(3))
    v[0, 0, 150, 3] = float("inf")
    out = heads.linear_attention(q, k, v, causal=True)
    assert torch.isfinite(out[0, 0, :150]).all() and not torch.isfinite(out[0, 0, 150:]).all()
    k2 = k.clone()
    k2[0, 0, 170, 0] = float("nan")
    out = heads.linear_attention(q, k2, v.nan_to_num(posinf=1.0), feature_map="relu", causal=True)
    assert torch.isfinite(out[0, 0, :170]).all() and torch.isnan(out[0, 0, 170:]).all()
    with pytest.raises(RuntimeError):  # second derivatives are not implemented: an error, not silent zeros
        qf = q.clone().requires_grad_()
        (gq,) = torch.autograd.grad(ht.linear_attention(qf, k, v.nan_to_num(posinf=1.0)).sum(), qf, create_graph=True)
        gq.sum().backward()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L", [7, 300])
def test_key_padding_mask_matches_direct_formula(causal, L):
    """Padded keys (True in key_padding_mask) contribute nothing: forward and gradients against the formula
    with their features zeroed, across chunks."""
    B, H, D, Dv = 2, 3, 8, 5
    g = torch.Generator().manual_seed(L)
    q, k = [torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(2)]
    v = torch.randn(B, H, L, Dv, generator=g, dtype=torch.float64)
    mask = torch.rand(B, L, generator=g) < 0.3
    mask[:, 0] = False
    keep = (~mask).double()[:, None, :, None]

    def direct(q, k, v):
        a = _phi(q, "elu") @ (_phi(k, "elu") * keep).transpose(-1, -2)
        if causal:
            a = a * torch.tril(torch.ones(a.shape[-2:], dtype=a.dtype))
        return (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)

    qd, kd, vd = [t.clone().requires_grad_() for t in (q, k, v)]
    want = direct(qd, kd, vd)
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (want * dout).sum().backward()
    qf, kf, vf = [t.float().requires_grad_() for t in (q, k, v)]
    got = ht.linear_attention(qf, kf, vf, causal=causal, key_padding_mask=mask)
    (got * dout.float()).sum().backward()
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    for mine, ref in ((qf, qd), (kf, kd), (vf, vd)):
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)
    assert torch.all(kf.grad[mask[:, None, :, None].expand_as(kf.grad)] == 0)
    assert torch.all(vf.grad[mask[:, None, :, None].expand_as(vf.grad)] == 0)
    np_out = heads.linear_attention(q.float().numpy(), k.float().numpy(), v.float().numpy(), causal=causal,
                                    key_padding_mask=mask.numpy())
    np.testing.assert_allclose(np_out, got.detach().numpy(), rtol=0, atol=0)

