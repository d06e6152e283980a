"""Checks for tests/test_distributed_collectives.py (run by dist_sync.py): every FP8 collective
on this rank's inputs."""

import math

import torch


def rank_input(rank: int, n: int = 1000) -> torch.Tensor:
    """Deterministic per-rank input with a wide dynamic range (so subnormals and rounding matter)."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)


def checks(rank, world):
    import torch.distributed as dist

    from fp8lm import E5M2, quantize
    from fp8lm.distributed import (
        comm_stats, fp8_all_gather, fp8_all_reduce, fp8_reduce_scatter, reset_comm_stats,
        shared_scale_all_reduce,
    )

    out = {}
    x = rank_input(rank)
    reset_comm_stats()
    fp8_all_reduce(rank_input(rank, 20000))
    out["all_reduce_stats"] = comm_stats()
    out["all_reduce"] = fp8_all_reduce(x)
    out["all_reduce_mean"] = fp8_all_reduce(x, average=True)
    out["all_reduce_e5m2"] = fp8_all_reduce(x, fmt=E5M2)
    out["all_reduce_2d"] = fp8_all_reduce(x[:999].view(27, 37))  # size not divisible by world
    out["reduce_scatter"] = fp8_reduce_scatter(x[:999])
    fp32 = x.clone()
    dist.all_reduce(fp32)
    out["fp32_all_reduce"] = fp32

    shard = quantize(x[:100] * (rank + 1))
    out["all_gather_input"] = shard.dequantize()
    out["all_gather"] = fp8_all_gather(shard)

    # The paper's shared scale: equal inputs make the plain FP8 sum overflow (post-scaling).
    same = rank_input(0)
    out["shared_post"] = shared_scale_all_reduce(same, mu=1.0)
    out["shared_pre"] = shared_scale_all_reduce(same, mu=1.0 / 2 ** math.ceil(math.log2(world)))
    out["shared_mean"] = shared_scale_all_reduce(x, mu=0.5, average=True)

    bad = x.clone()
    if rank == world - 1:
        bad[3] = math.inf
    out["nonfinite"] = fp8_all_reduce(bad)

    try:
        fp8_all_gather(x[: 10 + rank])
    except ValueError as e:
        out["unequal_gather_error"] = str(e)
    try:
        fp8_all_reduce(torch.arange(4))
    except TypeError as e:
        out["int_error"] = str(e)
    return out

