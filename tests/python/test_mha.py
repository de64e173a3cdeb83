"""heads.MultiheadAttention against torch.nn.MultiheadAttention (PyTorch 2.13), eval mode."""

import random

import numpy as np
import pytest
import torch

import heads

N_CONFIGS = 240


def make_config(i):
    r = random.Random(1000 + i)
    H = r.choice([1, 2, 3, 4])
    E = H * r.choice([1, 2, 4, 5, 8])
    cross = r.random() < 0.5
    cfg = dict(
        E=E,
        H=H,
        bias=r.random() < 0.7,
        add_bias_kv=r.random() < 0.3,
        add_zero_attn=r.random() < 0.3,
        kdim=r.choice([None, E, 3, 7]) if cross else None,
        vdim=r.choice([None, E, 5]) if cross else None,
        batch_first=r.random() < 0.5,
        batched=r.random() < 0.8,
        N=r.choice([1, 2, 3]),
        L=r.choice([1, 2, 7, 16]),
        S=r.choice([1, 5, 9]) if cross else None,
        kpm=r.choice([None, None, "bool", "float"]),
        attn_mask=r.choice([None, "2d_bool", "2d_float", "3d_bool", "3d_float"]),
        need_weights=r.random() < 0.6,
        average=r.random() < 0.5,
        is_causal=(not cross) and r.random() < 0.25,
        seed=i,
    )
    if cfg["is_causal"]:
        cfg["attn_mask"] = "causal"  # torch needs the mask with the is_causal hint
    return cfg


def make_modules(cfg, g, dropout=0.0):
    """(torch module, heads module) with the same parameters; biases randomised so they count."""
    torch.manual_seed(cfg["seed"])
    kw = dict(dropout=dropout, bias=cfg["bias"], add_bias_kv=cfg["add_bias_kv"],
              add_zero_attn=cfg["add_zero_attn"], kdim=cfg["kdim"], vdim=cfg["vdim"],
              batch_first=cfg["batch_first"])
    ref = torch.nn.MultiheadAttention(cfg["E"], cfg["H"], **kw)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    mine = heads.MultiheadAttention(cfg["E"], cfg["H"], **kw)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def make_inputs(cfg, g):
    """(query, key, value, forward kwargs) for a configuration; key is value is query for
    self-attention. Masks always leave key 0 visible (torch gives NaN for fully masked rows)."""
    E, N, L = cfg["E"], cfg["N"], cfg["L"]
    S = cfg["S"] or L
    kd, vd = cfg["kdim"] or E, cfg["vdim"] or E

    def shape(T, width):
        if not cfg["batched"]:
            return (T, width)
        return (N, T, width) if cfg["batch_first"] else (T, N, width)

    q = torch.randn(shape(L, E), generator=g)
    if cfg["S"] is None:
        k = v = q
    else:
        k, v = torch.randn(shape(S, kd), generator=g), torch.randn(shape(S, vd), generator=g)
    Nb = N if cfg["batched"] else 1
    kw = dict(need_weights=cfg["need_weights"], average_attn_weights=cfg["average"])
    if cfg["kpm"]:
        pad = torch.rand(Nb, S, generator=g) < 0.3
        pad[:, 0] = False
        kpm = pad if cfg["kpm"] == "bool" else pad.float() * -1e4 + torch.randn(Nb, S, generator=g)
        kw["key_padding_mask"] = kpm if cfg["batched"] else kpm[0]
    am = cfg["attn_mask"]
    if am == "causal":
        kw["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(L)
        kw["is_causal"] = True
    elif am:
        lead = (Nb * cfg["H"],) if am.startswith("3d") else ()
        blocked = torch.rand(*lead, L, S, generator=g) < 0.3
        blocked[..., 0] = False
        if am.endswith("bool"):
            kw["attn_mask"] = blocked
        else:
            kw["attn_mask"] = torch.randn(*lead, L, S, generator=g) - blocked.float() * 1e4
    return q, k, v, kw


def run_pair(cfg):
    g = torch.Generator().manual_seed(cfg["seed"])
    ref, mine = make_modules(cfg, g)
    ref.eval()
    mine.eval()
    q, k, v, kw = make_inputs(cfg, g)
    out_ref, w_ref = ref(q, k, v, **kw)
    out, w = mine(q, k, v, **kw)
    return out_ref.detach(), None if w_ref is None else w_ref.detach(), out, w


@pytest.mark.parametrize("i", range(N_CONFIGS))
def test_random_configuration(i, check):
    cfg = make_config(i)
    out_ref, w_ref, out, w = run_pair(cfg)
    what = ", ".join(f"{k}={v}" for k, v in cfg.items())
    assert out.shape == out_ref.shape
    check("MultiheadAttention output", out, out_ref, what)
    if w_ref is None:
        assert w is None
    else:
        assert w.shape == w_ref.shape
        check("MultiheadAttention weights", w, w_ref, what)


def test_config_grid_covers_every_option():
    cfgs = [make_config(i) for i in range(N_CONFIGS)]
    for key in ["bias", "add_bias_kv", "add_zero_attn", "batch_first", "batched", "need_weights",
                "average", "is_causal"]:
        assert {c[key] for c in cfgs} == {True, False}, key
    assert {c["kpm"] for c in cfgs} == {None, "bool", "float"}
    assert {c["attn_mask"] for c in cfgs} >= {None, "2d_bool", "2d_float", "3d_bool", "3d_float", "causal"}
    assert any(c["kdim"] not in (None, c["E"]) for c in cfgs)
    assert sum(c["S"] is not None for c in cfgs) > 50  # cross-attention


def test_numpy_in_numpy_out_and_fused_self_attention(check):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    mine = heads.MultiheadAttention(32, 4, batch_first=True).eval()
    mine.load_state_dict(ref.state_dict())
    x = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    out, w = mine(x, x, x)
    assert isinstance(out, np.ndarray) and isinstance(w, np.ndarray)
    out_ref, w_ref = ref(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x))
    check("MultiheadAttention output", out, out_ref, "numpy self-attention")
    check("MultiheadAttention weights", w, w_ref, "numpy self-attention")


def test_fully_masked_rows_give_zeros():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(8, 2).eval()
    mine = heads.MultiheadAttention(8, 2).eval()
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(4, 1, 8)
    m = torch.zeros(4, 4, dtype=torch.bool)
    m[1] = True  # query 1 may attend to nothing
    out_ref, w_ref = ref(x, x, x, attn_mask=m)
    out, w = mine(x, x, x, attn_mask=m)
    assert torch.isnan(w_ref[0, 1]).all()
    assert (w[0, 1] == 0).all()
    # its attention output is 0, so the row equals the out-projection bias
    torch.testing.assert_close(out[1, 0], torch.from_numpy(mine.state_dict()["out_proj.bias"]))
    keep = [0, 2, 3]
    torch.testing.assert_close(out[keep], out_ref[keep], rtol=1e-5, atol=1e-6)


def test_train_mode_dropout_is_seeded():
    mine = heads.MultiheadAttention(16, 2, dropout=0.5, seed=1)
    x = np.random.default_rng(1).standard_normal((5, 2, 16)).astype(np.float32)
    assert mine.training
    heads.manual_seed(5)
    a, _ = mine(x, x, x)
    heads.manual_seed(5)
    b, _ = mine(x, x, x)
    c, _ = mine(x, x, x)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    mine.eval()
    d, _ = mine(x, x, x)
    e, _ = mine(x, x, x)
    np.testing.assert_array_equal(d, e)


def test_initialisation_matches_torch_distribution():
    mine = heads.MultiheadAttention(64, 8, add_bias_kv=True, seed=0)
    sd = mine.state_dict()
    bound = np.sqrt(6 / (64 + 192))
    assert np.abs(sd["in_proj_weight"]).max() <= bound
    assert abs(sd["in_proj_weight"].std() - bound / np.sqrt(3)) < 0.05 * bound
    assert (sd["in_proj_bias"] == 0).all() and (sd["out_proj.bias"] == 0).all()
    assert np.abs(sd["out_proj.weight"]).max() <= 1 / 8
    torch_keys = list(torch.nn.MultiheadAttention(64, 8, add_bias_kv=True).state_dict())
    assert list(sd) == torch_keys


def test_save_and_load_round_trip_with_torch(tmp_path, check):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(12, 3, kdim=5, vdim=7, add_bias_kv=True).eval()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "ref.safetensors")
    mine = heads.MultiheadAttention(12, 3, kdim=5, vdim=7, add_bias_kv=True).eval()
    mine.load(tmp_path / "ref.safetensors")
    mine.save(tmp_path / "mine.safetensors")
    back = torch.nn.MultiheadAttention(12, 3, kdim=5, vdim=7, add_bias_kv=True).eval()
    back.load_state_dict(load_file(tmp_path / "mine.safetensors"))
    for key, val in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], val), key
    q, k, v = torch.randn(4, 2, 12), torch.randn(6, 2, 5), torch.randn(6, 2, 7)
    check("MultiheadAttention output", mine(q, k, v)[0], ref(q, k, v)[0], "loaded from torch file")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x: m(np.ones((5, 2, 6), np.float32), x, x), r"query: expected embed_dim 8"),
        (lambda m, x: m(x, np.ones((4, 2, 8), np.float32), x), "same sequence length"),
        (lambda m, x: m(x, x, x, key_padding_mask=np.ones((2, 4), bool)), r"key_padding_mask: expected \[2, 5\]"),
        (lambda m, x: m(x, x, x, attn_mask=np.ones((5, 5), np.int64)), "only bool and floating"),
        (lambda m, x: m(x, x, x, attn_mask=np.ones((3, 5, 5), bool)), r"attn_mask: expected \[4, 5, 5\]"),
        (lambda m, x: m.load_state_dict({"in_proj_weight": np.ones((24, 8), np.float32)}), "missing"),
        (lambda m, x: m.load_state_dict({**m.state_dict(), "in_proj_weight": np.ones((24, 7), np.float32)}), r"expected shape \[24, 8\]"),
        (lambda m, x: heads.MultiheadAttention(10, 3), "embed_dim 10 is not divisible by num_heads 3"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    m = heads.MultiheadAttention(8, 2).eval()
    x = np.ones((5, 2, 8), np.float32)
    with pytest.raises(ValueError, match=message):
        call(m, x)
