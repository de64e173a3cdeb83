"""One rank of the torch.distributed tests (tests/python/test_distributed.py), started by torchrun or
by the test itself with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.

    python3 dist_worker.py ring    ring attention against single-process attention (heads and torch f64)
    python3 dist_worker.py ddp     heads.torch modules under DistributedDataParallel against one process
    python3 dist_worker.py fsdp    the same block sharded with FSDP2 (fully_shard), two SGD steps

Every rank checks its own results and exits non-zero with a message on a mismatch; rank 0 prints one
JSON line with the worst errors seen, for the test to report.
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import heads.torch as ht
from heads.distributed import ring_attention, shard, unshard


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|)"""
    want = want.to(torch.float64)
    return float((got.to(torch.float64) - want).abs().max() / max(1.0, float(want.abs().max())))


def check(what: str, err: float, tol: float) -> None:
    if not err <= tol:
        sys.exit(f"rank {dist.get_rank()}: {what}: error {err:.3g} > {tol:g}")


def cut(x: torch.Tensor, rank: int, world: int, layout: str, cuts, dim: int = -2) -> torch.Tensor:
    """This rank's shard: `shard`'s cut, or the given contiguous lengths (cuts[r] for rank r)."""
    if cuts is None:
        return shard(x, rank, world, layout, dim=dim)
    return x.split(list(cuts), dim=dim)[rank].contiguous()


def ring() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = {"forward": 0.0, "backward": 0.0, "torch_f64": 0.0, "cases": 0}
    W = world
    cases = [  # B, H, Hkv, L, D, Dv, causal, layout, contiguous cuts (None: shard's), key padding
        (1, 1, 1, 4 * W, 8, 8, False, "contiguous", None, None),
        (2, 4, 4, 36 * W, 63, 40, True, "contiguous", None, None),
        (2, 4, 4, 36 * W, 63, 40, True, "zigzag", None, None),
        (1, 4, 2, 66 * W, 64, 64, False, "zigzag", None, None),
        (1, 4, 1, 66 * W, 80, 17, True, "zigzag", None, None),
        (1, 2, 2, 130 * W, 32, 32, True, "contiguous", None, None),
        # lengths that do not divide: shards (and zigzag's chunks) one position apart
        (1, 2, 2, 13 * W + 1, 16, 16, True, "contiguous", None, None),
        (2, 4, 2, 37 * W + 3, 40, 24, True, "zigzag", None, None),
        (1, 3, 3, 2 * W + 1, 9, 7, False, "zigzag", None, None),
        # shards of the caller's own lengths (contiguous), one of them a single position
        (2, 2, 1, None, 24, 24, True, "contiguous", [5, 1, 17, 9][:W], None),
        (1, 2, 2, None, 24, 8, False, "contiguous", [33, 2, 1, 20][:W], None),
        # key padding: trailing padding per batch item, causal, both layouts, odd length
        (3, 4, 2, 29 * W + 1, 32, 32, True, "zigzag", None, "suffix"),
        (2, 2, 2, 21 * W, 16, 24, False, "contiguous", None, "suffix"),
        # random padding, one batch item all padding: rows that see no key get zeros and no gradient
        (2, 2, 2, 17 * W + 2, 16, 16, True, "contiguous", None, "random"),
        (2, 2, 1, 17 * W + 2, 16, 16, False, "zigzag", None, "random"),
    ]
    for n, (B, H, Hkv, L, D, Dv, causal, layout, cuts, padding) in enumerate(cases):
        L = sum(cuts) if cuts is not None else L
        g = torch.Generator().manual_seed(1000 + n)  # the same full tensors on every rank
        q, k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g), \
            torch.randn(B, Hkv, L, Dv, generator=g)
        dout = torch.randn(B, H, L, Dv, generator=g)
        gqa = H != Hkv
        kpm = None  # True = padding
        if padding == "suffix":
            valid = torch.randint(1, L + 1, (B,), generator=g)
            valid[0] = L
            kpm = torch.arange(L)[None, :] >= valid[:, None]
        elif padding == "random":
            kpm = torch.rand(B, L, generator=g) < 0.4
            kpm[1] = True
        mask = None  # the same attention as one boolean mask (True = attend) for the references
        if kpm is not None:
            mask = ~kpm[:, None, None, :]
            if causal:
                mask = mask & torch.ones(L, L, dtype=torch.bool).tril()
        # single process, heads
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = ht.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal and mask is None,
                                              enable_gqa=gqa)
        ref.backward(dout)
        # single process, torch in float64 (which gives NaN for rows that see no key: compared only without them)
        f64_ok = padding != "random"
        if f64_ok:
            f64 = [t.double().requires_grad_() for t in (q, k, v)]
            ref64 = F.scaled_dot_product_attention(*f64, attn_mask=mask, is_causal=causal and mask is None,
                                                   enable_gqa=gqa)
            ref64.backward(dout.double())
        # this rank's shard, over the ring
        mine = [cut(t, rank, world, layout, cuts).requires_grad_() for t in (q, k, v)]
        my_kpm = None if kpm is None else cut(kpm, rank, world, layout, cuts, dim=-1)
        out = ring_attention(*mine, key_padding_mask=my_kpm, is_causal=causal, enable_gqa=gqa, layout=layout)
        out.backward(cut(dout, rank, world, layout, cuts))
        what = (f"case {n} (B={B} H={H} Hkv={Hkv} L={L} D={D} Dv={Dv} causal={causal} {layout} cuts={cuts} "
                f"padding={padding})")
        e = rel_err(out, cut(ref.detach(), rank, world, layout, cuts))
        worst["forward"] = max(worst["forward"], e)
        check(what + " out vs heads", e, 1e-5)
        for name, t, r in zip("qkv", mine, full):
            e = rel_err(t.grad, cut(r.grad, rank, world, layout, cuts))
            worst["backward"] = max(worst["backward"], e)
            check(f"{what} d{name} vs heads", e, 1e-5)
        if padding == "random":  # batch item 1 sees no key: zeros out, zero gradients, as heads gives alone
            check(what + " fully padded item is zero", float(out[1].abs().max()) + float(mine[0].grad[1].abs().max()),
                  0.0)
        if f64_ok:
            for name, t, r64 in zip("qkv", mine, f64):
                e = rel_err(t.grad, cut(r64.grad, rank, world, layout, cuts))
                worst["torch_f64"] = max(worst["torch_f64"], e)
                check(f"{what} d{name} vs torch float64", e, 1e-5)
            e = rel_err(out, cut(ref64.detach(), rank, world, layout, cuts))
            worst["torch_f64"] = max(worst["torch_f64"], e)
            check(what + " out vs torch float64", e, 1e-5)
        # the shards gathered back are the whole output (shards of unequal lengths: gathered as objects)
        parts = [None] * world
        dist.all_gather_object(parts, out.detach())
        whole = torch.cat(parts, dim=-2) if cuts is not None else unshard(parts, layout)
        check(what + " unshard(all_gather(out))", rel_err(whole, ref.detach()), 1e-5)
        worst["cases"] += 1
    ring_errors(rank, world)
    return worst


def ring_errors(rank: int, world: int) -> None:
    """A bad argument on one rank is an error on every rank (no rank left waiting), naming the problem."""
    q = torch.randn(1, 2, 6, 8)

    def expect(what: str, needle: str, **kw) -> None:
        args = dict(query=q, key=q, value=q)
        args.update(kw)
        try:
            ring_attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)
        except ValueError as e:
            if needle not in str(e):
                sys.exit(f"rank {rank}: {what}: the error {str(e)!r} does not say {needle!r}")
            return
        sys.exit(f"rank {rank}: {what}: no error")

    bad_rank = world - 1
    expect("a double query on one rank", "float32" if rank == bad_rank else f"rank(s) [{bad_rank}]",
           query=q.double() if rank == bad_rank else q)
    def on_bad_rank(needle: str) -> str:  # the bad rank names its problem; the others name the rank
        return needle if rank == bad_rank else f"rank(s) [{bad_rank}]"

    expect("a bad layout on one rank", on_bad_rank("layout"), layout="diagonal" if rank == bad_rank else "contiguous")
    expect("a scale that is no number on one rank", on_bad_rank("scale"), scale="x" if rank == bad_rank else None)
    expect("a padding mask that is no tensor on one rank", on_bad_rank("key_padding_mask"),
           key_padding_mask=[True] * 6 if rank == bad_rank else None)
    expect("GQA heads without enable_gqa", "enable_gqa", key=q[:, :1], value=q[:, :1])
    expect("is_causal differs", "is_causal: rank 0 has True", is_causal=rank == 0)
    expect("layouts differ", "layout: rank 0 has 'zigzag'", layout="zigzag" if rank == 0 else "contiguous")
    expect("a mask on one rank only", "key_padding_mask",
           key_padding_mask=torch.zeros(1, 6, dtype=torch.bool) if rank == 0 else None)
    expect("a mask of the wrong shape", "key_padding_mask", key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))
    # zigzag over 6W + 1 positions: shard gives rank 0 the longer shard (7); here rank W-1 holds it
    odd = torch.randn(1, 2, 6 + (rank == world - 1), 8)
    if world > 1:
        expect("zigzag shards not cut as shard cuts them", "zigzag", query=odd, key=odd, value=odd, layout="zigzag")
    # and the ring still works after the refused calls
    out = ring_attention(q, q, q)
    if not bool(out.isfinite().all()) or out.shape != q.shape:
        sys.exit(f"rank {rank}: a call after the refused ones gave {tuple(out.shape)}, finite={bool(out.isfinite().all())}")


class Block(torch.nn.Module):
    """A pre-norm encoder block built on heads.torch: MultiheadAttention, then heads' SDPA function in
    a second, hand-written attention."""

    def __init__(self, e: int = 32, h: int = 4):
        super().__init__()
        self.h = h
        self.norm1, self.norm2 = torch.nn.LayerNorm(e), torch.nn.LayerNorm(e)
        self.mha = ht.MultiheadAttention(e, h, batch_first=True)
        self.qkv, self.proj = torch.nn.Linear(e, 3 * e), torch.nn.Linear(e, e)
        self.head = torch.nn.Linear(e, 3)

    def forward(self, x, pad):
        y = self.norm1(x)
        x = x + self.mha(y, y, y, key_padding_mask=pad, need_weights=False)[0]
        b, l, e = x.shape
        q, k, v = self.qkv(self.norm2(x)).view(b, l, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        x = x + self.proj(ht.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, l, e))
        return self.head(x.mean(1))


def data_parallel_setup(world: int, per: int, seed: int):
    """The same Block on every rank (the model to distribute and a copy for the one-process run) and
    the whole batch: inputs, key padding mask (key 0 never padded), class labels."""
    torch.manual_seed(0)  # the same initial parameters on every rank
    model, single = Block(), Block()
    single.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(per * world, 11, 32, generator=g)
    pad = torch.rand(per * world, 11, generator=g) < 0.2
    pad[:, 0] = False
    y = torch.randint(0, 3, (per * world,), generator=g)
    return model, single, x, pad, y


def ddp() -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    per = 3
    model, single, x, pad, y = data_parallel_setup(world, per, seed=1)
    # one process, the whole batch
    F.cross_entropy(single(x, pad), y).backward()
    # DDP: this rank's slice of the batch; gradients averaged over the ranks
    dmodel = DDP(model)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1)
    sl = slice(rank * per, (rank + 1) * per)
    F.cross_entropy(dmodel(x[sl], pad[sl]), y[sl]).backward()
    worst = 0.0
    for (name, p), p1 in zip(model.named_parameters(), single.parameters()):
        e = float((p.grad - p1.grad).abs().max())
        worst = max(worst, e)
        check(f"grad of {name}", e, 1e-6)
    opt.step()
    with torch.no_grad():
        for p, p1 in zip(model.parameters(), single.parameters()):
            p1 -= 0.1 * p1.grad
        after = max(float((p - p1).abs().max()) for p, p1 in zip(model.parameters(), single.parameters()))
    check("parameters after one SGD step", after, 1e-6)
    # the ranks agree exactly on the result
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    check("parameters across ranks", max(float((t - flat).abs().max()) for t in parts), 0.0)
    return {"grad": worst, "after_step": after, "params": int(flat.numel())}


def fsdp() -> dict:
    """FSDP2 (fully_shard) on CPU: the heads MultiheadAttention and the root sharded over the ranks; two
    SGD-with-momentum steps on this rank's slice of the batch against one process with the whole batch.
    (Not Adam: its first step is lr·g/(|g| + eps), which turns rounding-level differences in gradients
    near zero into differences of up to lr in the parameters.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    per = 3
    model, single, x, pad, y = data_parallel_setup(world, per, seed=2)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.mha, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = sum(1 for p in model.parameters() if p.to_local().numel() < p.numel())
    check("no parameter sharded by fully_shard (1 = none)", float(sharded == 0), 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt1 = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    sl = slice(rank * per, (rank + 1) * per)
    worst = after = 0.0
    for step in range(2):  # two steps: the second runs on parameters the first updated while sharded
        opt.zero_grad()
        opt1.zero_grad()
        F.cross_entropy(single(x, pad), y).backward()
        F.cross_entropy(model(x[sl], pad[sl]), y[sl]).backward()
        for (name, p), p1 in zip(model.named_parameters(), single.parameters()):
            e = float((p.grad.full_tensor() - p1.grad).abs().max())
            worst = max(worst, e)
            check(f"step {step}: grad of {name}", e, 1e-6)
        opt.step()
        opt1.step()
        with torch.no_grad():
            after = max(float((p.full_tensor() - p1).abs().max()) for p, p1 in zip(model.parameters(), single.parameters()))
        check(f"step {step}: parameters after the step", after, 1e-6)
    return {"grad": worst, "after_step": after, "sharded_params": sharded,
            "params": int(sum(p.numel() for p in model.parameters()))}


def main() -> None:
    mode = sys.argv[1]
    # a rank that never arrives, or a collective that never ends, is an error after two minutes, not a hang
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        result = {"ring": ring, "ddp": ddp, "fsdp": fsdp}[mode]()
        dist.barrier()
        if dist.get_rank() == 0:
            print(json.dumps({"mode": mode, "world": dist.get_world_size(), **result}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every rank's checks passed and the process group is destroyed. Leave without the interpreter's
    # finalization: gloo's worker threads can still be tearing down there, and a rank then aborts with
    # "terminate called without an active exception" after its work is done (seen once in CI, 1 of
    # about 20 runs; pytorch/pytorch#190489, #179291 discuss the teardown).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
