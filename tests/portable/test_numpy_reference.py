"""The Python module against float64 numpy references, with numpy alone (no PyTorch).

tests/python cross-checks against PyTorch itself; these run wherever the module builds, PyTorch or
not: on x86-64 beside that suite (scripts/test.sh), and on AArch64 under qemu-aarch64 with Debian's
arm64 Python and numpy (scripts/test-aarch64.sh). Every test draws fresh random inputs.
"""

import numpy as np
import pytest

import heads

RNG = np.random.default_rng()


def rel_err(out, ref) -> float:
    a, b = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != reference {b.shape}"
    assert np.isfinite(a).all(), "non-finite values in the output"
    nb = np.linalg.norm(b)
    # an all-zero reference (every key of every query masked, as a random mask over one key can draw):
    # the output must be zero too, so its own size is the error
    return float(np.linalg.norm(a - b) / nb) if nb > 0 else float(np.linalg.norm(a))


def sdpa_ref(q, k, v, mask=None, causal=False, scale=None):
    """softmax(q kᵀ · scale + mask) v in float64; mask bool (True = may attend) or additive. A query
    whose keys are all masked gives zeros (heads' rule)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if k.shape[-3] != q.shape[-3]:  # grouped query heads share a key/value head
        rep = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    visible = np.ones(s.shape, bool)
    if causal:
        visible &= np.tril(np.ones(s.shape[-2:], bool))
    if mask is not None and mask.dtype == bool:
        visible &= mask
    elif mask is not None:
        s = s + mask
    s = np.where(visible, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(visible, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    l = p.sum(-1, keepdims=True)
    p = np.divide(p, l, out=np.zeros_like(p), where=l > 0)
    return p @ v, p


@pytest.mark.parametrize("lq,lk,d,dv", [(1, 1, 8, 8), (7, 7, 5, 5), (129, 129, 17, 17), (7, 129, 64, 24),
                                        (3, 200, 64, 64)])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_sdpa_f32_matches_float64(lq, lk, d, dv, mask):
    B, H = 2, 3
    q = RNG.standard_normal((B, H, lq, d), dtype=np.float32)
    k = RNG.standard_normal((B, H, lk, d), dtype=np.float32)
    v = RNG.standard_normal((B, H, lk, dv), dtype=np.float32)
    m = None
    if mask == "bool":
        m = RNG.random((B, 1, lq, lk)) < 0.8
    elif mask == "float":
        m = RNG.standard_normal((B, 1, lq, lk)).astype(np.float32)
    causal = mask == "causal"
    out, w = heads.sdpa(q, k, v, attn_mask=m, is_causal=causal, need_weights=True)
    ref, p = sdpa_ref(q, k, v, m, causal)
    assert out.dtype == np.float32 and out.shape == (B, H, lq, dv)
    assert rel_err(out, ref) < 2e-6
    assert rel_err(w, p) < 2e-6
    alone = heads.sdpa(q, k, v, attn_mask=m, is_causal=causal)  # the fused kernel, no weights kept
    assert rel_err(alone, ref) < 2e-6


@pytest.mark.parametrize("lq", [1, 4, 33])
def test_grouped_query_heads_match_float64(lq):
    q = RNG.standard_normal((1, 8, lq, 64), dtype=np.float32)
    k = RNG.standard_normal((1, 2, 300, 64), dtype=np.float32)
    v = RNG.standard_normal((1, 2, 300, 64), dtype=np.float32)
    out = heads.sdpa(q, k, v, enable_gqa=True, scale=0.2)
    assert rel_err(out, sdpa_ref(q, k, v, scale=0.2)[0]) < 2e-6


def mha_ref(x, sd, heads_n, mask=None):
    """torch.nn.MultiheadAttention's self-attention (batch_first, no dropout) in float64."""
    x = np.asarray(x, np.float64)
    N, L, E = x.shape
    hd = E // heads_n
    qkv = x @ sd["in_proj_weight"].astype(np.float64).T + sd["in_proj_bias"]
    q, k, v = (t.reshape(N, L, heads_n, hd).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, axis=-1))
    o, _ = sdpa_ref(q, k, v, mask)
    o = o.transpose(0, 2, 1, 3).reshape(N, L, E)
    return o @ sd["out_proj.weight"].astype(np.float64).T + sd["out_proj.bias"]


@pytest.mark.parametrize("L,E,H", [(1, 16, 2), (7, 24, 3), (129, 40, 4)])
def test_mha_forward_and_backward_match_float64(L, E, H):
    """The forward against the float64 reference; every gradient against the reference's directional
    derivative (central differences in float64) along a random direction."""
    N = 2
    mha = heads.MultiheadAttention(E, H, batch_first=True)
    sd = {k: np.array(v) for k, v in mha.state_dict().items()}
    for name in ("in_proj_bias", "out_proj.bias"):  # torch starts them at 0: draw them too
        sd[name] = RNG.standard_normal(sd[name].shape).astype(np.float32) * 0.1
    mha.load_state_dict(sd)
    x = RNG.standard_normal((N, L, E), dtype=np.float32)
    mask = np.triu(np.ones((L, L), bool), 1)  # torch's bool attn_mask: True = may not attend
    tape = heads.Tape()
    out, _ = mha.forward(x, x, x, attn_mask=mask, need_weights=False, tape=tape)
    assert rel_err(out, mha_ref(x, sd, H, ~mask)) < 2e-6

    g = RNG.standard_normal(out.shape)
    (dx, _, _), grads = mha.backward(tape, g.astype(np.float32))

    def loss(x_, sd_):
        return float(np.sum(mha_ref(x_, sd_, H, ~mask) * g))

    def directional(x_dir, sd_dir, eps=1e-4):
        up = loss(x + eps * x_dir, {k: sd[k] + eps * sd_dir.get(k, 0) for k in sd})
        down = loss(x - eps * x_dir, {k: sd[k] - eps * sd_dir.get(k, 0) for k in sd})
        return (up - down) / (2 * eps)

    def close(grad, u, expect):
        # float32 gradients against a float64 difference quotient: relative to the result, and to the
        # sum of the terms' magnitudes, since a random direction's sum can cancel to near zero
        terms = np.asarray(grad, np.float64) * u
        return abs(float(np.sum(terms)) - expect) <= 1e-4 * abs(expect) + 1e-5 * float(np.sum(np.abs(terms))) + 1e-6

    u = RNG.standard_normal(x.shape)
    assert close(dx, u, directional(u, {}))
    assert set(grads) == set(sd)
    for name in sd:
        u = RNG.standard_normal(sd[name].shape)
        assert close(grads[name], u, directional(np.zeros_like(x, np.float64), {name: u})), name

