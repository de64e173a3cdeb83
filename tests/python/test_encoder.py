"""heads.TransformerEncoderLayer / TransformerEncoder against torch.nn (PyTorch 2.13), eval mode."""

import random

import pytest
import torch

import heads

N_CONFIGS = 80


def config(i):
    r = random.Random(5000 + i)
    nhead = r.choice([1, 2, 4])
    d = nhead * r.choice([2, 4, 8])
    return dict(
        d_model=d, nhead=nhead, dim_feedforward=r.choice([8, 24, 64]),
        activation=r.choice(["relu", "gelu"]), layer_norm_eps=r.choice([1e-5, 1e-12, 1e-3]),
        batch_first=r.random() < 0.5, norm_first=r.random() < 0.5, bias=r.random() < 0.8,
        batched=r.random() < 0.8, N=r.choice([1, 3]), L=r.choice([1, 5, 17]),
        kpm=r.choice([None, "bool", "float"]), mask=r.choice([None, "2d_bool", "2d_float", "3d_float", "causal"]),
        seed=i,
    )


def make_inputs(cfg, g):
    N, L, d = cfg["N"], cfg["L"], cfg["d_model"]
    shape = ((N, L, d) if cfg["batch_first"] else (L, N, d)) if cfg["batched"] else (L, d)
    src = torch.randn(shape, generator=g)
    Nb = N if cfg["batched"] else 1
    kw = {}
    if cfg["kpm"]:
        pad = torch.rand(Nb, L, generator=g) < 0.3
        pad[:, 0] = False
        kpm = pad if cfg["kpm"] == "bool" else pad.float() * -1e4
        kw["src_key_padding_mask"] = kpm if cfg["batched"] else kpm[0]
    m = cfg["mask"]
    if m == "causal":
        kw["src_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(L)
        kw["is_causal"] = True
    elif m:
        lead = (Nb * cfg["nhead"],) if m.startswith("3d") else ()
        blocked = torch.rand(*lead, L, L, generator=g) < 0.3
        blocked[..., 0] = False
        kw["src_mask"] = blocked if m.endswith("bool") else torch.randn(*lead, L, L, generator=g) - blocked.float() * 1e4
    return src, kw


def randomise(module, g):
    """Every parameter drawn from g, so a config's seed alone fixes the test (not the global RNG,
    whose state depends on the tests run before): weights uniform in the Xavier range, norm
    weights around 1, biases around 0."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("norm1.weight") or name.endswith("norm2.weight") else 0.0))
            else:
                bound = (6.0 / (p.shape[0] + p.shape[1])) ** 0.5
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)


@pytest.mark.parametrize("i", range(N_CONFIGS))
def test_encoder_layer_matches_torch(i, check):
    cfg = config(i)
    g = torch.Generator().manual_seed(cfg["seed"])
    kw = {k: cfg[k] for k in ["d_model", "nhead", "dim_feedforward", "activation", "layer_norm_eps",
                             "batch_first", "norm_first", "bias"]}
    ref = torch.nn.TransformerEncoderLayer(**kw, dropout=0.1).eval()
    randomise(ref, g)
    mine = heads.TransformerEncoderLayer(**kw, dropout=0.1).eval()
    mine.load_state_dict(ref.state_dict())
    src, fkw = make_inputs(cfg, g)
    out_ref = ref(src, **fkw)  # grad enabled: torch takes its reference (non-fast) path
    out = mine(src, **fkw)
    check("TransformerEncoderLayer", out, out_ref, str(cfg))


@pytest.mark.parametrize("i", range(12))
def test_encoder_stack_matches_torch(i, check):
    cfg = config(100 + i)
    g = torch.Generator().manual_seed(cfg["seed"])
    kw = {k: cfg[k] for k in ["d_model", "nhead", "dim_feedforward", "activation", "layer_norm_eps",
                             "batch_first", "norm_first", "bias"]}
    layer = torch.nn.TransformerEncoderLayer(**kw, dropout=0.0)
    final = torch.nn.LayerNorm(cfg["d_model"], eps=cfg["layer_norm_eps"], bias=cfg["bias"]) if i % 2 else None
    ref = torch.nn.TransformerEncoder(layer, num_layers=1 + i % 3, norm=final, enable_nested_tensor=False).eval()
    randomise(ref, g)
    my_layer = heads.TransformerEncoderLayer(**kw, dropout=0.0)
    mine = heads.TransformerEncoder(my_layer, num_layers=1 + i % 3, norm=final is not None).eval()
    mine.load_state_dict(ref.state_dict())
    src, fkw = make_inputs(cfg, g)
    fkw["mask"] = fkw.pop("src_mask", None)
    check("TransformerEncoder", mine(src, **fkw), ref(src, **fkw), str(cfg))


def test_state_dict_names_match_torch():
    ref = torch.nn.TransformerEncoderLayer(16, 4, 32)
    mine = heads.TransformerEncoderLayer(16, 4, 32)
    assert list(mine.state_dict()) == list(ref.state_dict())
    assert all(mine.state_dict()[k].shape == tuple(v.shape) for k, v in ref.state_dict().items())
    ref_nb = torch.nn.TransformerEncoderLayer(16, 4, 32, bias=False)
    assert list(heads.TransformerEncoderLayer(16, 4, 32, bias=False).state_dict()) == list(ref_nb.state_dict())


def test_bad_input_raises_value_error():
    layer = heads.TransformerEncoderLayer(8, 2, 16)
    with pytest.raises(ValueError, match="expected d_model 8"):
        layer(torch.randn(3, 2, 6))
    with pytest.raises(ValueError, match="activation must be"):
        heads.TransformerEncoderLayer(8, 2, activation="swish")
    with pytest.raises(ValueError, match="missing"):
        layer.load_state_dict({"linear1.weight": torch.zeros(16, 8)})


@pytest.mark.parametrize("kind", ["mha", "layer", "stack"])
def test_pack_f32_gives_the_plain_bits_and_follows_the_weights(kind):
    """pack_f32 (the weights also in the GEMM's own layout): the bits of the plain module, self- and
    cross-attention, one row and many; load_state_dict lays the new weights out again (still packed:
    weights written in place after it are not seen until pack_f32 runs again, as documented); in
    bf16 it does nothing."""
    g = torch.Generator().manual_seed(3)

    def build(seed):
        if kind == "mha":
            return heads.MultiheadAttention(40, 4, batch_first=True, seed=seed).eval()
        layer = heads.TransformerEncoderLayer(40, 4, 72, dropout=0.0, batch_first=True, seed=seed)
        return (layer if kind == "layer" else heads.TransformerEncoder(layer, num_layers=2)).eval()

    def run(m, x, kv):
        return m(x, kv, kv)[0] if kind == "mha" else m(x)

    plain, packed = build(1), build(1)
    assert packed.pack_f32() is packed and packed.dtype == "f32"
    for L in (1, 7, 33):
        x, kv = torch.randn(2, L, 40, generator=g), torch.randn(2, 9, 40, generator=g)
        assert torch.equal(run(packed, x, x), run(plain, x, x))
        if kind == "mha":
            assert torch.equal(run(packed, x, kv), run(plain, x, kv))
    x = torch.randn(2, 7, 40, generator=g)
    other = build(2)
    packed.load_state_dict(other.state_dict())
    assert torch.equal(run(packed, x, x), run(other, x, x))
    # written in place: the packed layout still holds the old values until pack_f32 runs again
    name = "out_proj.weight" if kind == "mha" else ("linear2.weight" if kind == "layer" else "layers.1.linear2.weight")
    before = run(packed, x, x)
    packed.state_dict()[name][:] *= 2.0
    other.state_dict()[name][:] *= 2.0
    assert torch.equal(run(packed, x, x), before)
    packed.pack_f32()
    assert torch.equal(run(packed, x, x), run(other, x, x))
    packed.to("bf16").pack_f32()
    assert packed.dtype == "bf16"
    assert not torch.equal(run(packed, x, x), run(other, x, x))
