"""heads study: the command's tables, JSON, plots and errors, on settings small enough for CI."""

import json

from test_cli import run

SMALL = ["--len", "32", "--steps", "30", "--eval-size", "16", "--batch", "8", "--d-model", "16", "--ff", "32"]


def test_mechanisms_table_json_and_plot(tmp_path):
    png = tmp_path / "mech.png"
    r = run("study", "mechanisms", *SMALL, "--mem-lens", "32,64", "--json", "--plot", png)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    runs = [x for x in rows if "token_accuracy" in x]
    mem = [x for x in rows if "token_accuracy" not in x]
    assert [x["mechanism"] for x in runs] == ["basic", "multi-head", "sparse", "linear", "local"]
    assert [x["heads"] for x in runs] == [1, 4, 4, 4, 4]
    for x in runs:
        assert 0.0 <= x["token_accuracy"] <= 1.0 and 0.0 <= x["sequence_accuracy"] <= x["token_accuracy"] + 1e-12
        assert x["train_s"] > 0 and x["infer_samples_per_s"] > 0 and x["peak_mb"] > 0 and x["parameters"] > 0
        assert abs(x["chance"] - 1 / 16) < 1e-12 and x["steps"] == 30
        assert len(x["curve_s"]) == len(x["curve_accuracy"]) >= 2
        assert x["curve_s"] == sorted(x["curve_s"])
    # the parameters of a layer do not depend on the mechanism (same projections), only linear and
    # softmax share them exactly
    assert len({x["parameters"] for x in runs}) == 1
    assert [(x["mechanism"], x["seq_len"]) for x in mem] == [
        (m, L) for m in ["softmax+weights", "multi-head", "sparse", "linear", "local"] for L in (32, 64)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mechanisms_markdown(tmp_path):
    r = run("study", "mechanisms", *SMALL, "--mem-lens", "32", "--markdown")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("copy task, L = 32, 2 layers, d_model 16, 30 steps of batch 8")
    assert lines[1].startswith("| mechanism | heads | complexity | parameters | train s |")
    assert sum(1 for x in lines if x.startswith("| ")) == 1 + 5 + 1 + 5  # two tables with their headers
    assert "| softmax+weights |" in r.stdout


def test_heads_study_svg(tmp_path):
    svg = tmp_path / "heads.svg"
    r = run("study", "heads", *SMALL, "--heads-list", "1,2,4", "--task", "recall", "--plot", svg)
    assert r.returncode == 0, r.stderr
    assert "heads  head dim  parameters" in r.stdout
    assert [line.split()[0] for line in r.stdout.splitlines()[2:5]] == ["1", "2", "4"]
    assert svg.read_text().lstrip().startswith("<?xml")


def test_bad_arguments_are_clear():
    r = run("study", "mechanisms", "--task", "sort", "--len", "32", "--steps", "1")
    assert r.returncode != 0 and 'task must be "copy" or "recall", got "sort"' in r.stderr
    r = run("study", "heads", "--heads-list", "3", "--d-model", "16", "--len", "32", "--steps", "1")
    assert r.returncode != 0 and "--d-model 16 is not divisible by 3 heads" in r.stderr
    r = run("study", "mechanisms", "--len", "8")
    assert r.returncode != 0 and "--len" in r.stderr
    r = run("study", "heads", *SMALL, "--plot", "/tmp/x.jpg")
    assert r.returncode != 0 and "output must end in .png or .svg" in r.stderr
    r = run("study")
    assert r.returncode != 0
