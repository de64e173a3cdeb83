"""Shared helpers for the PyTorch cross-checks: error measure and a summary of the worst case."""

import numpy as np
import pytest
import torch

_worst = {}


def rel_err(out, ref, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor) in float64 (DESIGN.md's measure); 0 when both are zero.

    ``floor`` is for references that are zero in exact arithmetic (e.g. the query gradient when a
    row sees a single key), where both sides hold only rounding noise."""
    a = np.asarray(out.detach() if isinstance(out, torch.Tensor) else out, dtype=np.float64)
    b = np.asarray(ref.detach() if isinstance(ref, torch.Tensor) else ref, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != reference {b.shape}"
    assert np.isfinite(a).all(), "non-finite values in output"
    den = max(np.linalg.norm(b), floor)
    num = np.linalg.norm(a - b)
    return float(num / den) if den > 0 else float(num)


def record(kind: str, err: float, what: str) -> None:
    if err >= _worst.get(kind, (-1.0, ""))[0]:
        _worst[kind] = (err, what)


@pytest.fixture
def check():
    """check(kind, out, ref, what, tol=1e-5, floor=0): assert and record the relative error."""

    def _check(kind, out, ref, what, tol=1e-5, floor=0.0):
        err = rel_err(out, ref, floor)
        record(kind, err, what)
        assert err <= tol, f"{kind}: relative error {err:.3g} > {tol:g} for {what}"
        return err

    return _check


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its worst cases to the controller (pytest_testnodedown)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["heads_worst"] = dict(_worst)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for kind, (err, what) in getattr(node, "workeroutput", {}).get("heads_worst", {}).items():
        record(kind, err, what)


def pytest_terminal_summary(terminalreporter):
    if not _worst:
        return
    terminalreporter.write_sep("-", "largest relative error against PyTorch 2.13")
    for kind, (err, what) in sorted(_worst.items()):
        terminalreporter.write_line(f"{kind:28s} {err:.3e}   ({what})")
