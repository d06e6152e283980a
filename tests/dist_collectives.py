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
        comm_stats,
        fp8_all_gather,
        fp8_all_reduce,
        fp8_reduce_scatter,
        reset_comm_stats,
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

    nan_shard = x[:100].clone()
    if rank == world - 1:
        nan_shard[5] = math.nan
    out["nonfinite_gather"] = fp8_all_gather(nan_shard)
    out["comm"] = comm_checks(rank, world)
    return out


def comm_checks(rank, world):
    """Every helper of fp8lm.distributed.comm once, on small known tensors, and the bytes counted."""
    from fp8lm.distributed import comm, comm_stats, reset_comm_stats

    out = {}
    reset_comm_stats()
    out["all_reduce"] = comm.all_reduce(torch.arange(8.0) + 10 * rank)
    out["reduce_scatter"] = comm.reduce_scatter(torch.empty(4), torch.arange(4.0 * world) + rank)
    fp8 = torch.full((3,), rank + 1.0).to(torch.float8_e4m3fn)
    out["all_gather"] = comm.all_gather(torch.empty(3 * world, dtype=torch.float8_e4m3fn), fp8)
    out["all_to_all"] = comm.all_to_all(torch.empty(world), torch.arange(float(world)) + 100 * rank)
    out["broadcast"] = comm.broadcast(torch.full((5,), float(rank)), src=1)
    sent = comm.send(torch.full((6,), float(rank)), (rank + 1) % world, async_op=True)
    out["recv"] = comm.recv(torch.empty(6), (rank - 1) % world)
    sent.wait()
    out["stats"] = comm_stats()
    try:
        comm.all_reduce(fp8)
    except TypeError as e:
        out["fp8_sum_error"] = str(e)
    return out
