"""heads: multi-head attention for CPUs.

Names and defaults mirror PyTorch (``torch.nn.functional.scaled_dot_product_attention``,
``torch.nn.MultiheadAttention``). Inputs are numpy arrays or torch tensors (CPU); results come
back as the kind of the query. Bad input raises ``ValueError`` naming the argument and shapes.
All computation happens in the C++ core; this package only converts arrays (the parts: _core,
functional, nn, models; heads.torch wraps them as torch modules).
"""

from __future__ import annotations

# The parts (each re-exported here): the extension and shared checks, functions, modules, models.
from ._core import _arg, _heads, _int, _is_torch, _precision, _seed  # noqa: F401 (used by heads.torch, tests)
from .functional import LinearAttentionState, _causal_bias, _mods, alibi_slopes, linear_attention, sdpa  # noqa: F401
from .models import (CausalLM, CrossEncoder, Encoder, KVCache, SentenceEncoder, T5Encoder, Tokenizer, WordPieceTokenizer,  # noqa: F401
                     quantize)
from .nn import AdamW, MultiheadAttention, Tape, TransformerEncoder, TransformerEncoderLayer  # noqa: F401

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
    "CrossEncoder",
    "Tokenizer",
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
