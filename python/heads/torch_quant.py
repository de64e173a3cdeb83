"""heads.torch's dynamic quantization, module by module, as torch.ao.quantization.quantize_dynamic does
it: QuantizedLinear, QuantizedMultiheadAttention, QuantizedTransformerEncoderLayer / Encoder and
quantize_dynamic (all re-exported by heads.torch)."""

import torch as _torch

from . import _heads

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
        from .torch import MultiheadAttention  # (heads.torch imports this file at its end)

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

    from .torch import MultiheadAttention  # (heads.torch imports this file at its end)

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
