"""Sliding windows, softcap, ALiBi, T5 relative bias and attention sinks against PyTorch: each one
written out the way PyTorch / transformers users write it (an explicit mask or bias, the eager
formula), forward and backward (heads.torch), on random shapes with odd sizes."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import heads
import heads.torch as ht

rng = np.random.default_rng(20261123)


def _qkv(B, H, Hkv, Lq, Lk, D, Dv, dtype=torch.float32):
    g = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    return (torch.randn(B, H, Lq, D, generator=g, dtype=dtype), torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=dtype))


def _band(Lq, Lk, left, right, lower_right):
    """Bool [Lq, Lk]: key j visible to query i iff i + a - left <= j <= i + a + right."""
    a = Lk - Lq if lower_right else 0
    i = torch.arange(Lq)[:, None] + a
    j = torch.arange(Lk)[None, :]
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _t5_bias(table, Lq, Lk, bidirectional, max_distance, lower_right=False):
    """transformers' T5Attention bias [H, Lq, Lk] from a [num_buckets, H] table."""
    from transformers.models.t5.modeling_t5 import T5Attention

    a = Lk - Lq if lower_right else 0
    rel = torch.arange(Lk)[None, :] - (torch.arange(Lq)[:, None] + a)
    buckets = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=table.shape[0],
                                                    max_distance=max_distance)
    return table[buckets].permute(2, 0, 1)


def _eager(q, k, v, scale=None, bias=None, visible=None, softcap=None, sinks=None):
    """The eager formula: scores, softcap, bias, mask, softmax with sinks (gpt-oss), P V."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sk = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p) @ v


SHAPES = [(1, 1, 1, 1, 1, 8, 8), (2, 4, 2, 3, 300, 16, 16), (1, 3, 3, 7, 7, 5, 9), (2, 2, 1, 129, 129, 64, 64),
          (1, 2, 2, 33, 70, 63, 17)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [(3, -1), (-1, 2), (4, 0), (0, 0), (40, 5)])
@pytest.mark.parametrize("lower_right", [False, True])
def test_window_equals_band_mask(shape, window, lower_right):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = _qkv(*shape)
    got = heads.sdpa(q, k, v, enable_gqa=H != Hkv, window_size=window,
                     causal_variant="lower_right" if lower_right else "upper_left")
    band = _band(Lq, Lk, *window, lower_right)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=H != Hkv)
    want = torch.where(band.any(-1)[:, None], want, torch.zeros_like(want))  # torch: NaN rows; heads: zeros
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_sliding_window_as_mistral():
    # transformers' sliding_window W with causal: query i sees keys i - W + 1 .. i.
    q, k, v = _qkv(1, 4, 2, 50, 50, 32, 32)
    got = heads.sdpa(q, k, v, is_causal=True, sliding_window=8, enable_gqa=True)
    band = _band(50, 50, 7, 0, False)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_softcap_alibi_t5_sinks_forward(shape):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = _qkv(*shape)
    gqa = H != Hkv
    # softcap (Gemma 2) with causal
    got = heads.sdpa(q, k, v, is_causal=True, softcap=5.0, enable_gqa=gqa)
    want = _eager(q, k, v, softcap=5.0, visible=_band(Lq, Lk, -1, 0, False))
    want = torch.where(_band(Lq, Lk, -1, 0, False).any(-1)[:, None], want, torch.zeros_like(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    # ALiBi: BLOOM's slope * key position (a row shift of -slope * |i - j| under causal)
    slopes = torch.from_numpy(heads.alibi_slopes(H))
    got = heads.sdpa(q, k, v, is_causal=True, alibi_slopes=True, causal_variant="lower_right", enable_gqa=gqa)
    bloom = slopes[:, None, None] * torch.arange(Lk, dtype=torch.float32)[None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bloom + torch.where(_band(Lq, Lk, -1, 0, True), 0.0,
                                                                                  float("-inf")), enable_gqa=gqa)
    rows = _band(Lq, Lk, -1, 0, True).any(-1)[:, None]
    torch.testing.assert_close(got, torch.where(rows, want, torch.zeros_like(want)), rtol=1e-5, atol=2e-6)
    # T5 (unscaled scores, so logits of tens: both f32 results are measured against float64)
    table = torch.randn(32, H)
    for bidirectional in (True, False):
        got = heads.sdpa(q, k, v, scale=1.0, relative_attention_bias=table, relative_attention_max_distance=64,
                         relative_attention_bidirectional=bidirectional, enable_gqa=gqa)
        want = _eager(q, k, v, scale=1.0, bias=_t5_bias(table, Lq, Lk, bidirectional, 64))
        exact = _eager(q.double(), k.double(), v.double(), scale=1.0,
                       bias=_t5_bias(table.double(), Lq, Lk, bidirectional, 64))
        err, torch_err = (got.double() - exact).abs().max().item(), (want.double() - exact).abs().max().item()
        assert err <= 2 * torch_err + 1e-6, (err, torch_err)
    # sinks (gpt-oss), with a sliding window
    sinks = torch.randn(H) * 2
    got = heads.sdpa(q, k, v, sinks=sinks, window_size=(3, 0), enable_gqa=gqa)
    want = _eager(q, k, v, sinks=sinks, visible=_band(Lq, Lk, 3, 0, False))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_weights_and_bf16():
    q, k, v = _qkv(2, 4, 4, 40, 60, 32, 32)
    sinks = torch.randn(4)
    out, w = heads.sdpa(q, k, v, need_weights=True, window_size=(10, 2), softcap=4.0, sinks=sinks,
                        alibi_slopes=True)
    vis = _band(40, 60, 10, 2, False)
    slopes = torch.from_numpy(heads.alibi_slopes(4))
    bias = -slopes[:, None, None] * (torch.arange(40)[:, None] - torch.arange(60)[None, :]).abs()
    want = _eager(q, k, v, softcap=4.0, bias=bias, visible=vis, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(w @ v, out, rtol=1e-5, atol=2e-6)  # weights exclude the sink column
    assert (w.sum(-1) < 1).all()
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = heads.sdpa(qb, kb, vb, window_size=(10, 2), softcap=4.0, sinks=sinks, alibi_slopes=True)
    assert got.dtype == torch.bfloat16
    want = _eager(qb.float(), kb.float(), vb.float(), softcap=4.0, bias=bias, visible=vis, sinks=sinks)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("shape", [(2, 4, 2, 9, 13, 8, 6), (1, 2, 2, 70, 150, 24, 24), (1, 3, 1, 2, 40, 16, 16)])
def test_backward_matches_torch_autograd(shape):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    gqa = H != Hkv
    q, k, v = _qkv(*shape, dtype=torch.float64)
    table = torch.randn(16, H, dtype=torch.float64)
    sinks = torch.randn(H, dtype=torch.float64)
    dout = torch.randn(B, H, Lq, Dv, dtype=torch.float64)
    vis = _band(Lq, Lk, 20, 3, False)

    def leaves():
        return [t.clone().float().requires_grad_() for t in (q, k, v, table, sinks)]

    qf, kf, vf, tf, sf = leaves()
    out = ht.scaled_dot_product_attention(qf, kf, vf, enable_gqa=gqa, window_size=(20, 3), softcap=3.0,
                                          relative_attention_bias=tf, relative_attention_max_distance=32,
                                          sinks=sf, alibi_slopes=True)
    out.backward(dout.float())
    q6, k6, v6, t6, s6 = [t.clone().requires_grad_() for t in (q, k, v, table, sinks)]
    slopes = torch.from_numpy(heads.alibi_slopes(H)).double()
    bias = _t5_bias(t6, Lq, Lk, True, 32) - slopes[:, None, None] * (torch.arange(Lq)[:, None] -
                                                                      torch.arange(Lk)[None, :]).abs()
    ref = _eager(q6, k6, v6, softcap=3.0, bias=bias, visible=vis, sinks=s6)
    ref.backward(dout)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want, name in ((qf, q6, "q"), (kf, k6, "k"), (vf, v6, "v"), (tf, t6, "table"), (sf, s6, "sinks")):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5, msg=lambda m: name + ": " + m)


def test_errors_name_the_argument():
    q, k, v = _qkv(1, 4, 4, 5, 6, 8, 8)
    with pytest.raises(ValueError, match=r"window_size: expected a pair"):
        heads.sdpa(q, k, v, window_size=3)
    with pytest.raises(ValueError, match=r"window_size\[0\]: expected an integer in \[-1"):
        heads.sdpa(q, k, v, window_size=(-5, 0))
    with pytest.raises(ValueError, match="pass either window_size or sliding_window"):
        heads.sdpa(q, k, v, window_size=(1, 1), sliding_window=4)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected a floating tensor \[H\] = \[4\], got f32 \[3\]"):
        heads.sdpa(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match=r"sinks: expected a floating tensor \[H\] = \[4\]"):
        heads.sdpa(q, k, v, sinks=torch.ones(2, 2))
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        heads.sdpa(q, k, v, softcap=-2.0)
    with pytest.raises(ValueError, match=r"relative_attention_bias: expected a floating table"):
        heads.sdpa(q, k, v, relative_attention_bias=torch.ones(32, 3))
    # the modifiers reach the extension by name: a name it does not know, or a value of the wrong
    # kind, is an error naming it (not a modifier silently dropped or read in another's place)
    call = (None, 0.0, False, None, False, False, None, True, False)
    with pytest.raises(ValueError, match="sdpa: unknown modifier 'window'"):
        heads._heads.sdpa(q, k, v, *call, {"window": 3})
    with pytest.raises(ValueError, match="sdpa: modifier softcap: expected a number, got <class 'str'>"):
        heads._heads.sdpa(q, k, v, *call, {"softcap": "2"})
    with pytest.raises(ValueError, match="sdpa: modifier sinks: expected an array or None"):
        heads._heads.sdpa(q, k, v, *call, {"sinks": "x"})
    # the modules' attention variant travels the same way
    with pytest.raises(ValueError, match="attention variant: unknown option 'windows'"):
        heads._heads.MultiheadAttention(8, 2, variant={"windows": 2})
    with pytest.raises(ValueError, match="attention variant window: expected a number, got <class 'str'>"):
        heads._heads.MultiheadAttention(8, 2, variant={"window": "2"})
    out = heads._heads.sdpa(q, k, v, *call, {"window_right": 0})  # = is_causal
    torch.testing.assert_close(out, heads.sdpa(q, k, v, is_causal=True))


@pytest.mark.parametrize("bs", [1, 16, 64, 128])
def test_block_sparse_equals_block_expanded_mask(bs):
    H, Lq, Lk = 3, 150, 200
    q, k, v = _qkv(2, H, H, Lq, Lk, 32, 32)
    nqb, nkb = -(-Lq // bs), -(-Lk // bs)
    layout = torch.from_numpy(rng.random((H, nqb, nkb)) < 0.5)
    dense = layout.repeat_interleave(bs, 1).repeat_interleave(bs, 2)[:, :Lq, :Lk]
    got = heads.sdpa(q, k, v, block_mask=layout, block_size=bs)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    want = torch.where(dense.any(-1)[..., None], want, torch.zeros_like(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    # and the gradients, through heads.torch
    qf, kf, vf = [t.clone().requires_grad_() for t in (q, k, v)]
    ht.scaled_dot_product_attention(qf, kf, vf, block_mask=layout, block_size=bs).sum().backward()
    q2, k2, v2 = [t.clone().requires_grad_() for t in (q, k, v)]
    _eager(q2, k2, v2, visible=dense).sum().backward()
    for a, b in ((qf, q2), (kf, k2), (vf, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"block_mask: expected bool \[nQB, nKB\] or \[H, nQB, nKB\]"):
        heads.sdpa(q, k, v, block_mask=layout[:, :1], block_size=bs)
