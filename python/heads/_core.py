"""The native extension and the argument checks every part of the module shares (heads/__init__.py
re-exports the public names)."""

from __future__ import annotations

from typing import Any, Optional

import operator
import os
import sys

import numpy as np


def _load_native():
    """Imports the extension. OpenMP (libgomp) reads its settings once, when it loads with the
    extension; unless the user chose a wait policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT), idle workers
    spin for about 1,000 iterations (tens of microseconds) instead of libgomp's default 300,000
    (milliseconds), which on a busy machine starve the threads that have work. The variable is set
    for the load only (a later library, e.g. torch's own OpenMP, sees the environment as it was)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        from . import _heads
        return _heads
    os.environ["GOMP_SPINCOUNT"] = "1000"  # as the heads CLI (tools/cli/main.cc)
    try:
        from . import _heads
    finally:
        del os.environ["GOMP_SPINCOUNT"]
    return _heads


_heads = _load_native()


def _int(x: Any, name: str, lo: int, hi: int) -> int:
    """An integer argument in [lo, hi] (bool and non-integral numbers rejected), as ValueError."""
    try:
        if isinstance(x, bool):
            raise TypeError
        v = operator.index(x)
    except TypeError:
        raise ValueError(f"{name}: expected an integer, got {type(x).__name__} {x!r}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected an integer in [{lo}, {hi}], got {v}")
    return v


def _seed(seed: Any, name: str = "seed") -> Optional[int]:
    return None if seed is None else _int(seed, name, 0, 2**64 - 1)


def _is_torch(x: Any) -> bool:
    """A torch tensor (subclasses included), without importing torch when nobody has."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _arg(x: Any, name: str, required: bool = False) -> Any:
    """An object the native layer takes through DLPack (no copy where the layout allows): a CPU
    torch tensor (not a subclass it cannot read) or anything numpy reads as a numeric array."""
    if x is None:
        if required:
            raise ValueError(f"{name}: expected an array or tensor, got None")
        return None
    if _is_torch(x):
        import torch

        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(f"{name}: tensor subclass {type(x).__name__} is not supported; pass a plain tensor")
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got device {x.device}")
        return x.detach()
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype.kind not in "biuf":
        raise ValueError(f"{name}: expected a numeric array or tensor, got {type(x).__name__} of dtype {a.dtype}")
    return a


_PRECISIONS = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "int8": "int8", "qint8": "int8"}


def _precision(dtype: Any, name: str = "dtype") -> str:
    """"f32" | "bf16" | "int8" from those names, their long forms or a torch / numpy dtype."""
    key = str(dtype).replace("torch.", "")
    if key not in _PRECISIONS:
        raise ValueError(f"{name}: expected f32, bf16 or int8 (or torch.float32 / torch.bfloat16 / torch.qint8), "
                         f"got {dtype!r}")
    return _PRECISIONS[key]
