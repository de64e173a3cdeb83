"""One rank of the torch.distributed tests (tests/python/test_distributed.py), started by torchrun or
by the test itself with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.

    python3 dist_worker.py ring    ring attention against single-process attention (heads and torch f64)
    python3 dist_worker.py ddp     heads.torch modules under DistributedDataParallel against one process
    python3 dist_worker.py fsdp    the same block sharded with FSDP2 (fully_shard), two SGD steps

Every rank checks its own results and exits non-zero with a message on a mismatch; rank 0 prints one
JSON line with the worst errors seen, for the test to report.
"""

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


def ring() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = {"forward": 0.0, "backward": 0.0, "torch_f64": 0.0}
    cases = [  # B, H, Hkv, L, D, Dv, causal, layout
        (1, 1, 1, 4 * world, 8, 8, False, "contiguous"),
        (2, 4, 4, 36 * world, 63, 40, True, "contiguous"),
        (2, 4, 4, 36 * world, 63, 40, True, "zigzag"),
        (1, 4, 2, 66 * world, 64, 64, False, "zigzag"),
        (1, 4, 1, 66 * world, 80, 17, True, "zigzag"),
        (1, 2, 2, 130 * world, 32, 32, True, "contiguous"),
    ]
    for n, (B, H, Hkv, L, D, Dv, causal, layout) in enumerate(cases):
        g = torch.Generator().manual_seed(1000 + n)  # the same full tensors on every rank
        q, k, v = torch.randn(B, H, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g), \
            torch.randn(B, Hkv, L, Dv, generator=g)
        dout = torch.randn(B, H, L, Dv, generator=g)
        gqa = H != Hkv
        # single process, heads
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = ht.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=gqa)
        ref.backward(dout)
        # single process, torch in float64
        f64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref64 = F.scaled_dot_product_attention(*f64, is_causal=causal, enable_gqa=gqa)
        ref64.backward(dout.double())
        # this rank's shard, over the ring
        mine = [shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, is_causal=causal, enable_gqa=gqa, layout=layout)
        out.backward(shard(dout, rank, world, layout))
        what = f"case {n} (B={B} H={H} Hkv={Hkv} L={L} D={D} Dv={Dv} causal={causal} {layout})"
        e = rel_err(out, shard(ref.detach(), rank, world, layout))
        worst["forward"] = max(worst["forward"], e)
        check(what + " out vs heads", e, 1e-5)
        for name, t, r, r64 in zip("qkv", mine, full, f64):
            e = rel_err(t.grad, shard(r.grad, rank, world, layout))
            worst["backward"] = max(worst["backward"], e)
            check(f"{what} d{name} vs heads", e, 1e-5)
            e = rel_err(t.grad, shard(r64.grad, rank, world, layout))
            worst["torch_f64"] = max(worst["torch_f64"], e)
            check(f"{what} d{name} vs torch float64", e, 1e-5)
        e = rel_err(out, shard(ref64.detach(), rank, world, layout))
        worst["torch_f64"] = max(worst["torch_f64"], e)
        check(what + " out vs torch float64", e, 1e-5)
        # the shards gathered back are the whole output
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.detach().contiguous())
        check(what + " unshard(all_gather(out))", rel_err(unshard(parts, layout), ref.detach()), 1e-5)
    return worst


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
    dist.init_process_group("gloo")
    try:
        result = {"ring": ring, "ddp": ddp, "fsdp": fsdp}[mode]()
        dist.barrier()
        if dist.get_rank() == 0:
            print(json.dumps({"mode": mode, "world": dist.get_world_size(), **result}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
