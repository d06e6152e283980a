"""Worker for tests/test_grad_sync.py (4 gloo ranks): `GradientSync` of an expert-parallel run
(experts split over pairs of ranks, one replica per pair) and of replicas averaged after backward,
and `fp8lm.clip_grad_norm_` with its options, against float64 sums of every rank's gradients."""

import torch
from torch import nn

from dist_launch import worker_main

EP = 2


def grads(seed: int, n: int = 5, size: int = 37) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) * 10.0 ** torch.randint(-3, 3, (1,), generator=g) for _ in range(n)]


def params(values: list[torch.Tensor]) -> list[nn.Parameter]:
    out = []
    for v in values:
        p = nn.Parameter(torch.zeros_like(v))
        p.grad = v.clone()
        out.append(p)
    return out


def clip_case(rank: int, world: int, dims) -> dict:
    """Replicated gradients (equal on every rank) and experts (rank r holds expert r % EP of its
    pair, equal in both pairs): the norm clip_grad_norm_ computes from the sync's options, and the
    float64 norm of the whole model's gradients (the replicated ones once, each expert once)."""
    from fp8lm import clip_grad_norm_
    from fp8lm.distributed.grad_sync import GradientSync, SyncPlan

    mesh = dims.build_mesh("cpu")
    replicated, experts = params(grads(0)), params(grads(1 + rank % EP))
    plan = SyncPlan.for_run(dims, fsdp=dims.dp_shard > 1, ep=EP)
    sync = GradientSync(plan, mesh, fp8=False, experts=experts, ep_groups=mesh.expert_groups(EP, plan_dim(plan)))
    exact = sum(float(g.double().square().sum()) for g in [*grads(0), *grads(1), *grads(2)]) ** 0.5
    norm = clip_grad_norm_([*replicated, *experts], 1.0, **sync.clip_options())
    clipped = sum(float(p.grad.double().square().sum()) for p in replicated)
    return {"norm": float(norm), "exact": exact, "replicated_clipped": clipped, "options": sorted(sync.clip_options())}


def plan_dim(plan) -> str:
    return "dp_shard" if plan.dp_shard else "dp_replicate"


class SwitchedExperts(nn.Module):
    """An FP8 layer's protocol (``fp8_enabled``, ``high_precision``) around one expert weight,
    switched to high precision (a fallback, precision annealing)."""

    fp8_enabled = True
    high_precision = True

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = nn.ParameterList([weight])


def expert_case(rank: int, world: int, fp8: bool, switched: bool = False) -> dict:
    """An expert weight used by a backward on every rank: divided by EP as it arrives, then
    averaged over its replicas by `finish`; and the replicas' exact mean, for comparison.
    ``switched``: the weight of an FP8 layer switched to high precision."""
    from fp8lm.distributed import ParallelDims
    from fp8lm.distributed.grad_sync import GradientSync, SyncPlan

    dims = ParallelDims(dp_replicate=world)
    mesh = dims.build_mesh("cpu")
    expert = nn.Parameter(torch.zeros(37))
    sync = GradientSync(
        SyncPlan.for_run(dims, ep=EP), mesh, fp8=fp8, experts=[expert], ep_groups=mesh.expert_groups(EP)
    )
    model = nn.Module()
    if switched:
        model.experts = SwitchedExperts(expert)
    else:
        model.register_parameter("expert", expert)
    (expert * grads(10 + rank, n=1)[0]).sum().backward()
    arrived = expert.grad.clone()
    sync.finish(model)
    replicas = [grads(10 + r, n=1)[0] / EP for r in range(world) if r % EP == rank % EP]
    return {"arrived": arrived, "synced": expert.grad.clone(), "mean": sum(replicas) / len(replicas)}


def replicas_case(rank: int, world: int) -> dict:
    """Two pipeline stages of two replicas each: `finish` averages every gradient over the replicas."""
    from fp8lm.distributed import ParallelDims
    from fp8lm.distributed.grad_sync import GradientSync, SyncPlan

    dims = ParallelDims(pp=2, dp_replicate=world // 2)
    mesh = dims.build_mesh("cpu")
    plan = SyncPlan.for_run(dims)
    model = nn.Linear(8, 3)
    stage, replica = dims.coordinates(rank)["pp"], dims.coordinates(rank)["dp_replicate"]
    for i, p in enumerate(model.parameters()):
        p.grad = grads(100 * stage + 10 * replica + i, n=1, size=p.numel())[0].view(p.shape)
    GradientSync(plan, mesh, fp8=False).finish(model)
    mean = [
        sum(grads(100 * stage + 10 * r + i, n=1, size=p.numel())[0] for r in range(dims.dp_replicate)).view(p.shape)
        / dims.dp_replicate
        for i, p in enumerate(model.parameters())
    ]
    return {"ways": plan.ways(), "grads": [p.grad.clone() for p in model.parameters()], "mean": mean}


def checks(rank, world):
    from fp8lm.distributed import ParallelDims

    return {
        "clip_replicated": clip_case(rank, world, ParallelDims(dp_replicate=world)),
        "clip_sharded": clip_case(rank, world, ParallelDims(dp_shard=world)),
        "expert_fp32": expert_case(rank, world, fp8=False),
        "expert_fp8": expert_case(rank, world, fp8=True),
        "expert_switched": expert_case(rank, world, fp8=True, switched=True),
        "replicas": replicas_case(rank, world),
    }


if __name__ == "__main__":
    worker_main(checks)
