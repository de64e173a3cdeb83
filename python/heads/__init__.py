"""heads: multi-head attention for CPUs.

Names and defaults mirror PyTorch (``torch.nn.functional.scaled_dot_product_attention``,
``torch.nn.MultiheadAttention``). Inputs are numpy arrays or torch tensors (CPU); results come
back as the kind of the query. Bad input raises ``ValueError`` naming the argument and shapes.
All computation happens in the C++ core; this file only converts arrays.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from . import _heads

__all__ = [
    "sdpa",
    "MultiheadAttention",
    "manual_seed",
    "set_num_threads",
    "get_num_threads",
]

__version__ = "0.1.0"

manual_seed = _heads.manual_seed
set_num_threads = _heads.set_num_threads
get_num_threads = _heads.get_num_threads


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _arg(x: Any, name: str) -> Any:
    """An object the native layer takes through DLPack (no copy where the layout allows)."""
    if x is None:
        return None
    if _is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got device {x.device}")
        return x.detach()
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(x)


def sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    need_weights: bool = False,
    seed: Optional[int] = None,
):
    """Scaled dot-product attention, as ``torch.nn.functional.scaled_dot_product_attention``.

    query ``[..., Lq, D]``, key ``[..., Lk, D]``, value ``[..., Lk, Dv]`` with up to two leading
    dims (``[B, H, L, D]``), float32, or bfloat16 torch tensors (f32 accumulation); ``attn_mask`` bool (True = may attend) or float (added), broadcast to
    ``[..., Lq, Lk]``. Rows that can attend to nothing give zeros (torch gives NaN).
    Extensions: ``need_weights=True`` returns ``(out, weights)``; ``seed`` fixes the dropout mask
    (default: the generator set by ``heads.manual_seed``).
    """
    r = _heads.sdpa(
        _arg(query, "query"),
        _arg(key, "key"),
        _arg(value, "value"),
        _arg(attn_mask, "attn_mask"),
        float(dropout_p),
        bool(is_causal),
        None if scale is None else float(scale),
        bool(enable_gqa),
        bool(need_weights),
        seed,
        _is_torch(query),
    )
    return tuple(r) if need_weights else r


class MultiheadAttention:
    """``torch.nn.MultiheadAttention`` in heads: same constructor, state-dict names and call.

    ``seed`` (an extension) fixes the initial parameters; they are drawn as torch draws them
    (Xavier-uniform in-projection, zero biases), not bit-identical to torch's generator.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        *,
        seed: Optional[int] = None,
    ) -> None:
        self._m = _heads.MultiheadAttention(
            int(embed_dim),
            int(num_heads),
            float(dropout),
            bool(bias),
            bool(add_bias_kv),
            bool(add_zero_attn),
            None if kdim is None else int(kdim),
            None if vdim is None else int(vdim),
            bool(batch_first),
            seed,
        )

    embed_dim = property(lambda self: self._m.embed_dim)
    num_heads = property(lambda self: self._m.num_heads)
    kdim = property(lambda self: self._m.kdim)
    vdim = property(lambda self: self._m.vdim)
    dropout = property(lambda self: self._m.dropout)
    batch_first = property(lambda self: self._m.batch_first)
    training = property(lambda self: self._m.training)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def train(self, mode: bool = True) -> "MultiheadAttention":
        self._m._set_training(bool(mode))
        return self

    def eval(self) -> "MultiheadAttention":
        return self.train(False)

    def state_dict(self) -> dict:
        """Parameters by PyTorch's names as numpy arrays sharing the module's memory."""
        return self._m.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        items = [(str(k), _arg(v, k)) for k, v in state_dict.items()]
        self._m.load_state_dict(items, strict)

    def load(self, path: str, strict: bool = True) -> None:
        """Load parameters from a safetensors file (PyTorch's names)."""
        self._m.load(str(path), strict)

    def save(self, path: str) -> None:
        """Save parameters to a safetensors file (PyTorch's names)."""
        self._m.save(str(path))

    def forward(
        self,
        query: Any,
        key: Any,
        value: Any,
        key_padding_mask: Any = None,
        need_weights: bool = True,
        attn_mask: Any = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        """Returns ``(attn_output, attn_weights or None)`` as torch.nn.MultiheadAttention."""
        q = _arg(query, "query")
        # Passing the same object three times keeps self-attention's single fused projection.
        k = q if key is query else _arg(key, "key")
        v = k if value is key else _arg(value, "value")
        out, weights = self._m.forward(
            q,
            k,
            v,
            _arg(key_padding_mask, "key_padding_mask"),
            bool(need_weights),
            _arg(attn_mask, "attn_mask"),
            bool(average_attn_weights),
            bool(is_causal),
            _is_torch(query),
        )
        return out, weights

    __call__ = forward

    def __repr__(self) -> str:
        return (
            f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first})"
        )
