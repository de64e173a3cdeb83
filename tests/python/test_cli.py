"""`heads mha` on files written from a torch state dict, against torch.nn.MultiheadAttention."""

import os
import platform
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

HEADS = os.environ.get("HEADS_CLI") or shutil.which("heads")


def run(*args):
    assert HEADS, "the heads CLI is not on PATH (run the README's set-up) and HEADS_CLI is unset"
    return subprocess.run([HEADS, *map(str, args)], capture_output=True, text=True)


def write_state(path, module):
    save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()}, path)


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(batch_first=True, need_weights=True),
        dict(need_weights=True, no_average=True, kpm=True),
        dict(causal=True),
        dict(cross=True, kdim=6, vdim=10, need_weights=True),
        dict(unbatched=True, attn_mask=True, need_weights=True, bias=False),
        dict(add_bias_kv=True, kpm=True, batch_first=True),
        dict(half_inputs=True),
    ],
    ids=lambda o: "-".join(o) or "plain",
)
def test_mha_matches_torch(tmp_path, opts, check):
    torch.manual_seed(len(opts))
    E, H, L, N = 16, 4, 9, 3
    ref = torch.nn.MultiheadAttention(
        E, H, bias=opts.get("bias", True), add_bias_kv=opts.get("add_bias_kv", False),
        kdim=opts.get("kdim"), vdim=opts.get("vdim"), batch_first=opts.get("batch_first", False),
    ).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_()
    write_state(tmp_path / "state.safetensors", ref)
    unbatched = opts.get("unbatched", False)

    def shape(T, width):
        if unbatched:
            return (T, width)
        return (N, T, width) if opts.get("batch_first") else (T, N, width)

    S = 7 if opts.get("cross") else L
    q = torch.randn(shape(L, E))
    inputs = {"query": q}
    k = v = q
    if opts.get("cross"):
        k, v = torch.randn(shape(S, opts["kdim"])), torch.randn(shape(S, opts["vdim"]))
        inputs.update(key=k, value=v)
    kw = dict(need_weights=opts.get("need_weights", False),
              average_attn_weights=not opts.get("no_average", False))
    if opts.get("kpm"):
        pad = torch.rand(N, S) < 0.3
        pad[:, 0] = False
        inputs["key_padding_mask"] = pad
        kw["key_padding_mask"] = pad
    if opts.get("attn_mask"):
        m = torch.randn(L, S)
        inputs["attn_mask"] = m
        kw["attn_mask"] = m
    if opts.get("causal"):
        kw["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(L)
        kw["is_causal"] = True
    if opts.get("half_inputs"):
        inputs["query"] = q.to(torch.float16)
        q = inputs["query"].float()
        k = v = q
    save_file(inputs, tmp_path / "in.safetensors")
    out_ref, w_ref = ref(q, k, v, **kw)

    args = ["mha", "--state", tmp_path / "state.safetensors", "--input", tmp_path / "in.safetensors",
            "--output", tmp_path / "out.safetensors", "--num-heads", H, "--threads", 2]
    for flag in ["batch_first", "causal", "need_weights", "no_average"]:
        if opts.get(flag):
            args.append("--" + flag.replace("_", "-").replace("no-average", "no-average-weights"))
    r = run(*args)
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "out.safetensors")
    check("CLI mha output", got["output"], out_ref, str(opts))
    if kw["need_weights"]:
        check("CLI mha weights", got["attn_weights"], w_ref, str(opts))
    else:
        assert "attn_weights" not in got


def test_bad_inputs_exit_1_and_leave_no_output(tmp_path):
    ref = torch.nn.MultiheadAttention(8, 2)
    write_state(tmp_path / "state.safetensors", ref)
    out = tmp_path / "out.safetensors"
    cases = {
        "wrong embed": {"query": torch.randn(5, 2, 6)},
        "no query": {"key": torch.randn(5, 2, 8)},
        "bad mask shape": {"query": torch.randn(5, 2, 8), "attn_mask": torch.zeros(4, 5, dtype=torch.bool)},
    }
    for name, inputs in cases.items():
        save_file(inputs, tmp_path / "in.safetensors")
        r = run("mha", "--state", tmp_path / "state.safetensors", "--input", tmp_path / "in.safetensors",
                "--output", out, "--num-heads", 2)
        assert r.returncode == 1, (name, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("heads: error:"), (name, r.stderr)
        assert not out.exists(), name
    # num_heads that does not divide embed_dim
    save_file({"query": torch.randn(5, 2, 8)}, tmp_path / "in.safetensors")
    r = run("mha", "--state", tmp_path / "state.safetensors", "--input", tmp_path / "in.safetensors",
            "--output", out, "--num-heads", 3)
    assert r.returncode == 1 and "not divisible by num_heads 3" in r.stderr
    # a state dict missing a tensor
    sd = {k: v for k, v in ref.state_dict().items() if k != "in_proj_bias"}
    sd.pop("in_proj_weight")
    save_file(sd, tmp_path / "partial.safetensors")
    r = run("mha", "--state", tmp_path / "partial.safetensors", "--input", tmp_path / "in.safetensors",
            "--output", out, "--num-heads", 2)
    assert r.returncode == 1 and "in_proj_weight" in r.stderr and "missing" in r.stderr
    assert not out.exists()
    # usage error
    r = run("mha", "--state", tmp_path / "state.safetensors")
    assert r.returncode == 2


def test_bench_json_contract():
    """`heads bench sdpa|mha|linear --json`: one JSON line with the fields of DESIGN.md (values, not speed)."""
    import json

    shape = ["--batch", 2, "--heads", 3, "--q-len", 70, "--kv-len", 90, "--head-dim", 37, "--min-time", 0]
    r = run("bench", "sdpa", *shape, "--causal", "--threads", 1, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert {k: j[k] for k in ("op", "B", "H", "Hkv", "Lq", "Lk", "D", "causal", "dtype", "threads")} == dict(
        op="sdpa", B=2, H=3, Hkv=3, Lq=70, Lk=90, D=37, causal=True, dtype="f32", threads=1)
    assert j["ms"] > 0 and j["peak_rss_mb"] > 0
    assert abs(j["gflops"] - 4 * 2 * 3 * 70 * 90 * 37 / 2 / j["ms"] / 1e6) <= 1e-2 * j["gflops"] + 1e-2
    assert "backward_ms" not in j

    r = run("bench", "sdpa", *shape, "--backward", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["backward"] is True
    # ms: median forward + backward; backward_call_ms: median of the backward calls inside those
    # same iterations, so never above ms; backward_ms: ms minus a separately timed forward
    assert 0 < j["backward_call_ms"] <= j["ms"] and j["backward_ms"] < j["ms"]
    assert abs(j["gflops"] - 3.5 * 4 * 2 * 3 * 70 * 90 * 37 / j["ms"] / 1e6) <= 1e-2 * j["gflops"] + 1e-2

    # K/V stored apart from the query (a cache): kv_dtype and the bytes of K, V (and int8's scales) per ms
    # (ms is printed to 4 decimals: a cache long enough for a call of well over 0.01 ms)
    for kv, row_bytes in (("bf16", 2 * 37 * 2), ("int8", 2 * 37 + 8)):
        r = run("bench", "sdpa", "--heads", 4, "--kv-heads", 2, "--q-len", 1, "--kv-len", 20000, "--head-dim", 37,
                "--kv-dtype", kv, "--min-time", 0, "--json")
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert (j["dtype"], j["kv_dtype"], j["Hkv"]) == ("f32", kv, 2)
        assert abs(j["kv_gbs"] - 2 * 20000 * row_bytes / j["ms"] / 1e6) <= (1e-2 + 1e-4 / j["ms"]) * j["kv_gbs"] + 1e-2
    r = run("bench", "sdpa", "--kv-dtype", "int8", "--backward", "--min-time", 0)
    assert r.returncode != 0 and "--backward takes K/V of the query's dtype" in r.stderr
    r = run("bench", "sdpa", "--kv-dtype", "int4", "--min-time", 0)
    assert r.returncode != 0 and "--kv-dtype" in r.stderr

    r = run("bench", "mha", "--batch", 1, "--seq", 5, "--embed", 8, "--heads", 2, "--min-time", 0, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["op"] == "mha" and j["ms"] > 0

    # one linear layer: its shape, the GEMM route taken, G(FL)OP/s from the time
    for dtype in ("f32", "bf16", "int8"):
        r = run("bench", "linear", "--rows", 7, "--in", 129, "--out", 33, "--dtype", dtype, "--min-time", 0, "--json")
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        assert (j["op"], j["M"], j["K"], j["N"], j["dtype"]) == ("linear", 7, 129, 33, dtype)
        assert j["route"] in ({"native", "portable"} if dtype == "f32" else {"native", "heads", "f32", "portable"})
        assert abs(j["gflops"] - 2 * 7 * 129 * 33 / j["ms"] / 1e6) <= 2e-2 * j["gflops"] + 1e-2
    if platform.machine() in ("x86_64", "AMD64"):  # heads' own int8 GEMM runs on every x86 path but the portable one
        r = subprocess.run([HEADS, "bench", "linear", "--dtype", "int8", "--rows", "5", "--in", "7", "--out", "3",
                            "--min-time", "0", "--json"], capture_output=True, text=True,
                           env={**os.environ, "HEADS_INT8_GEMM": "heads"})
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["route"] in ("heads", "portable")
    r = run("bench", "linear", "--rows", 0)
    assert r.returncode != 0 and "--rows" in r.stderr

    r = run("bench", "peak", "--threads", 2, "--min-time", 0.2, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["op"] == "peak" and j["threads"] == 2 and j["gflops"] > 0 and j["read_gbs"] > 0
    assert set(j) >= {"isa", "gflops_1", "bf16_gflops", "amx_bf16_gflops", "bf16_attention", "amx"}
    r = run("bench", "peak", "--threads", 1, "--min-time", 0.2)
    assert r.returncode == 0 and "memory read bandwidth: " in r.stdout and "GB/s on 1 threads" in r.stdout


def test_bench_sdpa_grid():
    """Comma-separated sizes time every combination: one JSON line each (last list fastest), or a table."""
    import json

    r = run("bench", "sdpa", "--heads", "1,4", "--q-len", "7,33", "--kv-heads", 1, "--head-dim", 17,
            "--min-time", 0, "--threads", 1, "--json")
    assert r.returncode == 0, r.stderr
    points = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(j["H"], j["Hkv"], j["Lq"], j["Lk"], j["D"]) for j in points] == [
        (1, 1, 7, 7, 17), (1, 1, 33, 33, 17), (4, 1, 7, 7, 17), (4, 1, 33, 33, 17)]
    assert all(j["ms"] > 0 for j in points)

    r = run("bench", "sdpa", "--batch", "2,1", "--q-len", 9, "--kv-len", "5,6", "--min-time", 0)
    assert r.returncode == 0, r.stderr
    table = [line for line in r.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [tuple(int(x) for x in row.split("|")[1:8]) for row in table] == [
        (2, 1, 1, 9, 5, 64, 64), (2, 1, 1, 9, 6, 64, 64), (1, 1, 1, 9, 5, 64, 64), (1, 1, 1, 9, 6, 64, 64)]

    for bad in ("2,0", "1,,3", "4,", ",", "a"):
        r = run("bench", "sdpa", "--heads", bad, "--min-time", 0)
        assert r.returncode != 0 and "expected integers from 1" in r.stderr and f"'{bad}'" in r.stderr, (bad, r.stderr)
    # every point is checked before any is timed: nothing printed for H=4 when H=3 cannot run
    r = run("bench", "sdpa", "--heads", "4,3", "--kv-heads", "2", "--min-time", 0, "--json")
    assert r.returncode != 0 and "--heads 3 is not a multiple of --kv-heads 2" in r.stderr and r.stdout == ""


def test_embed_and_bench_in_reduced_precision(tmp_path):
    """`--dtype bf16|int8` on embed, bench embed and bench mha; a bad value is a usage error (exit 2)."""
    import json

    import numpy as np

    texts = ["The cat sat on the mat.", "Attention is all you need."]
    out = {}
    for dtype in ("f32", "bf16", "int8"):
        r = run("embed", "--dtype", dtype, "--quiet", "--output", tmp_path / f"{dtype}.npy", *texts)
        assert r.returncode == 0, r.stderr
        out[dtype] = np.load(tmp_path / f"{dtype}.npy")
        assert out[dtype].shape == (2, 384) and out[dtype].dtype == np.float32
    for dtype in ("bf16", "int8"):
        cos = (out[dtype].astype(np.float64) * out["f32"]).sum(1)
        assert cos.min() >= 0.999 and not np.array_equal(out[dtype], out["f32"]), (dtype, cos)
    r = run("embed", "--dtype", "fp8", "--output", tmp_path / "x.npy", "hello")
    assert r.returncode == 2 and "--dtype" in r.stderr and not (tmp_path / "x.npy").exists()
    r = run("bench", "mha", "--batch", 1, "--seq", 5, "--embed", 8, "--heads", 2, "--dtype", "int8", "--min-time", 0,
            "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dtype"] == "int8"
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(texts) + "\n")
    r = run("bench", "embed", "--input", lines, "--dtype", "bf16", "--min-time", 0, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dtype"] == "bf16"
