"""MultiheadAttention's attention variants (linear, local window, block-sparse, head gates, head_dim,
prune_heads) against the same math written directly in PyTorch 2.13, in float64: outputs, and
gradients through torch autograd."""

import itertools
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import heads

E = 24


def torch_mha(p, cfg, q, k, v, is_causal, threshold=0.0, key_padding_mask=None):
    """The module's math in torch for [L, N, *] inputs; p maps parameter names to (float64) tensors."""
    H, hd = cfg["num_heads"], cfg.get("head_dim") or E // cfg["num_heads"]
    Ei = H * hd
    L, N = q.shape[0], q.shape[1]
    w_in, b_in = p["in_proj_weight"], p["in_proj_bias"]

    def heads_of(x, part):  # [T, N, *] -> [N, H, T, hd]
        y = F.linear(x, w_in[part * Ei:(part + 1) * Ei], b_in[part * Ei:(part + 1) * Ei])
        return y.reshape(x.shape[0], N, H, hd).permute(1, 2, 0, 3)

    qh, kh, vh = heads_of(q, 0), heads_of(k, 1), heads_of(v, 2)
    S = kh.shape[2]
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    if cfg.get("attention") == "linear":
        phi = (lambda x: F.elu(x) + 1) if cfg.get("feature_map", "elu") == "elu" else F.relu
        fk = phi(kh)
        if key_padding_mask is not None:  # [N, S]: padded keys' features are zero
            fk = fk * (~key_padding_mask)[:, None, :, None]
        a = phi(qh) @ fk.transpose(-1, -2)
        if is_causal:
            a = a * (j <= i)
        att = (a @ vh) / (a.sum(-1, keepdim=True) + 1e-6)
    else:
        visible = torch.ones(L, S, dtype=torch.bool)
        if is_causal:
            visible &= j <= i
        if cfg.get("window") is not None:
            w = cfg["window"]
            visible &= (j >= i - w) & (j <= i + w)
        if cfg.get("sparse_block"):
            bs, st = cfg["sparse_block"], cfg.get("sparse_stride", 4)
            qb, kb = i // bs, j // bs
            visible &= (kb == qb) | (kb % st == st - 1) | ((qb % st == st - 1) & (kb // st == qb // st))
        att = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible)
    if cfg.get("head_gate"):
        pool = q[0] if cfg["head_gate"] == "first" else q.mean(0)  # [N, E]
        g = torch.sigmoid(F.linear(pool, p["head_gate.weight"], p["head_gate.bias"]))
        g = torch.where(g < threshold, torch.zeros_like(g), g)
        att = att * g[:, :, None, None]
    out = att.permute(2, 0, 1, 3).reshape(L, N, Ei)
    return F.linear(out, p["out_proj.weight"], p["out_proj.bias"])


VARIANTS = [
    dict(attention="linear"),
    dict(attention="linear", feature_map="relu", head_gate="mean"),
    dict(window=3),
    dict(window=0, head_gate="first"),
    dict(sparse_block=4, sparse_stride=2),
    dict(sparse_block=2, sparse_stride=3, head_gate="first"),
    dict(sparse_block=3, sparse_stride=3, head_gate="mean", head_dim=5),
    dict(head_gate="first", head_dim=7),
    dict(attention="linear", head_dim=3),
]


def build(cfg, seed, batch_first=False):
    kw = {k: v for k, v in cfg.items() if k != "num_heads"}
    m = heads.MultiheadAttention(E, cfg["num_heads"], batch_first=batch_first, seed=seed, **kw)
    rng = np.random.default_rng(seed)
    for name, t in m.state_dict().items():
        t[...] = rng.standard_normal(t.shape).astype(np.float32) * 0.3
    return m


CASES = list(itertools.product(range(len(VARIANTS)), [False, True], [1, 7, 33]))


@pytest.mark.parametrize("vi,causal,L", CASES)
def test_forward_matches_torch(vi, causal, L, check):
    cfg = dict(VARIANTS[vi], num_heads=4)
    m = build(cfg, seed=vi * 100 + L).eval()
    g = torch.Generator().manual_seed(vi * 7 + L)
    x = torch.randn(L, 3, E, generator=g)
    if causal and cfg.get("head_gate") == "mean":  # the mean would see later tokens
        with pytest.raises(ValueError, match="head_gate mean pools every query token"):
            m(x, x, x, is_causal=True)
        return
    p = {n: torch.from_numpy(np.array(t)).double() for n, t in m.state_dict().items()}
    want = torch_mha(p, cfg, x.double(), x.double(), x.double(), causal)
    out, w = m(x, x, x, is_causal=causal, need_weights=False)
    check("MHA variant output", out, want, f"{cfg} causal={causal} L={L}")
    assert w is None
    # batch_first gives the same numbers.
    mb = build(cfg, seed=1, batch_first=True).eval()
    mb.load_state_dict(m.state_dict())
    xb = x.transpose(0, 1).contiguous()
    outb, _ = mb(xb, xb, xb, is_causal=causal, need_weights=False)
    check("MHA variant batch_first", outb.transpose(0, 1), want, f"{cfg} causal={causal} L={L}")


# Mean-pooled gates with a causal call are rejected (test_forward_matches_torch checks the error).
GRAD_CASES = [(vi, c) for vi in range(len(VARIANTS)) for c in (False, True)
              if not (c and VARIANTS[vi].get("head_gate") == "mean")]


@pytest.mark.parametrize("vi,causal", GRAD_CASES)
def test_gradients_match_torch_autograd(vi, causal, check):
    cfg = dict(VARIANTS[vi], num_heads=4)
    if cfg.get("feature_map") == "relu":
        cfg["feature_map"] = "elu"  # relu's rows of all-zero features make the reference's gradient ill-posed
    m = build(cfg, seed=vi + 40)
    g = torch.Generator().manual_seed(vi)
    x = torch.randn(9, 2, E, generator=g)
    p = {n: torch.from_numpy(np.array(t)).double().requires_grad_() for n, t in m.state_dict().items()}
    xt = x.double().requires_grad_()
    want = torch_mha(p, cfg, xt, xt, xt, causal)
    dout = torch.randn(want.shape, generator=g)
    (want * dout.double()).sum().backward()
    tape = heads.Tape()
    out, _ = m(x, x, x, is_causal=causal, need_weights=False, tape=tape)
    (dq, dk, dv), grads = m.backward(tape, dout)
    what = f"{cfg} causal={causal}"
    check("MHA variant output", out, want, what)
    floor = 1e-3 * max(float(r.grad.norm()) for r in [xt, *p.values()])
    check("MHA variant grad input", dq, xt.grad, what, tol=1e-4, floor=floor)
    assert dk is None and dv is None
    assert list(grads) == list(p)
    for name, t in p.items():
        check("MHA variant grad parameter", grads[name], t.grad, f"{name}: {what}", tol=1e-4, floor=floor)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_mha_with_key_padding_mask(causal, check):
    cfg = dict(num_heads=4, attention="linear")
    m = build(cfg, seed=11)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 2, E, generator=g)
    mask = torch.tensor([[False] * 6 + [True] * 3, [False, True] * 4 + [False]])
    p = {n: torch.from_numpy(np.array(t)).double().requires_grad_() for n, t in m.state_dict().items()}
    xt = x.double().requires_grad_()
    want = torch_mha(p, cfg, xt, xt, xt, causal, key_padding_mask=mask)
    dout = torch.randn(want.shape, generator=g)
    (want * dout.double()).sum().backward()
    tape = heads.Tape()
    out, _ = m(x, x, x, key_padding_mask=mask, is_causal=causal, need_weights=False, tape=tape)
    (dq, _, _), grads = m.backward(tape, dout)
    check("linear MHA key_padding_mask", out, want, f"causal={causal}")
    floor = 1e-3 * max(float(r.grad.norm()) for r in [xt, *p.values()])
    check("linear MHA key_padding_mask grad", dq, xt.grad, f"causal={causal}", tol=1e-4, floor=floor)
    for name, t in p.items():
        check("linear MHA key_padding_mask grad", grads[name], t.grad, name, tol=1e-4, floor=floor)
    # the weights put nothing on padded keys
    _, w = m(x, x, x, key_padding_mask=mask, is_causal=causal, average_attn_weights=False)
    assert torch.all(w.permute(0, 2, 1, 3)[mask[:, None, :].expand(2, 9, 9)[:, :, None, :].expand(2, 9, 4, 9)] == 0)


def test_linear_mha_mask_unbatched_and_appended_keys(check):
    """Unbatched inputs take a [S] mask; keys appended by add_bias_kv / add_zero_attn stay visible."""
    m = heads.MultiheadAttention(E, 4, attention="linear", add_bias_kv=True, add_zero_attn=True, seed=4).eval()
    x = torch.randn(6, E, generator=torch.Generator().manual_seed(8))
    mask = torch.tensor([False, False, True, False, True, True])
    out, w = m(x, x, x, key_padding_mask=mask, average_attn_weights=False)
    batched, wb = m(x[:, None], x[:, None], x[:, None], key_padding_mask=mask[None], average_attn_weights=False)
    torch.testing.assert_close(out, batched[:, 0], rtol=0, atol=0)
    assert w.shape == (4, 6, 8) and torch.equal(w, wb[0])
    assert torch.all(w[:, :, :6][:, :, mask] == 0)
    assert torch.all(w[:, :, 6] > 0)  # bias_k's key (zero_attn's is φ(0) = 1 > 0 too)
    torch.testing.assert_close(w.sum(-1), torch.ones(4, 6), rtol=1e-5, atol=1e-5)


def test_gates_below_threshold_skip_heads(check):
    cfg = dict(num_heads=6, head_gate="first", gate_threshold=0.5)
    m = build(cfg, seed=3)
    x = torch.randn(11, 4, E, generator=torch.Generator().manual_seed(0))
    gates = m.head_gates(x)
    assert gates.shape == (4, 6)
    assert 0 < int((gates < 0.5).sum()) < gates.numel(), "some heads on, some off"
    p = {n: torch.from_numpy(np.array(t)).double() for n, t in m.state_dict().items()}
    soft, _ = m(x, x, x, need_weights=False)  # training mode: soft gates
    check("gated MHA (soft)", soft, torch_mha(p, cfg, x.double(), x.double(), x.double(), False), str(cfg))
    m.eval()
    hard, w = m(x, x, x, average_attn_weights=False)
    check("gated MHA (skipped heads)", hard, torch_mha(p, cfg, x.double(), x.double(), x.double(), False, 0.5), str(cfg))
    # The weights of a skipped head are exactly zero; the others are softmax rows.
    off = (gates < 0.5)
    assert torch.all(w[off] == 0)
    torch.testing.assert_close(w[~off].sum(-1), torch.ones_like(w[~off].sum(-1)))


def test_prune_heads_equals_silencing_them(check):
    cfg = dict(num_heads=6, head_gate="mean")
    m = build(cfg, seed=5).eval()
    x = torch.randn(8, 2, E, generator=torch.Generator().manual_seed(1))
    p = {n: torch.from_numpy(np.array(t)).double() for n, t in m.state_dict().items()}
    hd = E // 6
    for h in (1, 4):
        p["out_proj.weight"][:, h * hd:(h + 1) * hd] = 0
    want = torch_mha(p, cfg, x.double(), x.double(), x.double(), False)
    m.prune_heads([4, 1])
    assert (m.num_heads, m.head_dim) == (4, hd)
    assert m.state_dict()["in_proj_weight"].shape == (3 * 4 * hd, E)
    assert m.state_dict()["out_proj.weight"].shape == (E, 4 * hd)
    out, _ = m(x, x, x, need_weights=False)
    check("pruned MHA", out, want, "heads 1 and 4 removed")
    m2 = pickle.loads(pickle.dumps(m))
    assert m2.num_heads == 4
    torch.testing.assert_close(m2(x, x, x, need_weights=False)[0], out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="removing all 4 heads would leave no attention"):
        m.prune_heads(range(4))
    with pytest.raises(ValueError, match="head 9 is out of range for 4 heads"):
        m.prune_heads([9])


def test_encoder_prune_heads_and_linear_layer():
    layer = heads.TransformerEncoderLayer(E, 4, 48, dropout=0.0, attention="linear", seed=2)
    enc = heads.TransformerEncoder(layer, 3)
    enc.prune_heads({0: [1], 2: [0, 3]})
    sd = enc.state_dict()
    assert sd["layers.0.self_attn.in_proj_weight"].shape == (3 * 3 * 6, E)
    assert sd["layers.1.self_attn.in_proj_weight"].shape == (3 * E, E)
    assert sd["layers.2.self_attn.out_proj.weight"].shape == (E, 12)
    x = np.random.default_rng(0).standard_normal((5, 2, E)).astype(np.float32)
    y = enc(x, is_causal=True)
    y2 = pickle.loads(pickle.dumps(enc))(x, is_causal=True)
    np.testing.assert_array_equal(y, y2)
    layer.prune_heads([0])
    with pytest.raises(ValueError, match="encoder_layer has pruned heads"):
        heads.TransformerEncoder(layer, 2)


def test_encoder_layer_runs_its_variant(check):
    """The layer's self-attention is the variant: post-norm layer = norm2(h + ff(h)), h = norm1(x + mha(x))."""
    for cfg in VARIANTS[:6]:
        kw = {k: v for k, v in cfg.items() if k != "head_dim"}
        layer = heads.TransformerEncoderLayer(E, 4, 40, dropout=0.0, seed=9, **kw).eval()
        mha = heads.MultiheadAttention(E, 4, seed=1, **kw).eval()
        sd = layer.state_dict()
        mha.load_state_dict({k[len("self_attn."):]: v for k, v in sd.items() if k.startswith("self_attn.")})
        x = torch.randn(10, 2, E, generator=torch.Generator().manual_seed(2))
        causal = cfg.get("head_gate") != "mean"
        a, _ = mha(x, x, x, need_weights=False, is_causal=causal)
        t = {k: torch.from_numpy(np.array(v)) for k, v in sd.items()}
        h = F.layer_norm(x + a, (E,), t["norm1.weight"], t["norm1.bias"])
        ff = F.linear(F.relu(F.linear(h, t["linear1.weight"], t["linear1.bias"])), t["linear2.weight"], t["linear2.bias"])
        want = F.layer_norm(h + ff, (E,), t["norm2.weight"], t["norm2.bias"])
        check("encoder layer variant", layer(x, is_causal=causal), want, str(cfg), tol=1e-5)


def test_torch_module_with_variants_trains(check):
    """heads.torch.MultiheadAttention with head gates and a window: autograd gradients equal the torch
    formula's, and an optimizer step changes the gate parameters."""
    import heads.torch as ht

    torch.manual_seed(0)
    cfg = dict(num_heads=4, head_gate="mean", window=2)
    m = ht.MultiheadAttention(E, 4, head_gate="mean", window=2)
    names = [n for n, _ in m.named_parameters()]
    assert "head_gate.weight" in names and "head_gate.bias" in names
    x = torch.randn(7, 3, E, requires_grad=True)
    out, _ = m(x, x, x, need_weights=False)
    dout = torch.randn(out.shape)
    (out * dout).sum().backward()
    p = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    xt = x.detach().double().requires_grad_()
    want = torch_mha(p, cfg, xt, xt, xt, False)
    (want * dout.double()).sum().backward()
    check("torch MHA variant output", out.detach(), want.detach(), str(cfg))
    check("torch MHA variant grad input", x.grad, xt.grad, str(cfg), tol=1e-4)
    for n, t in m.named_parameters():
        check("torch MHA variant grad parameter", t.grad, p[n].grad, n, tol=1e-4)
    before = m.head_gate.weight.detach().clone()
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert not torch.equal(before, m.head_gate.weight.detach())
    # Inference without autograd skips gated-off heads (eval + threshold).
    mi = ht.MultiheadAttention(E, 4, head_gate="first", gate_threshold=0.5).eval()
    with torch.no_grad():
        y, _ = mi(x, x, x, need_weights=False)
    pi = {n: t.detach().double() for n, t in mi.named_parameters()}
    xd = x.detach().double()
    check("torch MHA skipped heads", y, torch_mha(pi, dict(num_heads=4, head_gate="first"), xd, xd, xd, False, 0.5), "eval")


def test_bad_variant_arguments():
    with pytest.raises(ValueError, match='attention must be "softmax" or "linear", got "cosine"'):
        heads.MultiheadAttention(E, 4, attention="cosine")
    with pytest.raises(ValueError, match='head_gate must be "none", "first" or "mean"'):
        heads.MultiheadAttention(E, 4, head_gate="max")
    with pytest.raises(ValueError, match="linear attention takes neither"):
        heads.MultiheadAttention(E, 4, attention="linear", window=4)
    with pytest.raises(ValueError, match="gate_threshold must be in"):
        heads.MultiheadAttention(E, 4, head_gate="first", gate_threshold=2.0)
    m = heads.MultiheadAttention(E, 4, attention="linear")
    x = np.zeros((3, 1, E), np.float32) + 0.5
    with pytest.raises(ValueError, match="linear attention takes no attn_mask"):
        m(x, x, x, attn_mask=np.zeros((3, 3), bool))
    with pytest.raises(ValueError, match="linear attention takes a bool mask"):
        m(x, x, x, key_padding_mask=np.zeros((1, 3), np.float32))
    assert heads.MultiheadAttention(E, 4).head_gates(x) is None
