"""heads attention inside PyTorch training: torch.autograd.Functions whose forward and backward
both run in heads (C++), so a PyTorch model can swap them in for F.scaled_dot_product_attention and
nn.MultiheadAttention.

    from heads.torch import scaled_dot_product_attention as sdpa
    out = sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    out.sum().backward()          # q.grad, k.grad, v.grad (and a float attn_mask's grad)

    from heads.torch import MultiheadAttention      # an nn.Module with nn.MultiheadAttention's
    mha = MultiheadAttention(512, 8, batch_first=True)   # parameters, names and call
    out, _ = mha(x, x, x, need_weights=False)
    out.sum().backward()          # x.grad and every parameter's .grad; any torch optimizer

float32 CPU tensors (float16 / float64 are computed in float32 and returned in their dtype). Dropout
draws its mask in heads (seeded by heads.manual_seed); the backward reuses exactly the forward's
mask. Rows that can attend to nothing give zeros and zero gradients. ``attn_mask`` may be torch's
``CausalBias`` (``causal_upper_left`` / ``causal_lower_right``).
"""

import torch as _torch
from torch.autograd.function import once_differentiable as _once_differentiable

from . import _arg, _causal_bias, _heads, _mods

__all__ = ["scaled_dot_product_attention", "SDPAFunction", "MultiheadAttention", "linear_attention",
           "LinearAttentionFunction", "quantize_dynamic", "QuantizedLinear", "QuantizedMultiheadAttention",
           "QuantizedTransformerEncoderLayer", "QuantizedTransformerEncoder"]


class SDPAFunction(_torch.autograd.Function):
    # forward's inputs after ctx, in order: backward returns a gradient (or None) for each
    INPUTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "lower_right",
              "mods", "sinks", "relative_attention_bias")

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, lower_right=False,
                mods=None, sinks=None, relative_attention_bias=None):
        # mods: heads' modifiers by name (heads.functional._mods); sinks and the relative bias table come
        # as tensors of their own (they have gradients) and replace the entries of those names.
        full = None if mods is None else dict(mods, sinks=_arg(sinks, "sinks"),
                                              relative_attention_bias=_arg(relative_attention_bias,
                                                                           "relative_attention_bias"))
        out, lse, seed = _heads.sdpa_train_forward(
            _arg(query, "query", True), _arg(key, "key", True), _arg(value, "value", True),
            _arg(attn_mask, "attn_mask"), float(dropout_p), bool(is_causal), scale, bool(enable_gqa),
            bool(lower_right), full)
        out = out.reshape(query.shape[:-1] + (value.shape[-1],))
        ctx.save_for_backward(query, key, value, out, lse, attn_mask if attn_mask is not None else _torch.empty(0))
        ctx.args = (seed, attn_mask is not None, float(dropout_p), bool(is_causal), scale, bool(enable_gqa),
                    bool(lower_right), full, sinks is not None, relative_attention_bias is not None)
        return out

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout):
        query, key, value, out, lse, mask = ctx.saved_tensors
        seed, has_mask, dropout_p, is_causal, scale, enable_gqa, lower_right, full, has_sinks, has_table = ctx.args
        mask = mask if has_mask else None
        wants = dict(zip(SDPAFunction.INPUTS, ctx.needs_input_grad))
        mask_grad = bool(has_mask and mask.is_floating_point() and wants["attn_mask"])
        dq, dk, dv, dm, dsinks, dtable = _heads.sdpa_train_backward(
            dout.contiguous(), query.detach(), key.detach(), value.detach(), out, lse, seed,
            None if mask is None else mask.detach(), dropout_p, is_causal, scale, enable_gqa, mask_grad,
            lower_right, full)
        grads = dict(query=dq.reshape(query.shape), key=dk.reshape(key.shape), value=dv.reshape(value.shape),
                     attn_mask=dm if mask_grad else None, sinks=dsinks if has_sinks and wants["sinks"] else None,
                     relative_attention_bias=dtable if has_table and wants["relative_attention_bias"] else None)
        return tuple(grads.get(name) for name in SDPAFunction.INPUTS)


class LinearAttentionFunction(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, feature_map, causal, eps, key_padding_mask=None):
        if _torch.is_tensor(key_padding_mask):  # the backward must see the mask of the forward
            key_padding_mask = key_padding_mask.detach().clone()
        mask = _arg(key_padding_mask, "key_padding_mask")
        out = _heads.linear_attention(_arg(query, "query", True), _arg(key, "key", True), _arg(value, "value", True),
                                      feature_map, bool(causal), float(eps), True, mask)
        ctx.save_for_backward(query, key, value)
        ctx.args = (feature_map, bool(causal), float(eps), mask)
        return out.reshape(query.shape[:-1] + (value.shape[-1],))

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout):
        query, key, value = ctx.saved_tensors
        dq, dk, dv = _heads.linear_attention_backward(dout.contiguous(), query.detach(), key.detach(), value.detach(),
                                                      *ctx.args)
        return dq.reshape(query.shape), dk.reshape(key.shape), dv.reshape(value.shape), None, None, None, None


def linear_attention(query, key, value, feature_map="elu", causal=False, eps=1e-6, key_padding_mask=None):
    """heads.linear_attention as a torch.autograd.Function: forward and backward in heads."""
    return LinearAttentionFunction.apply(query, key, value, feature_map, causal, eps, key_padding_mask)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, causal_variant="upper_left", window_size=None,
                                 sliding_window=None, softcap=None, alibi_slopes=None, sinks=None,
                                 relative_attention_bias=None, relative_attention_max_distance=128,
                                 relative_attention_bidirectional=True, block_mask=None, block_size=128,
                                 head_mask=None):
    """As torch.nn.functional.scaled_dot_product_attention, computed by heads (forward and backward).

    The keyword-only modifiers are those of ``heads.sdpa``; ``sinks`` and ``relative_attention_bias``
    receive gradients when they require them.
    """
    mask, causal, lower_right = _causal_bias(attn_mask, is_causal, causal_variant, query, key)
    mods = _mods(window_size, sliding_window, softcap, alibi_slopes, sinks, relative_attention_bias,
                 relative_attention_max_distance, relative_attention_bidirectional,
                 query.shape[-3] if query.dim() >= 3 else 1, block_mask, block_size, head_mask)
    return SDPAFunction.apply(query, key, value, mask, dropout_p, causal, scale, enable_gqa, lower_right, mods,
                              sinks, relative_attention_bias)


class _MhaFunction(_torch.autograd.Function):
    """Forward and backward of a heads.MultiheadAttention whose parameters are `params` (torch
    tensors in state_dict order, copied into the native module for this call)."""

    @staticmethod
    def forward(ctx, native, names, call, query, key, value, *params):
        from . import Tape

        native.load_state_dict({n: p.detach() for n, p in zip(names, params)})
        tape = Tape()
        k = query if key is query else key.detach()
        v = k if value is key else value.detach()
        out, weights = native(query.detach(), k, v, **call, tape=tape)
        ctx.native, ctx.tape, ctx.names = native, tape, names
        ctx.shapes = (query.shape, key.shape, value.shape)
        if weights is None:
            weights = _torch.empty(0)
        ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    def backward(ctx, dout, _dweights):
        if ctx.tape is None:  # freed by the first backward (the tape holds every activation)
            raise RuntimeError("heads.torch.MultiheadAttention: backward through the same forward a second time "
                               "(retain_graph=True) is not supported: the saved activations were freed after the "
                               "first backward; run the forward again")
        (dq, dk, dv), grads = ctx.native.backward(ctx.tape, dout.contiguous())
        ctx.tape = None
        return (None, None, None, dq, dk, dv, *[grads[n] for n in ctx.names])


class MultiheadAttention(_torch.nn.Module):
    """``torch.nn.MultiheadAttention`` with its forward and backward computed by heads.

    Same constructor, parameter names and shapes (``in_proj_weight`` or ``q/k/v_proj_weight``,
    ``in_proj_bias``, ``bias_k``, ``bias_v``, ``out_proj.weight``, ``out_proj.bias``), so state dicts
    load both ways and any torch optimizer trains it. Gradients flow from ``attn_output`` (the
    returned weights are constants). Dropout masks come from heads' generator (``heads.manual_seed``).
    The keyword-only attention variants are heads.MultiheadAttention's (linear, local window,
    block-sparse, head gates with ``head_gate.weight`` / ``head_gate.bias`` parameters).
    ``device`` and ``dtype`` are torch's factory arguments: the parameters are float32 on the CPU (a
    trainable module); for bf16 or int8 inference, ``quantize_dynamic(module, dtype=...)`` makes the
    quantized module, as torch.ao.quantization.quantize_dynamic does.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, attention="softmax",
                 feature_map="elu", window=None, sparse_block=None, sparse_stride=4, head_gate=None,
                 gate_threshold=0.0):
        super().__init__()
        from . import MultiheadAttention as _Native

        if device is not None and _torch.device(device).type != "cpu":
            raise ValueError(f"MultiheadAttention: device: heads computes on the CPU, got {device!r}")
        if dtype is not None and dtype != _torch.float32:
            raise ValueError(f"MultiheadAttention: dtype: the parameters of this trainable module are torch.float32, "
                             f"got {dtype!r}; for {dtype} inference, heads.torch.quantize_dynamic(module, dtype=...) "
                             f"quantizes it (torch.qint8 or torch.bfloat16), as torch's quantize_dynamic does")

        self._native = _Native(embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
                               add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
                               attention=attention, feature_map=feature_map, window=window, sparse_block=sparse_block,
                               sparse_stride=sparse_stride, head_gate=head_gate, gate_threshold=gate_threshold)
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
        self._names = list(self._native.state_dict())
        # The initial parameters come from torch's generator, drawn exactly as nn.MultiheadAttention
        # draws them (so torch.manual_seed makes them reproducible, in every process of a DDP job).
        init = _torch.nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, bias=bias,
                                            add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim,
                                            vdim=vdim, batch_first=batch_first).state_dict()
        if head_gate is not None:  # the gates are an nn.Linear(embed_dim, num_heads)
            gate = _torch.nn.Linear(embed_dim, num_heads)
            init["head_gate.weight"], init["head_gate.bias"] = gate.weight, gate.bias
        self.head_gate = _torch.nn.Module() if head_gate is not None else None
        self.out_proj = _torch.nn.Module()
        for name in self._names:
            prefix, _, rest = name.partition(".")
            owner, attr = (getattr(self, prefix), rest) if rest else (self, name)
            owner.register_parameter(attr, _torch.nn.Parameter(init[name].detach().clone()))

    def _params(self):
        return [self.get_parameter(n) for n in self._names]

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        self._native.train(self.training)
        call = dict(key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                    average_attn_weights=average_attn_weights, is_causal=is_causal)
        params = self._params()
        if not _torch.is_grad_enabled() or not any(t.requires_grad for t in (query, key, value, *params)):
            # Inference: no tape, so the module runs as heads.MultiheadAttention does (gated-off heads skipped).
            self._native.load_state_dict({n: p.detach() for n, p in zip(self._names, params)})
            q = query.detach()
            k = q if key is query else key.detach()
            v = k if value is key else value.detach()
            out, weights = self._native(q, k, v, **call)
            return out, (weights if need_weights else None)
        out, weights = _MhaFunction.apply(self._native, self._names, call, query, key, value, *params)
        return out, (weights if need_weights else None)


# Dynamic quantization (torch_quant.py), re-exported here.
from .torch_quant import (QuantizedLinear, QuantizedMultiheadAttention, QuantizedTransformerEncoder,  # noqa: E402
                          QuantizedTransformerEncoderLayer, quantize_dynamic)
