"""Differentiable FP8 collectives on activations, along one dimension, for tensor and sequence
parallelism over a process group (the TP group).

Formats on the wire:

- **all-gathers** (sequence-parallel activations forward, their gradients backward) send FP8
  bytes with *one* power-of-two scale agreed across the group by a MAX all-reduce of the ranks'
  amaxes (8 bytes: the amax and a non-finite flag); E4M3 for activations, E5M2 for gradients;
- **reductions** (a row-wise layer's output, forward; the input gradient of a layer fed by a
  gather, backward) use fp8lm's FP8 reduce-scatter / all-reduce (`fp8_reduce_scatter`,
  `fp8_all_reduce`): E4M3 with one scale per chunk and the sum in FP32. Each chunk has its own
  scale, so E4M3's extra mantissa bit buys more than E5M2's range.

Each function here is an autograd pair: the forward collective and the backward one that its
gradient needs (a gather's gradient is a reduce-scatter, a reduce-scatter's is a gather).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..formats import E4M3, E5M2, Format
from ..ops.cast import amax, saturating_cast
from ..scaling import compute_scale
from . import comm
from .collectives import fp8_all_reduce, fp8_reduce_scatter
from .reduction import dequantize_payload

__all__ = [
    "ACTIVATION_FORMAT",
    "GRADIENT_FORMAT",
    "REDUCTION_FORMAT",
    "agreed_scale_all_gather",
    "reduce_scatter_along",
    "gather_from_shards",
    "reduce_scatter_to_shards",
    "all_reduce_partial",
    "copy_to_parallel_region",
    "scatter_to_shards",
    "reduce_replicated_grad",
]

ACTIVATION_FORMAT: Format = E4M3
GRADIENT_FORMAT: Format = E5M2
REDUCTION_FORMAT: Format = E4M3


def _agreed_scale(x: torch.Tensor, fmt: Format, group) -> torch.Tensor:
    """One scale for ``x`` on every rank of ``group``: from the largest amax; NaN when any rank's
    ``x`` holds an inf or NaN (a MAX reduction need not propagate NaN, so a flag travels with it)."""
    local = amax(x).float()
    finite = bool(torch.isfinite(local))
    # on x's device, as the all-reduce needs (NCCL has no CPU backend)
    flag = torch.full((), 0.0 if finite else 1.0, device=local.device)
    box = torch.stack([local if finite else torch.zeros_like(local), flag])
    comm.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    if box[1] > 0:
        return torch.full((), math.nan, device=local.device)
    return compute_scale(box[0], fmt)


def agreed_scale_all_gather(x: torch.Tensor, dim: int, group=None, fmt: Format = ACTIVATION_FORMAT) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, sent as ``fmt`` bytes with one
    scale agreed across ``group``; returned in ``x``'s dtype (NaN everywhere if any rank's ``x`` is
    not finite)."""
    _, world = comm.check_group(group)
    scale = _agreed_scale(x, fmt, group)
    leading = x.detach().movedim(dim, 0).contiguous()
    payload = saturating_cast(leading, scale, fmt)
    gathered = torch.empty((world * leading.shape[0], *leading.shape[1:]), dtype=fmt.dtype, device=x.device)
    comm.all_gather(gathered, payload, group)
    return dequantize_payload(gathered, scale.reciprocal()).to(x.dtype).movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None, fmt: Format = REDUCTION_FORMAT) -> torch.Tensor:
    """The sum of ``x`` over ``group``, this rank's slice along ``dim`` (equal slices), sent as FP8
    with one scale per slice and summed in FP32 (`fp8_reduce_scatter`); in ``x``'s dtype."""
    _, world = comm.check_group(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} over {world} ranks: "
            f"make it divisible by the tensor-parallel size"
        )
    leading = x.detach().movedim(dim, 0).contiguous()
    shard = fp8_reduce_scatter(leading, group, fmt=fmt)
    return shard.view(leading.shape[0] // world, *leading.shape[1:]).to(x.dtype).movedim(0, dim)


def _local_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    rank, world = comm.check_group(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot shard dimension {dim} of size {x.shape[dim]} over {world} ranks: "
            f"make it divisible by the tensor-parallel size"
        )
    return x.chunk(world, dim)[rank].contiguous()


class _GatherFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return agreed_scale_all_gather(x, dim, group, ACTIVATION_FORMAT)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.dim, ctx.group, REDUCTION_FORMAT), None, None


class _ReduceScatterToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, group, REDUCTION_FORMAT)

    @staticmethod
    def backward(ctx, grad):
        return agreed_scale_all_gather(grad, ctx.dim, ctx.group, GRADIENT_FORMAT), None, None


class _AllReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return fp8_all_reduce(x, group, fmt=REDUCTION_FORMAT).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return fp8_all_reduce(grad, ctx.group, fmt=REDUCTION_FORMAT).to(grad.dtype), None


class _ScatterToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _local_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return agreed_scale_all_gather(grad, ctx.dim, ctx.group, GRADIENT_FORMAT), None, None


class _ReduceReplicatedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param, group):
        ctx.group = group
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous(), group=ctx.group), None


def gather_from_shards(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Sequence shards -> the whole sequence (E4M3, one agreed scale), for layers whose input
    gradient is a partial sum over the group: backward reduce-scatters it (FP8 per chunk, FP32 sum)."""
    return _GatherFromShards.apply(x, dim, group)


def reduce_scatter_to_shards(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Partial sums -> this rank's shard of their sum along ``dim``; backward all-gathers the
    gradient in E5M2 with one agreed scale."""
    return _ReduceScatterToShards.apply(x, dim, group)


def all_reduce_partial(x: torch.Tensor, group=None) -> torch.Tensor:
    """Partial sums -> their sum on every rank (FP8 per chunk, FP32 sum); backward is the identity."""
    return _AllReducePartial.apply(x, group)


def copy_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """A replicated input entering tensor-parallel layers: the identity forward; backward sums the
    ranks' partial input gradients with the FP8 all-reduce."""
    return _CopyToParallelRegion.apply(x, group)


def scatter_to_shards(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """A replicated tensor -> this rank's slice along ``dim`` (no communication); backward
    all-gathers the gradient in E5M2 with one agreed scale."""
    return _ScatterToShards.apply(x, dim, group)


def reduce_replicated_grad(param: torch.Tensor, group=None) -> torch.Tensor:
    """A replicated parameter used on this rank's shard of the data: the identity forward; backward
    sums its gradient over ``group`` (a plain all-reduce in the parameter's dtype: it is small)."""
    return _ReduceReplicatedGrad.apply(param, group)
