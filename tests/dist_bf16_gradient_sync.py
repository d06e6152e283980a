"""Worker for tests/test_bf16_gradient_sync.py (gloo ranks): the gradients that data-parallel
syncs keep out of FP8 (`fp8lm.distributed.sent_in_bf16`): the output head's, which the policy
stores in BF16, and those of a layer switched to high precision. A small model whose head's
gradient rows span 48 binades (one E4M3 scale per tensor keeps under 18) is synced by
`FP8DataParallel`, by `GradientSync`'s all-reduce after backward and by FP8 ZeRO's reduction; each
rank reports its own gradients (before the sync), the synced ones and the bytes."""

import torch
from torch import nn

from dist_launch import worker_main

IN, HIDDEN, VOCAB = 32, 64, 48
BATCH = 8
ROWS = 2.0 ** -torch.arange(VOCAB, dtype=torch.float32)  # row v of the head's gradient scales as 2**-v


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def model_at(level: str, switched: bool):
    import fp8lm

    torch.manual_seed(0)
    model = Tiny()
    model, optimizer = fp8lm.initialize(model, torch.optim.AdamW(model.parameters()), level)
    model.body.high_precision = switched
    return model, optimizer


def backward(model: nn.Module, rank: int) -> None:
    x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(1 + rank))
    (model(x).float() * ROWS).sum().backward()


def grads(model: nn.Module) -> dict:
    from fp8lm import ScalingTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:
            out[name] = g.dequantize(torch.float32) if isinstance(g, ScalingTensor) else g.detach().float().clone()
    return out


def wire(stats: dict) -> dict:
    return {k: stats.get(f"{k}_bytes", 0) for k in ("all_to_all", "all_gather")}


def data_parallel(rank: int, switched: bool) -> dict:
    """`FP8DataParallel`: the local gradients under ``no_sync``, then the synced ones."""
    from fp8lm.distributed import FP8DataParallel, comm_stats, reset_comm_stats

    model, _ = model_at("O2", switched)
    ddp = FP8DataParallel(model)
    with ddp.no_sync():
        backward(ddp, rank)
    local = grads(model)
    model.zero_grad(set_to_none=True)
    reset_comm_stats()
    backward(ddp, rank)
    return {"local": local, "synced": grads(model), "bytes": wire(comm_stats())}


def all_reduce(rank: int, world: int, switched: bool) -> dict:
    """`GradientSync`'s ``dp_replicate`` all-reduce after backward (the replicas of a tensor- or
    pipeline-parallel run)."""
    from fp8lm.distributed import ParallelDims
    from fp8lm.distributed.grad_sync import GradientSync, SyncPlan

    model, _ = model_at("O2", switched)
    backward(model, rank)
    local = grads(model)
    mesh = ParallelDims(dp_replicate=world).build_mesh("cpu")
    GradientSync(SyncPlan(dp_replicate="all-reduce"), mesh, fp8=True).finish(model)
    return {"local": local, "synced": grads(model)}


def zero(rank: int, switched: bool) -> dict:
    """FP8 ZeRO (O3): each owner's FP32 mean of its tensors' gradients."""
    from fp8lm.distributed import FP8ZeroOptimizer, comm_stats, reset_comm_stats

    model, optimizer = model_at("O3", switched)
    sharded = FP8ZeroOptimizer(model, optimizer)
    backward(model, rank)
    local = grads(model)
    reset_comm_stats()
    sharded.reduce_gradients()
    return {"local": local, "synced": grads(model), "bytes": wire(comm_stats())}


def non_finite(rank: int) -> dict:
    """A NaN in one rank's BF16 gradient and an inf in the other's: `bf16_all_reduce` gives both
    to every rank, and FP8 ZeRO skips the step on every rank."""
    from fp8lm.distributed import FP8ZeroOptimizer, bf16_all_reduce

    x = torch.ones(6)
    x[rank] = (float("nan"), float("inf"))[rank]
    reduced = bf16_all_reduce(x, average=True)
    model, optimizer = model_at("O3", False)
    sharded = FP8ZeroOptimizer(model, optimizer)
    backward(model, rank)
    if rank == 1:
        model.head.weight.grad.payload.view(-1)[5] = float("nan")  # the head's: stored, and sent, in BF16
    return {"all_reduce": reduced.float(), "zero_finite": sharded.reduce_gradients()}


def checks(rank: int, world: int) -> dict:
    cases = {
        f"{name} {'switched' if switched else 'fp8'}": case(switched)
        for switched in (False, True)
        for name, case in (
            ("data_parallel", lambda s: data_parallel(rank, s)),
            ("all_reduce", lambda s: all_reduce(rank, world, s)),
            ("zero", lambda s: zero(rank, s)),
        )
    }
    return {**cases, "non_finite": non_finite(rank)}


if __name__ == "__main__":
    worker_main(checks)
