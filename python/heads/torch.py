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


# ---------------------------------------------------------------------------------------------
# Dynamic quantization, module by module, as torch.ao.quantization.quantize_dynamic does it.

_QUANT_DTYPES = {"qint8": "int8", "int8": "int8", "bfloat16": "bf16", "bf16": "bf16", "float16": "bf16",
                 "float32": "f32", "f32": "f32"}


def _quant_dtype(dtype):
    key = str(dtype).replace("torch.", "")
    if key not in _QUANT_DTYPES:
        raise ValueError(f"dtype: expected torch.qint8 or torch.bfloat16 (torch.float16 runs as bfloat16), "
                         f"got {dtype!r}")
    return _QUANT_DTYPES[key]


def _no_grad_inputs(name, *tensors):
    if _torch.is_grad_enabled() and any(isinstance(t, _torch.Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(f"{name}: a quantized module is for inference and has no backward; run it under "
                           "torch.no_grad() or on inputs that do not require grad")


class _NativeState(_torch.nn.Module):
    """A quantized module around a native heads module: state_dict / load_state_dict as the native
    module's ``quantized_state_dict()`` (int8 weights with their ``_scale``), so torch.save works."""

    def __init__(self, native):
        super().__init__()
        self._native = native

    @classmethod
    def _made(cls, native, float_module, dtype):
        """The native module with ``float_module``'s weights, for inference in ``dtype``."""
        native.load_state_dict({k: v.detach() for k, v in float_module.state_dict().items()})
        native.eval()
        native.to(_quant_dtype(dtype))
        return cls(native)

    @property
    def dtype(self):
        return self._native.dtype

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, value in self._native.quantized_state_dict().items():
            destination[prefix + name] = _torch.from_numpy(value.copy())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        try:
            self._native.load_state_dict(own, strict)
        except ValueError as e:
            error_msgs.append(str(e))


class QuantizedLinear(_torch.nn.Module):
    """``nn.Linear`` for inference in int8 (heads' dynamic quantization: weights per output channel,
    activations per row in two int8 terms, integer products) or bf16 (f32 sums), as
    ``torch.ao.nn.quantized.dynamic.Linear`` is for torch's. Made by :func:`quantize_dynamic` or
    ``QuantizedLinear.from_float(linear, dtype)``; input of any float dtype, output float32.
    ``state_dict()``: ``weight`` (int8, bf16 or float32), and for int8 ``weight_scale`` with, when
    some rows have the second term (docs/numerics.md), ``weight_residual``, ``weight_residual_scale``
    and ``weight_residual_rows``; ``bias``."""

    def __init__(self, packed, bias):
        super().__init__()
        self._packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.register_buffer("bias_", None if bias is None else bias.detach().to(_torch.float32).clone())

    @classmethod
    def from_float(cls, mod, dtype=_torch.qint8):
        if not isinstance(mod, _torch.nn.Linear):
            raise ValueError(f"QuantizedLinear.from_float: expected an nn.Linear, got {type(mod).__name__}")
        w = mod.weight.detach().to(_torch.float32).contiguous()
        return cls(_heads.PackedLinear(w, _quant_dtype(dtype)), mod.bias)

    @property
    def dtype(self):
        return self._packed.dtype

    def weight(self):
        """The weight as float32 (int8 · scale, or the bf16 values)."""
        return _torch.from_numpy(self._packed.dequantize())

    def forward(self, x):
        _no_grad_inputs("QuantizedLinear", x)
        return self._packed(x.detach(), self.bias_, torch_out=True)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._packed.dtype == "int8":
            for name, value in self._packed.tensors("weight").items():
                destination[prefix + name] = _torch.from_numpy(value.copy())
        else:  # bf16 as bf16, f32 as f32 (dequantize widens exactly)
            w = _torch.from_numpy(self._packed.dequantize())
            destination[prefix + "weight"] = w.to(_torch.bfloat16) if self._packed.dtype == "bf16" else w
        if self.bias_ is not None:
            destination[prefix + "bias"] = self.bias_.clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w, b = state_dict.get(prefix + "weight"), state_dict.get(prefix + "bias")
        if self.bias_ is not None and b is None:
            missing_keys.append(prefix + "bias")
        if w is None:
            missing_keys.append(prefix + "weight")
            return
        try:
            if w.dtype == _torch.int8:
                parts = [(k[len(prefix):], v.contiguous()) for k, v in state_dict.items()
                         if k.startswith(prefix + "weight")]
                packed = _heads.PackedLinear.from_tensors("weight", parts)
            else:
                packed = _heads.PackedLinear(w.to(_torch.float32).contiguous(), self._packed.dtype)
            if (packed.out_features, packed.in_features) != (self.out_features, self.in_features):
                raise ValueError(f"{prefix}weight: expected [{self.out_features}, {self.in_features}], got "
                                 f"[{packed.out_features}, {packed.in_features}]")
            if b is not None and (b.dim() != 1 or b.shape[0] != self.out_features):
                raise ValueError(f"{prefix}bias: expected [{self.out_features}], got {list(b.shape)}")
        except ValueError as e:
            error_msgs.append(str(e))
            return
        self._packed = packed
        if b is not None:
            self.bias_ = b.detach().to(_torch.float32).clone()

    def __getstate__(self):
        state = dict(self.__dict__)
        p = state.pop("_packed")
        # int8: its stored tensors; bf16 travels widened to f32 (exact) and packs back to itself.
        parts = {k: v.copy() for k, v in p.tensors("weight").items()} if p.dtype == "int8" else p.dequantize()
        state["_packed_parts"] = (p.dtype, parts)
        return state

    def __setstate__(self, state):
        dtype, parts = state.pop("_packed_parts")
        self.__dict__.update(state)
        if dtype == "int8":
            self._packed = _heads.PackedLinear.from_tensors("weight", list(parts.items()))
        else:
            self._packed = _heads.PackedLinear(parts, dtype)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}"


class QuantizedMultiheadAttention(_NativeState):
    """``nn.MultiheadAttention`` (or :class:`MultiheadAttention`) for inference with its projections
    in int8 or bf16 (heads.MultiheadAttention with ``.to(dtype)``; the weights quantized once). Same
    call and results' layout; made by :func:`quantize_dynamic` or ``from_float(mha, dtype)``."""

    def __init__(self, native):
        super().__init__(native)
        self.embed_dim, self.num_heads, self.batch_first = native.embed_dim, native.num_heads, native.batch_first

    @classmethod
    def from_float(cls, mod, dtype=_torch.qint8):
        from . import MultiheadAttention as _Native

        if isinstance(mod, MultiheadAttention):
            import copy

            native = copy.deepcopy(mod._native)  # its options (variant, pruned heads); weights below
        elif isinstance(mod, _torch.nn.MultiheadAttention):
            native = _Native(mod.embed_dim, mod.num_heads, dropout=mod.dropout, bias=mod.in_proj_bias is not None,
                             add_bias_kv=mod.bias_k is not None, add_zero_attn=mod.add_zero_attn,
                             kdim=None if mod._qkv_same_embed_dim else mod.kdim,
                             vdim=None if mod._qkv_same_embed_dim else mod.vdim, batch_first=mod.batch_first)
        else:
            raise ValueError(f"QuantizedMultiheadAttention.from_float: expected an nn.MultiheadAttention, got "
                             f"{type(mod).__name__}")
        return cls._made(native, mod, dtype)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        _no_grad_inputs("QuantizedMultiheadAttention", query, key, value)
        q = query.detach()
        k = q if key is query else key.detach()
        v = k if value is key else value.detach()
        out, weights = self._native(q, k, v, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                    attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                    is_causal=is_causal)
        return out, (weights if need_weights else None)

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dtype={self.dtype}"


_ACTIVATIONS = {"relu": "relu", "gelu": "gelu"}


def _activation_name(act):
    if isinstance(act, str):
        return act
    if isinstance(act, _torch.nn.ReLU):
        return "relu"
    if isinstance(act, _torch.nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    name = getattr(act, "__name__", None)
    return _ACTIVATIONS.get(name)


class QuantizedTransformerEncoderLayer(_NativeState):
    """``nn.TransformerEncoderLayer`` for inference with its projections and feed-forward in int8 or
    bf16 (heads.TransformerEncoderLayer with ``.to(dtype)``); same call. Made by
    :func:`quantize_dynamic` or ``from_float(layer, dtype)`` (activation relu or gelu)."""

    @classmethod
    def supports(cls, mod):
        return isinstance(mod, _torch.nn.TransformerEncoderLayer) and _activation_name(mod.activation) is not None

    @classmethod
    def from_float(cls, mod, dtype=_torch.qint8):
        from . import TransformerEncoderLayer as _Native

        if not cls.supports(mod):
            raise ValueError("QuantizedTransformerEncoderLayer.from_float: expected an nn.TransformerEncoderLayer "
                             f"with relu or gelu, got {type(mod).__name__}")
        native = _Native(mod.linear1.in_features, mod.self_attn.num_heads, mod.linear1.out_features,
                         dropout=mod.dropout.p, activation=_activation_name(mod.activation),
                         layer_norm_eps=mod.norm1.eps, batch_first=mod.self_attn.batch_first,
                         norm_first=mod.norm_first, bias=mod.linear1.bias is not None)
        return cls._made(native, mod, dtype)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        _no_grad_inputs("QuantizedTransformerEncoderLayer", src)
        return self._native(src.detach(), src_mask, src_key_padding_mask, is_causal)


class QuantizedTransformerEncoder(_NativeState):
    """``nn.TransformerEncoder`` (supported layers, final norm absent or LayerNorm with the layers'
    eps) for inference in int8 or bf16 (heads.TransformerEncoder with ``.to(dtype)``); same call."""

    @classmethod
    def supports(cls, mod):
        if not isinstance(mod, _torch.nn.TransformerEncoder) or len(mod.layers) == 0:
            return False
        first = mod.layers[0]
        norm = mod.norm
        return (all(QuantizedTransformerEncoderLayer.supports(layer) for layer in mod.layers)
                and (norm is None or (type(norm) is _torch.nn.LayerNorm and norm.eps == first.norm1.eps
                                      and norm.weight is not None and norm.bias is not None)))

    @classmethod
    def from_float(cls, mod, dtype=_torch.qint8):
        from . import TransformerEncoder as _Encoder

        if not cls.supports(mod):
            raise ValueError("QuantizedTransformerEncoder.from_float: expected an nn.TransformerEncoder of relu/gelu "
                             "layers with no final norm or a LayerNorm of the layers' eps")
        layer = QuantizedTransformerEncoderLayer.from_float(mod.layers[0], _torch.float32)._native
        native = _Encoder(layer, len(mod.layers), norm=mod.norm is not None)
        return cls._made(native, mod, dtype)

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        _no_grad_inputs("QuantizedTransformerEncoder", src)
        return self._native(src.detach(), mask, src_key_padding_mask, bool(is_causal))


def quantize_dynamic(model, qconfig_spec=None, dtype=_torch.qint8, inplace=False):
    """``torch.ao.quantization.quantize_dynamic`` with heads' kernels: returns ``model`` (a copy
    unless ``inplace``) with, module by module, ``nn.TransformerEncoderLayer`` →
    :class:`QuantizedTransformerEncoderLayer` (``nn.TransformerEncoder`` whole, as
    :class:`QuantizedTransformerEncoder`, when its layers are), ``nn.MultiheadAttention`` and
    :class:`MultiheadAttention` → :class:`QuantizedMultiheadAttention`, ``nn.Linear`` →
    :class:`QuantizedLinear`. ``qconfig_spec``: a set of those types (or of submodule names) to
    replace; default all of them. ``dtype``: ``torch.qint8`` (per-channel int8 weights, per-row int8
    activations in two terms: far closer to float than torch's per-tensor qint8),
    ``torch.bfloat16`` (``torch.float16`` runs as bfloat16), or ``torch.float32`` (heads' f32 kernels).
    An ``nn.TransformerEncoderLayer`` that is not converted keeps its attention and linear layers as
    they are, even when named (torch's own fast path reads their weights as tensors). Attention, LayerNorm and softmax stay float32 in int8. Inference only."""
    import copy

    target = _quant_dtype(dtype)
    if qconfig_spec is None:
        qconfig_spec = {_torch.nn.TransformerEncoderLayer, _torch.nn.MultiheadAttention, MultiheadAttention,
                        _torch.nn.Linear}
    spec = set(qconfig_spec.keys() if isinstance(qconfig_spec, dict) else qconfig_spec)
    names = {s for s in spec if isinstance(s, str)}
    types = tuple(s for s in spec if isinstance(s, type))
    if not inplace:
        model = copy.deepcopy(model)

    def convert(mod, qualified, in_layer=False):
        if isinstance(mod, _torch.nn.TransformerEncoder):
            # Whole, as its forward reads its first layer's attention weights; else left as it is.
            wanted = qualified in names or _torch.nn.TransformerEncoderLayer in types
            return QuantizedTransformerEncoder.from_float(mod, target) if wanted and \
                QuantizedTransformerEncoder.supports(mod) else mod
        if isinstance(mod, _torch.nn.TransformerEncoderLayer) and QuantizedTransformerEncoderLayer.supports(mod):
            if qualified in names or _torch.nn.TransformerEncoderLayer in types:
                return QuantizedTransformerEncoderLayer.from_float(mod, target)
        if isinstance(mod, (_torch.nn.MultiheadAttention, MultiheadAttention)):
            if in_layer:  # an nn.TransformerEncoderLayer left as it is reads its weights itself (fast path)
                return mod
            if qualified in names or any(isinstance(mod, t) for t in types
                                         if t in (_torch.nn.MultiheadAttention, MultiheadAttention)):
                return QuantizedMultiheadAttention.from_float(mod, target)
            return mod  # its out_proj is part of it, as torch leaves it
        if type(mod) is _torch.nn.Linear and (qualified in names or _torch.nn.Linear in types):
            if in_layer:  # likewise its feed-forward weights
                return mod
            return QuantizedLinear.from_float(mod, target)
        layer = isinstance(mod, _torch.nn.TransformerEncoderLayer)
        for child_name, child in list(mod.named_children()):
            new = convert(child, f"{qualified}.{child_name}" if qualified else child_name, layer)
            if new is not child:
                setattr(mod, child_name, new)
        return mod

    return convert(model, "")
