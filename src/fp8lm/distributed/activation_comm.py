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

Under the rowwise, blockwise and mxfp8 recipes (`gathers_in_blocks`) an all-gather whose
consumer is a layer of that recipe sends instead what the layer will quantize: each row of the
last dimension as the recipe's operand of that role (`block_all_gather`; E4M3 with one scale per
row, per 1 x 128 or per 1 x 32 tile, mxfp8's rounded up: `wire_recipe`). Those blocks lie within
one rank's rows, so each rank quantizes its own and the gathered operand is the whole tensor's,
bit for bit: the layer's quantization of the gathered values gives the same values again (no
second rounding; mxfp8: above E4M3's subnormals), and no scale is agreed (no all-reduce).

Each function here is an autograd pair: the forward collective and the backward one that its
gradient needs (a gather's gradient is a reduce-scatter, a reduce-scatter's is a gather).

With ``fp8=False`` (what the parallel styles pass for layers switched to high precision: a
fallback, precision annealing) both travel in the tensor's own dtype instead, the reductions
summed in FP32 (`plain_all_gather`, `plain_reduce_scatter`, `plain_all_reduce`): the switched
layer then takes and gives the values one process would.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..block_tensor import decoded_scales, pow2_scales
from ..formats import E4M3, E5M2, Format
from ..ops.cast import amax, saturating_cast
from ..ops.finegrained import BlockOperand, quantize_operand
from ..recipe import Recipe
from ..scaling import compute_scale
from . import comm
from .collectives import fp8_all_reduce, fp8_reduce_scatter
from .reduction import dequantize_payload

__all__ = [
    "ACTIVATION_FORMAT",
    "GRADIENT_FORMAT",
    "REDUCTION_FORMAT",
    "agreed_scale_all_gather",
    "block_all_gather",
    "gathers_in_blocks",
    "wire_recipe",
    "reduce_scatter_along",
    "plain_all_gather",
    "plain_reduce_scatter",
    "plain_all_reduce",
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
    # On x's device, as the all-reduce needs (NCCL has no CPU backend), and chosen there: reading
    # the flag on the host would sync it at every gather.
    finite = torch.isfinite(local)
    box = torch.stack([torch.where(finite, local, torch.zeros_like(local)), (~finite).float()])
    comm.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return torch.where(box[1] > 0, torch.full_like(box[0], math.nan), compute_scale(box[0], fmt))


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


def gathers_in_blocks(recipe: Recipe | None, dim: int, ndim: int) -> bool:
    """Whether an all-gather along ``dim`` of an ``ndim``-D tensor for a layer of ``recipe`` sends
    the recipe's operand (`block_all_gather`): rowwise, blockwise or mxfp8, along any dimension
    but the last (whose rows the blocks lie in). Not nvfp4: its per-tensor scale needs the whole
    tensor's amax, and the layer rounds its gradients stochastically."""
    if recipe is None or recipe.granularity not in ("rowwise", "blockwise", "mxfp8"):
        return False
    return dim % ndim != ndim - 1


def wire_recipe(recipe: Recipe) -> Recipe:
    """The recipe `block_all_gather` quantizes with for a layer of ``recipe``: the recipe itself,
    but mxfp8 with round-up scales (``mx_rounding="rceil"``).

    Why: mxfp8's default floor scales (the OCP rule) saturate a block's largest values by up to an
    eighth. Sent so, the clipped values would reach the layer's weight-gradient GEMM, which
    quantizes the gathered values again along the tokens, where one process quantizes the
    unclipped ones: a bias (on the main job, 6 steps on 2 ranks ended further from one process for
    5 seeds of 5). Round-up scales clip nothing, and the layer's floor quantization of their values
    is one process's operand: where the floor scale is half the round-up one, it doubles each
    value, exact above E4M3's subnormals (``2**-6`` of the round-up scale)."""
    if recipe.granularity == "mxfp8" and recipe.mx_rounding == "floor":
        return recipe.replace(mx_rounding="rceil")
    return recipe


def block_all_gather(x: torch.Tensor, dim: int, recipe: Recipe, role: str, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (not the last), each rank's rows of the last
    dimension sent as ``recipe``'s ``role`` operand (`fp8lm.ops.finegrained.quantize_operand`
    along them, with `wire_recipe`: E4M3 bytes, and the scales of its rows or tiles, as E8M0
    bytes where they are powers of two) in one all-gather; returned as the gathered operand's
    values in ``x``'s dtype, from which the layer's quantization gives its operand of the whole
    tensor (module doc)."""
    if not gathers_in_blocks(recipe, dim, x.dim()):
        raise ValueError(
            "block_all_gather takes rowwise, blockwise or mxfp8 (gathers_in_blocks), along a dimension "
            f"other than the last; got {recipe}, dim {dim} of {x.dim()}"
        )
    _, world = comm.check_group(group)
    leading = x.detach().movedim(dim, 0).contiguous()
    op = quantize_operand(leading.reshape(-1, leading.shape[-1]), wire_recipe(recipe), role, dim=1)
    e8m0 = pow2_scales(recipe)  # powers of two travel as their exponent byte, exactly
    scales = op.d.to(torch.float8_e8m0fnu) if e8m0 else op.d.contiguous()
    payload, scale_bytes = op.payload.contiguous().view(torch.uint8), scales.view(torch.uint8)
    sizes = [payload.numel(), scale_bytes.numel()]
    gathered = torch.empty((world, sum(sizes)), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered.view(-1), torch.cat([payload.reshape(-1), scale_bytes.reshape(-1)]), group)
    payloads, scale_rows = gathered.split(sizes, dim=1)
    d = scale_rows.contiguous()
    whole = BlockOperand(
        payloads.contiguous().view(op.payload.dtype).view(-1, op.payload.shape[1]),
        (decoded_scales(d) if e8m0 else d.view(torch.float32)).view(-1, op.d.shape[1]),
        op.block,
    )
    values = whole.dequantize().to(x.dtype).view(world * leading.shape[0], *leading.shape[1:])
    return values.movedim(0, dim)


def _gather(x: torch.Tensor, dim: int, group, fmt: Format, recipe: Recipe | None, role: str) -> torch.Tensor:
    """`block_all_gather` where the recipe takes it (`gathers_in_blocks`), else `agreed_scale_all_gather`."""
    if gathers_in_blocks(recipe, dim, x.dim()):
        assert recipe is not None  # gathers_in_blocks says so
        return block_all_gather(x, dim, recipe, role, group)
    return agreed_scale_all_gather(x, dim, group, fmt)


def _reduce_scatter_input(x: torch.Tensor, dim: int, group) -> tuple[torch.Tensor, int]:
    """``x`` with ``dim`` moved first (contiguous, detached), and the group's size, which must
    divide that dimension: what a reduce-scatter along ``dim`` sends."""
    _, world = comm.check_group(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} over {world} ranks: "
            f"make it divisible by the tensor-parallel size"
        )
    return x.detach().movedim(dim, 0).contiguous(), world


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None, fmt: Format = REDUCTION_FORMAT) -> torch.Tensor:
    """The sum of ``x`` over ``group``, this rank's slice along ``dim`` (equal slices), sent as FP8
    with one scale per slice and summed in FP32 (`fp8_reduce_scatter`); in ``x``'s dtype."""
    leading, world = _reduce_scatter_input(x, dim, group)
    shard = fp8_reduce_scatter(leading, group, fmt=fmt)
    return shard.view(leading.shape[0] // world, *leading.shape[1:]).to(x.dtype).movedim(0, dim)


def plain_all_gather(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, in ``x``'s dtype."""
    _, world = comm.check_group(group)
    leading = x.detach().movedim(dim, 0).contiguous()
    gathered = torch.empty((world * leading.shape[0], *leading.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(gathered, leading, group)
    return gathered.movedim(0, dim)


def plain_reduce_scatter(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The sum of ``x`` over ``group``, this rank's slice along ``dim`` (equal slices): each slice
    sent to its rank in ``x``'s dtype (an all-to-all) and summed there in FP32; in ``x``'s dtype."""
    leading, world = _reduce_scatter_input(x, dim, group)
    rows = leading.view(world, -1)
    total = comm.all_to_all(torch.empty_like(rows), rows, group).float().sum(0)
    return total.view(leading.shape[0] // world, *leading.shape[1:]).to(x.dtype).movedim(0, dim)


def plain_all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``x`` over ``group`` on every rank, in FP32 on the wire; in ``x``'s dtype."""
    total = x.detach().float().contiguous()
    comm.all_reduce(total, group=group)
    return total.to(x.dtype)


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
    def forward(ctx, x, dim, group, recipe, fp8):
        ctx.dim, ctx.group, ctx.fp8 = dim, group, fp8
        if not fp8:
            return plain_all_gather(x, dim, group)
        return _gather(x, dim, group, ACTIVATION_FORMAT, recipe, "input")

    @staticmethod
    def backward(ctx, grad):
        if not ctx.fp8:
            return plain_reduce_scatter(grad, ctx.dim, ctx.group), None, None, None, None
        return reduce_scatter_along(grad, ctx.dim, ctx.group, REDUCTION_FORMAT), None, None, None, None


class _ReduceScatterToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, recipe, fp8):
        ctx.dim, ctx.group, ctx.recipe, ctx.fp8 = dim, group, recipe, fp8
        if not fp8:
            return plain_reduce_scatter(x, dim, group)
        return reduce_scatter_along(x, dim, group, REDUCTION_FORMAT)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.fp8:
            return plain_all_gather(grad, ctx.dim, ctx.group), None, None, None, None
        return _gather(grad, ctx.dim, ctx.group, GRADIENT_FORMAT, ctx.recipe, "grad_output"), None, None, None, None


class _AllReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, fp8):
        if not fp8:
            return plain_all_reduce(x, group)
        return fp8_all_reduce(x, group, fmt=REDUCTION_FORMAT).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _CopyToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, fp8):
        ctx.group, ctx.fp8 = group, fp8
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.fp8:
            return plain_all_reduce(grad, ctx.group), None, None
        return fp8_all_reduce(grad, ctx.group, fmt=REDUCTION_FORMAT).to(grad.dtype), None, None


class _ScatterToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, fp8):
        ctx.dim, ctx.group, ctx.fp8 = dim, group, fp8
        return _local_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.fp8:
            return plain_all_gather(grad, ctx.dim, ctx.group), None, None, None
        return agreed_scale_all_gather(grad, ctx.dim, ctx.group, GRADIENT_FORMAT), None, None, None


class _ReduceReplicatedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param, group):
        ctx.group = group
        # A copy, not a view: tracing the view, dynamo stopped ("a view ... created inside a
        # custom Function ... modified inplace"); the copy is of a bias, small.
        return param.clone()

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous(), group=ctx.group), None


def gather_from_shards(
    x: torch.Tensor, dim: int, group=None, recipe: Recipe | None = None, fp8: bool = True
) -> torch.Tensor:
    """Sequence shards -> the whole sequence (E4M3, one agreed scale; or, for layers of a ``recipe``
    that gathers in blocks, `gathers_in_blocks`, as their input operand: `block_all_gather`), for
    layers whose input gradient is a partial sum over the group: backward reduce-scatters it (FP8
    per chunk, FP32 sum). ``fp8=False``: both in the tensors' own dtype (module docstring)."""
    return _GatherFromShards.apply(x, dim, group, recipe, fp8)


def reduce_scatter_to_shards(
    x: torch.Tensor, dim: int, group=None, recipe: Recipe | None = None, fp8: bool = True
) -> torch.Tensor:
    """Partial sums -> this rank's shard of their sum along ``dim``; backward all-gathers the
    gradient in E5M2 with one agreed scale (or, for the output of a layer of a ``recipe`` that
    gathers in blocks, `gathers_in_blocks`, as that layer's output-gradient operand).
    ``fp8=False``: both in the tensors' own dtype, summed in FP32 (module docstring)."""
    return _ReduceScatterToShards.apply(x, dim, group, recipe, fp8)


def all_reduce_partial(x: torch.Tensor, group=None, fp8: bool = True) -> torch.Tensor:
    """Partial sums -> their sum on every rank (FP8 per chunk, FP32 sum; ``fp8=False``: FP32);
    backward is the identity."""
    return _AllReducePartial.apply(x, group, fp8)


def copy_to_parallel_region(x: torch.Tensor, group=None, fp8: bool = True) -> torch.Tensor:
    """A replicated input entering tensor-parallel layers: the identity forward; backward sums the
    ranks' partial input gradients with the FP8 all-reduce (``fp8=False``: in FP32)."""
    return _CopyToParallelRegion.apply(x, group, fp8)


def scatter_to_shards(x: torch.Tensor, dim: int, group=None, fp8: bool = True) -> torch.Tensor:
    """A replicated tensor -> this rank's slice along ``dim`` (no communication); backward
    all-gathers the gradient in E5M2 with one agreed scale (``fp8=False``: in its own dtype)."""
    return _ScatterToShards.apply(x, dim, group, fp8)


def reduce_replicated_grad(param: torch.Tensor, group=None) -> torch.Tensor:
    """A replicated parameter used on this rank's shard of the data: the identity forward; backward
    sums its gradient over ``group`` (a plain all-reduce in the parameter's dtype: it is small)."""
    return _ReduceReplicatedGrad.apply(param, group)
