"""`heads train-demo`: the causal transformer trained in C++ reaches its accuracy target within a
bounded number of steps, its logged loss falls, and a run is reproducible for a seed."""

import re

import numpy as np
import pytest
from safetensors.numpy import load_file

from test_cli import run

LINE = re.compile(r"step\s+(\d+)\s+loss ([\d.]+)\s+token accuracy ([\d.]+)\s+sequence accuracy ([\d.]+)")


def log_of(stdout):
    return [(int(s), float(l), float(t), float(q)) for s, l, t, q in LINE.findall(stdout)]


@pytest.mark.parametrize("task,steps,seed", [("reverse", 400, 0), ("sort", 1500, 1)])
def test_reaches_target_with_falling_loss(task, steps, seed, tmp_path):
    out = tmp_path / "model.safetensors"
    r = run("train-demo", "--task", task, "--steps", steps, "--seed", seed, "--save", out)
    assert r.returncode == 0, r.stdout + r.stderr
    log = log_of(r.stdout)
    assert len(log) >= 2, r.stdout
    assert re.search(r"reached sequence accuracy (0\.99\d|1\.000)", r.stdout), r.stdout
    assert log[-1][3] >= 0.99
    first_loss, last_loss = log[0][1], log[-1][1]
    assert last_loss < first_loss / 2, f"loss did not fall: {first_loss} -> {last_loss}"
    # The weights were written under their names and are finite.
    w = load_file(str(out))
    assert "encoder.layers.1.self_attn.in_proj_weight" in w and "head.weight" in w
    assert all(np.isfinite(v).all() for v in w.values())


def test_same_seed_same_run():
    a = run("train-demo", "--steps", 50, "--seed", 4, "--threads", 2)
    b = run("train-demo", "--steps", 50, "--seed", 4, "--threads", 2)
    assert log_of(a.stdout) == log_of(b.stdout) and log_of(a.stdout)


def test_running_out_of_steps_fails_clearly():
    r = run("train-demo", "--steps", 10, "--eval-every", 5)
    assert r.returncode == 1
    assert "sequence accuracy stayed below 0.99 after 10 steps" in r.stderr
    r = run("train-demo", "--task", "copy")
    assert r.returncode == 1 and "--task must be reverse or sort" in r.stderr
