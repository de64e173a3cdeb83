"""Sequence-parallel (ring) attention over torch.distributed, with heads' kernel on every rank.

Each rank of a process group holds one shard of a long sequence: its queries, keys and values. The
key/value shards travel around the ring of ranks, one step per rank; each rank attends its queries
to the shard it holds (heads.sdpa, forward and backward in C++) and folds the result into its output
through the log-sum-exp of every row (heads' ``sdpa_merge``). A rank holds a few shards of K/V at a
time (its own, the one in use, the one arriving and the copy being sent; docs/distributed.md counts
them), never the whole sequence's, so the sequence can outgrow one machine's memory. The transfer of the next shard runs
while the current one is computed (heads releases the GIL; gloo moves the bytes on its own threads).

    import torch.distributed as dist
    from heads.distributed import ring_attention, shard, unshard
    dist.init_process_group("gloo")                       # torchrun sets the rendezvous
    q = shard(q_full, dist.get_rank(), dist.get_world_size(), layout="zigzag")   # [B, H, L/W, D]
    out = ring_attention(q, k, v, is_causal=True, layout="zigzag")               # this rank's rows
    out.sum().backward()                                  # q.grad, k.grad, v.grad of this rank's shard

Layouts (the same on every rank; ``shard`` and ``unshard`` cut and join a full sequence):

- ``"contiguous"``: rank r holds one run of positions, rank 0 the first. ``shard`` gives rank r
  positions [r·L/W, (r+1)·L/W), the first L mod W ranks one more; shards of any other lengths
  (at least 1 each, e.g. cut at document boundaries) work as well.
- ``"zigzag"``: the sequence is cut into 2W chunks as ``torch.tensor_split`` cuts it (the first
  L mod 2W chunks one position longer); rank r holds chunks r and 2W-1-r. With a causal mask every
  rank then has the same amount of work (with "contiguous", rank W-1 has W times rank 0's).

Any L works (at least one position per chunk); the ranks exchange their shard lengths and
arguments before any transfer. A rank given bad input raises its error and every other rank raises
a ValueError naming that rank; a shard that does not fit the layout, or arguments that differ
between ranks, make every rank raise the same ValueError. No rank is left waiting.

float32 CPU tensors, [B, H, Ls, D] (or [H, Ls, D]); GQA with ``enable_gqa=True`` as in
heads.sdpa; ``key_padding_mask`` [B, Ls] ([Ls] for 3-D inputs; bool, True = padding, as in
nn.MultiheadAttention) for this rank's keys, carried around the ring with them. A query row that sees no key at all gets
zeros, as everywhere in heads. The cost model (memory per rank, bytes moved, when it pays) is in
docs/distributed.md.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch as _torch
import torch.distributed as _dist

from . import _heads

__all__ = ["ring_attention", "RingAttentionFunction", "shard", "unshard", "chunks_of", "chunk_lengths"]

_LAYOUTS = ("contiguous", "zigzag")


def chunks_of(rank: int, world: int, layout: str) -> List[int]:
    """The chunk indices rank `rank` holds, in order (W chunks for "contiguous", 2W for "zigzag")."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    raise ValueError(f"layout: expected one of {_LAYOUTS}, got {layout!r}")


def chunk_lengths(length: int, n: int) -> List[int]:
    """The lengths of `n` chunks of a sequence of `length` positions, as torch.tensor_split cuts it:
    the first length mod n chunks one position longer than the rest."""
    base, extra = divmod(length, n)
    return [base + (1 if c < extra else 0) for c in range(n)]


def shard(x: _torch.Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = -2) -> _torch.Tensor:
    """Rank `rank`'s shard of the full sequence `x` (positions along `dim`), as `ring_attention` expects."""
    n = len(chunks_of(rank, world, layout)) * world
    if x.shape[dim] < n:
        raise ValueError(f"shard: the sequence length {x.shape[dim]} (dim {dim} of {tuple(x.shape)}) is shorter than "
                         f"the {n} chunks of {world} ranks in layout {layout!r} (one position each at least)")
    parts = x.tensor_split(n, dim=dim)
    return _torch.cat([parts[c] for c in chunks_of(rank, world, layout)], dim=dim).contiguous()


def unshard(shards: Sequence[_torch.Tensor], layout: str = "contiguous", dim: int = -2) -> _torch.Tensor:
    """The full sequence from every rank's shard (shards[r] from rank r): the inverse of `shard`."""
    world = len(shards)
    if layout == "contiguous":
        return _torch.cat(list(shards), dim=dim)
    lengths = chunk_lengths(sum(s.shape[dim] for s in shards), 2 * world)
    chunks: List[Optional[_torch.Tensor]] = [None] * (2 * world)
    for r, s in enumerate(shards):
        mine = chunks_of(r, world, layout)
        if s.shape[dim] != sum(lengths[c] for c in mine):
            raise ValueError(f"unshard: shard {r} holds {s.shape[dim]} positions along dim {dim}; layout {layout!r} "
                             f"gives rank {r} {sum(lengths[c] for c in mine)} of {sum(lengths)}")
        for c, part in zip(mine, s.split([lengths[c] for c in mine], dim=dim)):
            chunks[c] = part
    return _torch.cat(chunks, dim=dim)


class _Ring:
    """The ring of `group`: this rank's neighbours (global ranks) and asynchronous shifts by one."""

    def __init__(self, group) -> None:
        self.group = group
        self.world = _dist.get_world_size(group)
        self.rank = _dist.get_rank(group)
        self.next = _dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None else \
            (self.rank + 1) % self.world
        self.prev = _dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None else \
            (self.rank - 1) % self.world

    def shift(self, send: _torch.Tensor, recv_numel: int, tag: int) -> "_Shift":
        """Starts sending `send` to the next rank and receiving the previous rank's `recv_numel` floats."""
        return _Shift(self, send, recv_numel, tag)


class _Shift:
    """One step of the ring in flight; wait() returns what the previous rank sent."""

    def __init__(self, ring: _Ring, send: _torch.Tensor, recv_numel: int, tag: int) -> None:
        self.send = send  # held until the transfer is done
        self.recv = _torch.empty(recv_numel, dtype=send.dtype)
        self.reqs = [_dist.isend(send, ring.next, group=ring.group, tag=tag),
                     _dist.irecv(self.recv, ring.prev, group=ring.group, tag=tag)]

    def wait(self) -> _torch.Tensor:
        for r in self.reqs:
            r.wait()
        self.reqs, self.send = [], None
        return self.recv


def _pack(*ts: _torch.Tensor) -> _torch.Tensor:
    return _torch.cat([t.reshape(-1) for t in ts])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _unpack(buf: _torch.Tensor, shapes) -> List[_torch.Tensor]:
    out, o = [], 0
    for s in shapes:
        out.append(buf[o:o + _numel(s)].view(s))
        o += _numel(s)
    return out


def _pairs(q_chunks: List[int], kv_chunks: List[int], causal: bool):
    """(query chunk slot, key chunk slot, causal diagonal?) for every pair of chunks that attend:
    all of them without a mask; with one, a key chunk before the query chunk in full, the same chunk
    with the causal (diagonal) mask, a later one not at all."""
    for a, qc in enumerate(q_chunks):
        for b, kc in enumerate(kv_chunks):
            if not causal or kc < qc:
                yield a, b, False
            elif kc == qc:
                yield a, b, True


# What every rank tells the others before a ring starts (all_gather of one float64 row each): its
# shard length, and the arguments that must be the same everywhere. Shapes and flags are exact in
# float64.
_AGREED = ("batch", "query heads", "key/value heads", "head size D", "value head size Dv", "is_causal",
           "layout", "key_padding_mask given", "enable_gqa", "scale given", "scale")
_FLAGS = ("is_causal", "key_padding_mask given", "enable_gqa", "scale given")


class _Plan:
    """Every rank's shard and chunk lengths, and the shapes of what travels: agreed by all ranks at
    the start of a call, so each receive is sized for the shard that arrives."""

    def __init__(self, group, query, key, value, key_padding_mask, is_causal, scale, enable_gqa, layout) -> None:
        ring = _Ring(group)
        self.world, self.rank, self.layout = ring.world, ring.rank, layout
        error = _check_local(query, key, value, key_padding_mask, scale, enable_gqa, layout)
        row = [0.0] * (2 + len(_AGREED))
        if error is None:
            row = [1.0, float(query.shape[2]), float(query.shape[0]), float(query.shape[1]), float(key.shape[1]),
                   float(query.shape[3]), float(value.shape[3]), float(is_causal), float(_LAYOUTS.index(layout)),
                   float(key_padding_mask is not None), float(enable_gqa), float(scale is not None),
                   0.0 if scale is None else float(scale)]
        rows = [_torch.empty(len(row), dtype=_torch.float64) for _ in range(ring.world)]
        _dist.all_gather(rows, _torch.tensor(row, dtype=_torch.float64), group=group)
        if error is not None:
            raise ValueError(f"ring_attention (rank {ring.rank}): {error}")
        bad = [r for r, x in enumerate(rows) if x[0] != 1.0]
        if bad:
            raise ValueError(f"ring_attention: rank(s) {bad} were given invalid inputs (their own error says which); "
                             f"no rank computed anything")
        def shown(i: int, value: float) -> str:  # an agreed field as the caller wrote it
            name = _AGREED[i]
            if name == "layout":
                return repr(_LAYOUTS[int(value)])
            return str(bool(value)) if name in _FLAGS else f"{value:g}"

        for r, x in enumerate(rows):
            for i, name in enumerate(_AGREED):
                if x[2 + i] != rows[0][2 + i]:
                    raise ValueError(f"ring_attention: every rank must pass the same {name}: rank 0 has "
                                     f"{shown(i, rows[0][2 + i].item())}, rank {r} {shown(i, x[2 + i].item())}")
        self.lengths = [int(x[1]) for x in rows]  # each rank's shard length
        self.B, self.Hkv, self.D, self.Dv = (int(rows[0][i]) for i in (2, 4, 5, 6))
        self.masked = key_padding_mask is not None
        if layout == "contiguous":
            self.chunk_len = list(self.lengths)
        else:
            self.chunk_len = chunk_lengths(sum(self.lengths), 2 * self.world)
            for r, n in enumerate(self.lengths):
                want = sum(self.chunk_len[c] for c in chunks_of(r, self.world, layout))
                if n != want:
                    raise ValueError(f"ring_attention: rank {r} holds {n} positions, but layout 'zigzag' cuts the "
                                     f"{sum(self.lengths)} positions of all ranks into {2 * self.world} chunks as "
                                     f"torch.tensor_split does and gives rank {r} {want} "
                                     f"(heads.distributed.shard cuts that way)")

    def lens(self, rank: int) -> List[int]:
        """The lengths of `rank`'s chunks, in the order its shard holds them."""
        return [self.chunk_len[c] for c in chunks_of(rank, self.world, self.layout)]

    def kv_shapes(self, rank: int, with_mask: bool = True):
        """Shapes of what travels with `rank`'s shard: K, V and (with_mask) its key padding mask."""
        n = self.lengths[rank]
        shapes = [(self.B, self.Hkv, n, self.D), (self.B, self.Hkv, n, self.Dv)]
        return shapes + [(self.B, n)] if with_mask and self.masked else shapes

    def numel(self, rank: int, with_mask: bool = True) -> int:
        return sum(_numel(s) for s in self.kv_shapes(rank, with_mask))


def _check_local(query, key, value, key_padding_mask, scale, enable_gqa, layout) -> Optional[str]:
    """What is wrong with this rank's own arguments, or None (checked before the ranks exchange
    anything, so that a bad argument on one rank cannot leave the others waiting)."""
    if layout not in _LAYOUTS:
        return f"layout: expected one of {_LAYOUTS}, got {layout!r}"
    if scale is not None and not isinstance(scale, float):
        return f"scale: expected a number or None, got {scale!r}"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, _torch.Tensor):
            return f"{name}: expected a torch tensor, got {type(t).__name__}"
        if t.dim() != 4 or t.dtype != _torch.float32 or t.device.type != "cpu":
            return f"{name}: expected a float32 CPU tensor [B, H, Ls, D], got {t.dtype} {tuple(t.shape)} on {t.device}"
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not (query.shape[0] == key.shape[0] == value.shape[0]) or key.shape[1] != value.shape[1] or \
            query.shape[3] != key.shape[3]:
        return f"{shapes}: expected query [B, H, Ls, D], key [B, Hkv, Ls, D] and value [B, Hkv, Ls, Dv]"
    H, Hkv = query.shape[1], key.shape[1]
    if Hkv == 0 or H % Hkv or (H != Hkv and not enable_gqa):
        return (f"{shapes}: {H} query heads and {Hkv} key/value heads; they must be equal, or a multiple "
                f"with enable_gqa=True")
    if not (query.shape[2] == key.shape[2] == value.shape[2]):
        return f"{shapes} must hold the same shard length"
    chunks = 1 if layout == "contiguous" else 2
    if query.shape[2] < chunks:
        return f"{shapes}: the shard holds {query.shape[2]} positions, fewer than its {chunks} chunk(s)"
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, _torch.Tensor):
            return f"key_padding_mask: expected a bool tensor or None, got {type(key_padding_mask).__name__}"
        if key_padding_mask.dtype != _torch.bool or key_padding_mask.device.type != "cpu" or \
                tuple(key_padding_mask.shape) != (key.shape[0], key.shape[2]):
            return (f"key_padding_mask: expected a bool CPU tensor [B, Ls] = {(key.shape[0], key.shape[2])} "
                    f"([Ls] for 3-D inputs; True = padding), got {key_padding_mask.dtype} "
                    f"{tuple(key_padding_mask.shape)} on {key_padding_mask.device}")
    return None


def _keep(mask_chunk: Optional[_torch.Tensor]) -> Optional[_torch.Tensor]:
    """heads' boolean attention mask (True = attend) [B, 1, 1, Lk] from a chunk of the travelling
    padding mask (floats, 1 = padding)."""
    if mask_chunk is None:
        return None
    return mask_chunk.eq(0).reshape(mask_chunk.shape[0], 1, 1, mask_chunk.shape[1])


class RingAttentionFunction(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, key_padding_mask, plan, group, is_causal, scale, enable_gqa, overlap):
        ring = _Ring(group)
        layout = plan.layout
        q_chunks = chunks_of(ring.rank, ring.world, layout)
        qs = [c.contiguous() for c in query.detach().split(plan.lens(ring.rank), dim=2)]
        held = [key.detach().contiguous(), value.detach().contiguous()]
        if plan.masked:  # the padding mask travels with its keys, as floats in the same buffer
            held.append(key_padding_mask.detach().to(_torch.float32))
        outs: List[Optional[_torch.Tensor]] = [None] * len(qs)
        lses: List[Optional[_torch.Tensor]] = [None] * len(qs)
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world  # whose K/V this rank holds now
            after = (src - 1) % ring.world  # whose arrives next
            nxt = None
            if step + 1 < ring.world and overlap:
                nxt = ring.shift(_pack(*held), plan.numel(after), tag=step)
            parts = [t.split(plan.lens(src), dim=-2 if t.dim() == 4 else 1) for t in held]
            ks, vs = parts[0], parts[1]
            ms = parts[2] if plan.masked else [None] * len(ks)
            for a, b, diag in _pairs(q_chunks, chunks_of(src, ring.world, layout), is_causal):
                o, lse, _ = _heads.sdpa_train_forward(qs[a], ks[b], vs[b], _keep(ms[b]), 0.0, diag, scale,
                                                      enable_gqa)
                if outs[a] is None:
                    outs[a], lses[a] = o, lse
                else:
                    outs[a], lses[a] = _heads.sdpa_merge(outs[a], lses[a], o, lse)
            del parts, ks, vs, ms  # the shard just used is not kept past its step
            if step + 1 < ring.world:
                if nxt is None:
                    nxt = ring.shift(_pack(*held), plan.numel(after), tag=step)
                held = _unpack(nxt.wait(), plan.kv_shapes(after))
        # every query chunk attends at least its own diagonal chunk, so each was set
        out = _torch.cat([o.reshape(q.shape[:3] + (value.shape[3],)) for o, q in zip(outs, qs)], dim=2)
        lse = _torch.cat([x.reshape(q.shape[:3]) for x, q in zip(lses, qs)], dim=2)
        mask = key_padding_mask.detach() if plan.masked else _torch.empty(0)
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.args = (plan, group, is_causal, scale, enable_gqa, overlap)
        return out

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out, lse, mask = ctx.saved_tensors
        plan, group, is_causal, scale, enable_gqa, overlap = ctx.args
        ring = _Ring(group)
        q_chunks = chunks_of(ring.rank, ring.world, plan.layout)
        mine = plan.lens(ring.rank)
        qs = query.detach().contiguous().split(mine, dim=2)
        gs = dout.contiguous().split(mine, dim=2)
        os_ = out.split(mine, dim=2)
        ls = lse.split(mine, dim=2)
        dq = _torch.zeros_like(query, dtype=_torch.float32)
        dqs = dq.split(mine, dim=2)
        held = [key.detach().contiguous(), value.detach().contiguous()]
        if plan.masked:
            held.append(mask.to(_torch.float32))
        # dK, dV of the shard held travel with it; each rank adds its share, and after a full turn
        # (one more shift than K/V make) every shard's gradient is back with its owner.
        dkv_in = None  # the shift bringing the accumulated gradient of the shard now held
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world
            after = (src - 1) % ring.world
            nxt = None
            if step + 1 < ring.world and overlap:
                nxt = ring.shift(_pack(*held), plan.numel(after), tag=2 * step)
            lens = plan.lens(src)
            ks, vs = held[0].split(lens, dim=2), held[1].split(lens, dim=2)
            ms = held[2].split(lens, dim=1) if plan.masked else [None] * len(ks)
            dk, dv = _torch.zeros_like(held[0]), _torch.zeros_like(held[1])
            dks, dvs = dk.split(lens, dim=2), dv.split(lens, dim=2)
            for a, b, diag in _pairs(q_chunks, chunks_of(src, ring.world, plan.layout), is_causal):
                gq, gk, gv, *_ = _heads.sdpa_train_backward(
                    gs[a], qs[a], ks[b], vs[b], os_[a], ls[a], 0, _keep(ms[b]), 0.0, diag, scale, enable_gqa,
                    False, False, None, True)
                dqs[a].add_(gq.reshape(dqs[a].shape))
                dks[b].add_(gk.reshape(dks[b].shape))
                dvs[b].add_(gv.reshape(dvs[b].shape))
            del ks, vs, ms, dks, dvs
            if dkv_in is not None:  # what the ranks before added to this shard's gradient
                gk_prev, gv_prev = _unpack(dkv_in.wait(), plan.kv_shapes(src, with_mask=False))
                dk.add_(gk_prev)
                dv.add_(gv_prev)
                del gk_prev, gv_prev
            if step + 1 < ring.world:
                if nxt is None:
                    nxt = ring.shift(_pack(*held), plan.numel(after), tag=2 * step)
                # the gradient follows its shard to the next rank, and the one of the shard arriving comes in
                dkv_in = ring.shift(_pack(dk, dv), plan.numel(after, with_mask=False), tag=2 * step + 1)
                held = _unpack(nxt.wait(), plan.kv_shapes(after))
            else:
                dkv = _pack(dk, dv)
            del dk, dv
        if ring.world > 1:  # the last shift: each shard's gradient home
            dkv = ring.shift(dkv, plan.numel(ring.rank, with_mask=False), tag=2 * ring.world).wait()
        dk, dv = _unpack(dkv, plan.kv_shapes(ring.rank, with_mask=False))
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None, None, None, None)


def ring_attention(query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor, *, group=None,
                   key_padding_mask: Optional[_torch.Tensor] = None, is_causal: bool = False,
                   scale: Optional[float] = None, enable_gqa: bool = False, layout: str = "contiguous",
                   overlap: bool = True) -> _torch.Tensor:
    """Attention of this rank's query shard over the keys and values of every rank of `group`.

    query [B, H, Ls, D], key [B, Hkv, Ls, D], value [B, Hkv, Ls, Dv]: this rank's shard (``shard``;
    Ls may differ between ranks, see the module's layouts). Returns this rank's rows of
    softmax(QKᵀ·scale)V over the whole sequence, [B, H, Ls, Dv]; differentiable (the backward is
    also a ring). ``key_padding_mask`` [B, Ls] bool, True where this rank's key is padding (given on
    every rank or on none; [Ls] for 3-D inputs). ``is_causal`` masks by positions in the full
    sequence. ``overlap=False``
    waits for each transfer before computing (for measuring what overlap saves). Every rank must
    call it with the same arguments; the ranks check that they agree before any transfer.
    """
    if not _dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialized (dist.init_process_group)")
    # Every check that can fail on one rank only happens inside _Plan, after which all ranks agree.
    squeeze = isinstance(query, _torch.Tensor) and query.dim() == 3
    if squeeze:
        query, key, value = (t.unsqueeze(0) if isinstance(t, _torch.Tensor) else t for t in (query, key, value))
        if isinstance(key_padding_mask, _torch.Tensor):
            key_padding_mask = key_padding_mask.unsqueeze(0)
    if scale is not None and not isinstance(scale, bool):
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            pass  # left as given: _check_local names it
    plan = _Plan(group, query, key, value, key_padding_mask, bool(is_causal), scale, bool(enable_gqa), layout)
    out = RingAttentionFunction.apply(query, key, value, key_padding_mask, plan, group, bool(is_causal), scale,
                                      bool(enable_gqa), bool(overlap))
    return out.squeeze(0) if squeeze else out
