"""heads.sdpa against torch.nn.functional.scaled_dot_product_attention (PyTorch 2.13)."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import heads

gen = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=gen)


SHAPES = [  # B, H, Hkv, Lq, Lk, D, Dv
    (1, 1, 1, 1, 1, 1, 1),
    (1, 2, 2, 7, 129, 8, 8),
    (3, 4, 4, 129, 7, 63, 63),
    (2, 4, 1, 64, 64, 64, 64),
    (2, 4, 2, 33, 70, 80, 48),
    (1, 8, 8, 129, 129, 128, 128),
    (1, 2, 1, 20, 2100, 40, 33),  # few query tiles, long keys: the forward cuts the keys into chunks
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Lq{}Lk{}D{}Dv{}".format(*s))
@pytest.mark.parametrize("option", ["plain", "bool2d", "bool4d", "float2d", "float_bcast",
                                    "causal", "scale"])
def test_matches_torch(shape, option, check):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = randn(B, H, Lq, D), randn(B, Hkv, Lk, D), randn(B, Hkv, Lk, Dv)
    kw = {"enable_gqa": H != Hkv}
    if option == "bool2d":
        m = torch.rand(Lq, Lk, generator=gen) > 0.3
        m[:, 0] = True  # every row sees a key (torch gives NaN otherwise)
        kw["attn_mask"] = m
    elif option == "bool4d":
        m = torch.rand(B, H, Lq, Lk, generator=gen) > 0.3
        m[..., -1] = True
        kw["attn_mask"] = m
    elif option == "float2d":
        kw["attn_mask"] = randn(Lq, Lk)
    elif option == "float_bcast":
        kw["attn_mask"] = randn(B, 1, 1, Lk)
    elif option == "causal":
        kw["is_causal"] = True
    elif option == "scale":
        kw["scale"] = 0.21
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    out = heads.sdpa(q, k, v, **kw)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    check("sdpa", out, ref, f"{shape} {option}")
    # numpy in, numpy out, same numbers
    kw_np = {key: (val.numpy() if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
    out_np = heads.sdpa(q.numpy(), k.numpy(), v.numpy(), **kw_np)
    assert isinstance(out_np, np.ndarray)
    np.testing.assert_array_equal(out_np, out.numpy())


def test_strided_inputs_without_copies(check):
    # [B, L, H, D] buffers viewed as [B, H, L, D], as a projection produces them.
    base_q, base_k = randn(2, 50, 4, 40), randn(2, 31, 4, 40)
    q, k = base_q.transpose(1, 2), base_k.transpose(1, 2)
    v = randn(2, 4, 31, 56)[..., :40]
    check("sdpa", heads.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v), "strided")


def test_rank_2_and_3_inputs(check):
    for shape_q, shape_k in [((9, 16), (12, 16)), ((3, 9, 16), (3, 12, 16))]:
        q, k, v = randn(*shape_q), randn(*shape_k), randn(*shape_k)
        m = torch.rand(9, 12, generator=gen) > 0.2
        m[:, 0] = True
        out = heads.sdpa(q, k, v, attn_mask=m)
        assert out.shape == q.shape
        check("sdpa", out, F.scaled_dot_product_attention(q, k, v, attn_mask=m), f"rank {q.dim()}")


def test_grad_requiring_inputs_are_accepted(check):
    q = randn(1, 2, 5, 8).requires_grad_()
    out = heads.sdpa(q, q, q)
    check("sdpa", out, F.scaled_dot_product_attention(q, q, q).detach(), "requires_grad input")


def test_fully_masked_rows_give_zeros():
    q, k, v = randn(1, 2, 6, 8), randn(1, 2, 9, 8), randn(1, 2, 9, 8)
    m = torch.rand(6, 9, generator=gen) > 0.3
    m[:, 0] = True
    m[2] = False
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    out = heads.sdpa(q, k, v, attn_mask=m)
    # torch 2.13's fused CPU kernel gives 0 here, its math path NaN; heads always gives 0.
    assert (torch.isnan(ref[:, :, 2]) | (ref[:, :, 2] == 0)).all()
    assert (out[:, :, 2] == 0).all()
    keep = [0, 1, 3, 4, 5]
    torch.testing.assert_close(out[:, :, keep], ref[:, :, keep], rtol=1e-5, atol=1e-6)


def test_dropout_is_seeded_and_unbiased():
    q, k, v = randn(1, 2, 16, 8), randn(1, 2, 24, 8), randn(1, 2, 24, 8)
    a = heads.sdpa(q, k, v, dropout_p=0.25, seed=3)
    b = heads.sdpa(q, k, v, dropout_p=0.25, seed=3)
    c = heads.sdpa(q, k, v, dropout_p=0.25, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    heads.manual_seed(11)
    d = heads.sdpa(q, k, v, dropout_p=0.25)
    heads.manual_seed(11)
    assert torch.equal(d, heads.sdpa(q, k, v, dropout_p=0.25))
    # Kept weights are scaled by 1/(1-p); dropped ones are 0.
    plain, w0 = heads.sdpa(q, k, v, need_weights=True)
    _, w = heads.sdpa(q, k, v, dropout_p=0.25, seed=3, need_weights=True)
    kept = w != 0
    torch.testing.assert_close(w[kept], w0[kept] / 0.75, rtol=1e-6, atol=0)
    assert abs(kept.float().mean().item() - 0.75) < 0.05
    # The mean over many masks approaches the output without dropout.
    mean = sum(heads.sdpa(q, k, v, dropout_p=0.25, seed=s) for s in range(400)) / 400
    assert (mean - plain).abs().max() < 0.1


@pytest.mark.parametrize(
    "args, message",
    [
        (((2, 4, 7, 16), (2, 4, 5, 8), (2, 4, 5, 8)), "key: expected head dim 16"),
        (((2, 4, 7, 16), (2, 4, 5, 16), (2, 4, 6, 16)), "value: expected"),
        (((2, 4, 7, 16), (2, 2, 5, 16), (2, 2, 5, 16)), "enable_gqa"),
        (((2, 4, 7, 16), (2, 3, 5, 16), (2, 3, 5, 16)), "not a multiple"),
        (((16,), (16,), (16,)), "expected 2-D to 4-D"),
    ],
)
def test_bad_shapes_raise_value_error(args, message):
    q, k, v = (np.ones(s, np.float32) for s in args)
    with pytest.raises(ValueError, match=message):
        heads.sdpa(q, k, v)


def test_bad_masks_raise_value_error():
    q = np.ones((1, 2, 7, 8), np.float32)
    with pytest.raises(ValueError, match=r"attn_mask: shape \[7, 6\] does not broadcast"):
        heads.sdpa(q, q, q, attn_mask=np.ones((7, 6), bool))
    with pytest.raises(ValueError, match="attn_mask: expected bool or floating dtype, got i64"):
        heads.sdpa(q, q, q, attn_mask=np.ones((7, 7), np.int64))
    with pytest.raises(ValueError, match="unsupported array dtype"):
        heads.sdpa(q, q, q, attn_mask=np.ones((7, 7), np.int32))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        heads.sdpa(q, q, q, dropout_p=1.5)


@pytest.mark.parametrize("shape", [(2, 4, 4, 129, 77, 64, 64), (1, 8, 2, 3, 1500, 128, 128), (1, 2, 1, 20, 2100, 64, 64),
                                   (1, 2, 2, 200, 200, 63, 80)],
                         ids=lambda s: "B{}H{}Hkv{}Lq{}Lk{}D{}Dv{}".format(*s))
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_error_within_twice_torch_bf16(shape, causal):
    """bf16 in, bf16 out: error against float64 at most twice that of torch's own bf16 SDPA."""
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q = randn(B, H, Lq, D).bfloat16()
    k, v = randn(B, Hkv, Lk, D).bfloat16(), randn(B, Hkv, Lk, Dv).bfloat16()
    kw = dict(is_causal=causal, enable_gqa=H != Hkv)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)
    ours = heads.sdpa(q, k, v, **kw)
    assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
    err_ours = (ours.double() - ref).abs().max().item()
    err_torch = (theirs.double() - ref).abs().max().item()
    assert err_ours <= 2 * err_torch + 1e-6, (err_ours, err_torch)
