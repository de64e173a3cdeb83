"""Attention as functions: heads.sdpa (torch's scaled_dot_product_attention and its extensions),
linear attention and its recurrent state, ALiBi slopes."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._core import _arg, _heads, _int, _is_torch, _seed


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
    """The modifiers of the native sdpa calls by name (SdpaOptions' fields), or None when none is set."""
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
    return dict(window_left=left, window_right=right, softcap=cap, alibi_slopes=_arg(alibi_slopes, "alibi_slopes"),
                relative_attention_bias=_arg(relative_attention_bias, "relative_attention_bias"),
                relative_attention_max_distance=_int(relative_attention_max_distance, "relative_attention_max_distance",
                                                     1, 2**62),
                relative_attention_bidirectional=bool(relative_attention_bidirectional), sinks=_arg(sinks, "sinks"),
                block_mask=_arg(block_mask, "block_mask"), block_size=_int(block_size, "block_size", 1, 2**62),
                head_mask=_arg(head_mask, "head_mask"))


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
    k_scale: Any = None,
    v_scale: Any = None,
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

    Keys and values may be stored in another dtype than the query, as a KV cache holds them: bfloat16,
    or int8 with ``k_scale`` / ``v_scale`` float32 ``[..., Lk]`` (key j is ``key[..., j, :] * k_scale[...,
    j]``; ``heads.KVCache(..., dtype="int8")`` gives them as ``key_scales(layer)`` / ``value_scales(layer)``).
    Few queries read them in place (forward only).
    """
    mask, causal, lower_right = _causal_bias(attn_mask, is_causal, causal_variant, query, key)
    mods = _mods(window_size, sliding_window, softcap, alibi_slopes, sinks, relative_attention_bias,
                 relative_attention_max_distance, relative_attention_bidirectional, np.shape(query)[-3]
                 if len(np.shape(query)) >= 3 else 1, block_mask, block_size, head_mask)
    if k_scale is not None or v_scale is not None:
        mods = dict(mods or {}, k_scale=_arg(k_scale, "k_scale"), v_scale=_arg(v_scale, "v_scale"))
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
