"""Modules: MultiheadAttention, TransformerEncoderLayer, TransformerEncoder (forward, backward through a
Tape, training with AdamW), picklable as torch modules are."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from ._core import _arg, _heads, _int, _is_torch, _precision, _seed


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

    def pack_f32(self):
        """In f32 (else nothing), also lays the linear weights out as the GEMM reads them (as much
        memory again), so that inference forwards need not do it at every call: for weights that no
        longer change (one row through a ``TransformerEncoderLayer(384, 12, 1536)`` 2.6x faster on a
        Zen 4). ``load_state_dict`` lays the new weights out again, ``to`` replaces it (``to("f32")``:
        the plain weights); weights changed in place afterwards (``state_dict()`` arrays written, an
        optimizer step) are not seen: call it again then. Forwards with a tape (training) read the
        weights as they are. Returns self."""
        self._m.pack_f32()
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
            if value.dtype == np.int8 or name.endswith(("_scale", "_residual_rows", "_outlier_channels", "_outlier_weight",
                                                                "_activation_error")):
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
    """The attention variant of the native modules by name, or None for torch's plain softmax attention."""
    v = dict(attention=str(attention), feature_map=str(feature_map),
             window=-1 if window is None else _int(window, "window", 0, 2**62),
             sparse_block=0 if sparse_block is None else _int(sparse_block, "sparse_block", 1, 2**62),
             sparse_stride=_int(sparse_stride, "sparse_stride", 1, 2**62),
             head_gate="none" if head_gate is None else str(head_gate), gate_threshold=float(gate_threshold))
    plain = dict(attention="softmax", feature_map="elu", window=-1, sparse_block=0, sparse_stride=4, head_gate="none",
                 gate_threshold=0.0)
    return None if v == plain else v


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
