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

- ``"contiguous"``: rank r holds positions [r·L/W, (r+1)·L/W).
- ``"zigzag"``: the sequence is cut into 2W chunks; rank r holds chunks r and 2W-1-r. With a causal
  mask every rank then has the same amount of work (with "contiguous", rank W-1 has W times rank 0's).

float32 CPU tensors, [B, H, Ls, D] (or [H, Ls, D]); GQA with ``enable_gqa=True`` as in
heads.sdpa. The cost model (memory per rank, bytes moved, when it pays) is in docs/distributed.md.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch as _torch
import torch.distributed as _dist

from . import _heads

__all__ = ["ring_attention", "RingAttentionFunction", "shard", "unshard", "chunks_of"]

_LAYOUTS = ("contiguous", "zigzag")


def chunks_of(rank: int, world: int, layout: str) -> List[int]:
    """The chunk indices rank `rank` holds, in order (chunks of L/W for "contiguous", L/(2W) for "zigzag")."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    raise ValueError(f"layout: expected one of {_LAYOUTS}, got {layout!r}")


def shard(x: _torch.Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = -2) -> _torch.Tensor:
    """Rank `rank`'s shard of the full sequence `x` (positions along `dim`), as `ring_attention` expects."""
    n = len(chunks_of(rank, world, layout)) * world
    if x.shape[dim] % n:
        raise ValueError(f"shard: the sequence length {x.shape[dim]} (dim {dim} of {tuple(x.shape)}) is not a "
                         f"multiple of {n} chunks ({world} ranks, layout {layout!r})")
    parts = x.chunk(n, dim=dim)
    return _torch.cat([parts[c] for c in chunks_of(rank, world, layout)], dim=dim).contiguous()


def unshard(shards: Sequence[_torch.Tensor], layout: str = "contiguous", dim: int = -2) -> _torch.Tensor:
    """The full sequence from every rank's shard (shards[r] from rank r): the inverse of `shard`."""
    world = len(shards)
    per = len(chunks_of(0, world, layout))
    chunks: List[Optional[_torch.Tensor]] = [None] * (per * world)
    for r, s in enumerate(shards):
        for c, part in zip(chunks_of(r, world, layout), s.chunk(per, dim=dim)):
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

    def shift(self, send: _torch.Tensor, tag: int) -> "_Shift":
        """Starts sending `send` to the next rank and receiving the previous rank's into a new buffer."""
        return _Shift(self, send, tag)


class _Shift:
    """One step of the ring in flight; wait() returns what the previous rank sent."""

    def __init__(self, ring: _Ring, send: _torch.Tensor, tag: int) -> None:
        self.send = send  # held until the transfer is done
        self.recv = _torch.empty_like(send)
        self.reqs = [_dist.isend(send, ring.next, group=ring.group, tag=tag),
                     _dist.irecv(self.recv, ring.prev, group=ring.group, tag=tag)]

    def wait(self) -> _torch.Tensor:
        for r in self.reqs:
            r.wait()
        self.reqs, self.send = [], None
        return self.recv


def _pack(*ts: _torch.Tensor) -> _torch.Tensor:
    return _torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: _torch.Tensor, shapes) -> List[_torch.Tensor]:
    out, o = [], 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        out.append(buf[o:o + n].view(s))
        o += n
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


class RingAttentionFunction(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, is_causal, scale, enable_gqa, layout, overlap):
        ring = _Ring(group)
        q_chunks = chunks_of(ring.rank, ring.world, layout)
        n = len(q_chunks)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4 or t.dtype != _torch.float32 or t.device.type != "cpu":
                raise ValueError(f"ring_attention: {name}: expected a float32 CPU tensor [B, H, Ls, D], got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if query.shape[2] != key.shape[2] or key.shape[2] != value.shape[2] or query.shape[2] % n:
            raise ValueError(f"ring_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must hold the same shard length (a multiple of {n} for layout "
                             f"{layout!r})")
        qs = [c.contiguous() for c in query.detach().chunk(n, dim=2)]
        k, v = key.detach().contiguous(), value.detach().contiguous()
        shapes = (k.shape, v.shape)
        outs: List[Optional[_torch.Tensor]] = [None] * n
        lses: List[Optional[_torch.Tensor]] = [None] * n
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world  # whose K/V this rank holds now
            nxt = None
            if step + 1 < ring.world and overlap:
                nxt = ring.shift(_pack(k, v), tag=step)
            ks, vs = k.chunk(n, dim=2), v.chunk(n, dim=2)
            for a, b, diag in _pairs(q_chunks, chunks_of(src, ring.world, layout), is_causal):
                o, lse, _ = _heads.sdpa_train_forward(qs[a], ks[b], vs[b], None, 0.0, diag, scale, enable_gqa)
                if outs[a] is None:
                    outs[a], lses[a] = o, lse
                else:
                    outs[a], lses[a] = _heads.sdpa_merge(outs[a], lses[a], o, lse)
            del ks, vs  # the shard just used is not kept past its step
            if step + 1 < ring.world:
                if nxt is None:
                    nxt = ring.shift(_pack(k, v), tag=step)
                k, v = _unpack(nxt.wait(), shapes)
        # every query chunk attends at least its own diagonal chunk, so each was set
        out = _torch.cat([o.reshape(qs[0].shape[:3] + (value.shape[3],)) for o in outs], dim=2)
        lse = _torch.cat([x.reshape(qs[0].shape[:3]) for x in lses], dim=2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.args = (group, is_causal, scale, enable_gqa, layout, overlap)
        return out

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out, lse = ctx.saved_tensors
        group, is_causal, scale, enable_gqa, layout, overlap = ctx.args
        ring = _Ring(group)
        q_chunks = chunks_of(ring.rank, ring.world, layout)
        n = len(q_chunks)
        qs = query.detach().contiguous().chunk(n, dim=2)
        gs = dout.contiguous().chunk(n, dim=2)
        os_ = out.chunk(n, dim=2)
        ls = lse.chunk(n, dim=2)
        dq = _torch.zeros_like(query, dtype=_torch.float32)
        dqs = dq.chunk(n, dim=2)
        k, v = key.detach().contiguous(), value.detach().contiguous()
        shapes = (k.shape, v.shape)
        # dK, dV of the shard held travel with it; each rank adds its share, and after a full turn
        # (one more shift than K/V make) every shard's gradient is back with its owner.
        dkv_in = None  # the shift bringing the accumulated gradient of the shard now held
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world
            nxt = None
            if step + 1 < ring.world and overlap:
                nxt = ring.shift(_pack(k, v), tag=2 * step)
            ks, vs = k.chunk(n, dim=2), v.chunk(n, dim=2)
            dk, dv = _torch.zeros_like(k), _torch.zeros_like(v)
            dks, dvs = dk.chunk(n, dim=2), dv.chunk(n, dim=2)
            for a, b, diag in _pairs(q_chunks, chunks_of(src, ring.world, layout), is_causal):
                gq, gk, gv, *_ = _heads.sdpa_train_backward(
                    gs[a], qs[a], ks[b], vs[b], os_[a], ls[a], 0, None, 0.0, diag, scale, enable_gqa,
                    False, False, None, True)
                dqs[a].add_(gq.reshape(dqs[a].shape))
                dks[b].add_(gk.reshape(dks[b].shape))
                dvs[b].add_(gv.reshape(dvs[b].shape))
            del ks, vs, dks, dvs
            if dkv_in is not None:  # what the ranks before added to this shard's gradient
                gk_prev, gv_prev = _unpack(dkv_in.wait(), shapes)
                dk.add_(gk_prev)
                dv.add_(gv_prev)
                del gk_prev, gv_prev
            if step + 1 < ring.world:
                if nxt is None:
                    nxt = ring.shift(_pack(k, v), tag=2 * step)
                # the gradient follows its shard to the next rank
                dkv_in = ring.shift(_pack(dk, dv), tag=2 * step + 1)
                k, v = _unpack(nxt.wait(), shapes)
            else:
                dkv = _pack(dk, dv)
            del dk, dv
        if ring.world > 1:  # the last shift: each shard's gradient home
            dkv = ring.shift(dkv, tag=2 * ring.world).wait()
        dk, dv = _unpack(dkv, shapes)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None, None, None


def ring_attention(query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor, *, group=None,
                   is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                   layout: str = "contiguous", overlap: bool = True) -> _torch.Tensor:
    """Attention of this rank's query shard over the keys and values of every rank of `group`.

    query [B, H, Ls, D], key [B, Hkv, Ls, D], value [B, Hkv, Ls, Dv]: this rank's shard (``shard``),
    Ls = L / W the same on every rank. Returns this rank's rows of softmax(QKᵀ·scale)V over the whole
    sequence, [B, H, Ls, Dv]; differentiable (the backward is also a ring). ``is_causal`` masks by
    positions in the full sequence. ``overlap=False`` waits for each transfer before computing (for
    measuring what overlap saves). Every rank must call it with the same arguments.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"ring_attention: layout: expected one of {_LAYOUTS}, got {layout!r}")
    if not _dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialized (dist.init_process_group)")
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    out = RingAttentionFunction.apply(query, key, value, group, bool(is_causal),
                                      None if scale is None else float(scale), bool(enable_gqa), layout, bool(overlap))
    return out.squeeze(0) if squeeze else out
