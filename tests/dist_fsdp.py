"""Worker for tests/test_fsdp.py: fp8lm on FSDP2 (gloo ranks). Each rank runs a small FP8 model,
sharded with `fp8lm.distributed.fully_shard` (dimensions not divisible by the world size), next to
an unsharded copy with the same weights; it saves what the test compares."""

import copy
import sys

import torch
from torch import nn

from dist_collectives import rank_input
from dist_launch import worker_main


def small_model() -> nn.Module:
    from fp8lm.nn import FP8Linear

    torch.manual_seed(0)
    return nn.Sequential(FP8Linear(16, 13), nn.ReLU(), FP8Linear(13, 8))


def rank_batch(rank: int) -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(100 + rank)) * (1 + rank)


def dequantized(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.dequantize() if hasattr(t, "dequantize") else t.detach().clone()


def reduce_scatter_checks(rank, world) -> dict:
    import torch.distributed as dist

    from fp8lm.distributed.fsdp import FP8ReduceScatter

    x = rank_input(rank, 250 * world)
    out = torch.empty(250)
    FP8ReduceScatter()(out, x, dist.group.WORLD, dist.ReduceOp.AVG)
    return {"rs_out": out}


def model_checks(rank, world) -> dict:
    from fp8lm.distributed import comm_stats, fully_shard, precompute_fp8_scales, reset_comm_stats

    model = small_model()
    reference = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    res = {"shards": {n: dequantized(p) for n, p in model.named_parameters()}}
    precompute_fp8_scales(model)
    model[0].unshard()
    gathered = model[0].weight
    res["gathered"] = (gathered.payload.float().clone(), gathered.scale.clone(), gathered.payload.dtype)
    model[0].reshard()
    x = rank_batch(rank)
    reset_comm_stats()
    out = model(x)
    out.square().mean().backward()
    res["stats"] = comm_stats()
    ref_out = reference(x)
    ref_out.square().mean().backward()
    res["out"], res["ref_out"] = out.detach(), ref_out.detach()
    res["grads"] = {n: dequantized(p.grad) for n, p in model.named_parameters()}
    res["ref_grads"] = {n: dequantized(p.grad) for n, p in reference.named_parameters()}
    return res


def torch_fully_shard_checks(rank, world) -> dict:
    """torch's own fully_shard on an fp8lm model: the FP8 GEMM's weight is still gathered in E4M3."""
    from torch.distributed.fsdp import fully_shard

    model = small_model()
    reference = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    model[0].unshard()
    res = {"gathered_dtype": model[0].weight.payload.dtype}
    model[0].reshard()
    x = rank_batch(rank)
    res["out"], res["ref_out"] = model(x).detach(), reference(x).detach()
    return res


def checks(rank, world, mode):
    modes = {"reduce_scatter": reduce_scatter_checks, "model": model_checks, "torch": torch_fully_shard_checks}
    return modes[mode](rank, world)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
