"""FP8 collectives on one tensor, on stock `torch.distributed` (gloo, NCCL): uint8 payloads plus
scales, reduced in FP32 by the engine in `fp8lm.distributed.reduction`; and the error bound of the
FP8 all-reduce; and the BF16 all-reduce of the gradients kept out of FP8 (`sent_in_bf16`).
"""

from __future__ import annotations

import math

import torch

from ..formats import E4M3, Format, format_of
from . import comm
from .reduction import BF16Reduction, FlatLayout, FP8Reduction, dequantize_payload, quantize_segment

__all__ = [
    "fp8_reduce_scatter",
    "fp8_all_gather",
    "fp8_all_reduce",
    "bf16_all_reduce",
    "shared_scale_all_reduce",
    "fp8_all_reduce_error_bound",
]


# -- single-tensor API ----------------------------------------------------------------------
def _chunks(x: torch.Tensor, world_size: int) -> tuple[list[torch.Tensor], FlatLayout]:
    flat = x.detach().reshape(-1)
    chunk = max(1, math.ceil(flat.numel() / world_size))
    pieces = list(flat.split(chunk))
    return pieces, FlatLayout.contiguous([p.numel() for p in pieces], world_size)


def _check_tensor(x, name="x") -> None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x))}")


def fp8_reduce_scatter(x: torch.Tensor, group=None, fmt: Format | str = E4M3, average: bool = False) -> torch.Tensor:
    """Sum (or mean) of ``x`` over the ranks, this rank's shard only, in FP32.

    ``x`` is flattened and cut into ``world_size`` chunks of ``ceil(numel / world_size)``
    elements, each quantized with its own scale; rank ``r`` gets chunk ``r`` (the last one
    shorter when the size does not divide).
    """
    _check_tensor(x)
    rank, world = comm.check_group(group)
    pieces, layout = _chunks(x, world)
    shard = FP8Reduction(pieces, layout, group, fmt, average=average).start().reduce()
    n = sum(b - a for _, a, b in layout.pieces(rank))
    return shard[:n]


def fp8_all_gather(shard: torch.Tensor, group=None, fmt: Format | str = E4M3) -> torch.Tensor:
    """Every rank's ``shard`` concatenated in rank order, sent as FP8 with one scale per shard.

    All ranks must pass shards of the same size. A `ScalingTensor` shard whose payload is already
    ``fmt`` is sent as is; others are quantized with a scale from their amax. A shard holding a
    NaN or inf comes back as NaN.
    """
    _check_tensor(shard, "shard")
    _, world = comm.check_group(group)
    fmt = format_of(fmt)
    device = shard.device  # of every buffer handed to a collective: NCCL has no CPU backend
    numel = torch.tensor([shard.numel()], device=device)
    sizes = comm.all_gather(torch.empty(world, dtype=torch.int64, device=device), numel, group)
    if len(set(sizes.tolist())) != 1:
        raise ValueError(f"fp8_all_gather needs equal shard sizes on every rank, got {sizes.tolist()}")
    payload = torch.empty(shard.numel(), dtype=fmt.dtype, device=device)
    scale = quantize_segment(shard, fmt, payload).reshape(1)
    gathered = torch.empty(world * shard.numel(), dtype=fmt.dtype, device=device)
    scales = torch.empty(world, dtype=torch.float32, device=device)
    comm.all_gather(gathered, payload, group)
    comm.all_gather(scales, scale, group)
    parts = gathered.view(world, -1)
    return torch.cat([dequantize_payload(parts[r], scales[r].reciprocal()) for r in range(world)])


def fp8_all_reduce(x: torch.Tensor, group=None, fmt: Format | str = E4M3, average: bool = False) -> torch.Tensor:
    """Sum (or mean) of ``x`` over the ranks as a reduce-scatter plus an all-gather of FP8
    payloads with per-chunk scales; a float32 tensor of ``x``'s shape, identical on every rank.

    Error: with ``u = 2**-(mantissa bits + 1)`` (1/16 for E4M3) and ``x_i`` the ranks' inputs,
    each element is within ``u * (sum|x_i| + |y|)`` of the exact result ``y``, plus half the
    smallest subnormal step of each quantization (see docs/distributed.md).
    """
    _check_tensor(x)
    _, world = comm.check_group(group)
    pieces, layout = _chunks(x, world)
    red = FP8Reduction(pieces, layout, group, fmt, average=average).start()
    red.reduce()
    return torch.cat(red.start_gather().dequantized_results()).view(x.shape)


def bf16_all_reduce(x: torch.Tensor, group=None, average: bool = False) -> torch.Tensor:
    """Sum (or mean) of ``x`` over the ranks with BF16 on the wire, summed in FP32: a reduce-scatter
    (all-to-all) plus an all-gather, as `fp8_all_reduce`; a BF16 tensor of ``x``'s shape, identical
    on every rank. For the gradients that `sent_in_bf16` keeps out of FP8."""
    _check_tensor(x)
    _, world = comm.check_group(group)
    layout = FlatLayout.contiguous([x.numel()], world)
    red = BF16Reduction([x], layout, group, average=average).start()
    red.reduce()
    return red.start_gather().results()[0]


def shared_scale_all_reduce(
    x: torch.Tensor, group=None, fmt: Format | str = E4M3, mu: float = 1.0, average: bool = False
) -> tuple[torch.Tensor, int]:
    """The paper's FP8 all-reduce: one scale from a MAX all-reduce of the ranks' amaxes, ``x * mu``
    quantized with it, summed as FP8 with that same scale, divided by ``mu`` at the end.

    ``mu = 1`` is post-scaling (the sum may saturate), ``mu = 1/world_size`` pre-scaling (small
    values underflow). Returns the float32 result (identical on every rank) and the number of
    values that saturated on all ranks together.
    """
    _check_tensor(x)
    _, world = comm.check_group(group)
    flat = x.detach().reshape(-1)
    layout = FlatLayout.contiguous([flat.numel()], world)
    red = FP8Reduction([flat], layout, group, fmt, scaling="shared", mu=mu, average=average).start()
    red.reduce()
    (out,) = red.start_gather().dequantized_results()
    return out.view(x.shape), red.global_saturated()


def fp8_all_reduce_error_bound(
    inputs: list[torch.Tensor], fmt: Format | str = E4M3, average: bool = False, segment: int | None = None
) -> torch.Tensor:
    """Elementwise bound (float64) on ``|fp8_all_reduce(x) - sum_i x_i|`` for rank inputs ``inputs``.

    A quantization with power-of-two scale ``s`` (chosen from amax ``A``, so ``1/s <= 2A/max``)
    errs by at most ``u|v| + h/s``, with ``u`` the unit roundoff (half the format's eps) and ``h``
    half its smallest subnormal step. The inputs are quantized per chunk, summed in FP32 (error
    ``e32``) and the sum quantized again, so with ``E1 = sum_i (u|x_i| + 2hA_i/max) + e32``:
    ``|err| <= (1 + u) E1 + u|y| + 2h(1 + 2u)(sum_i A_i)/max``; divided by N for a mean.
    ``segment``: elements per scaled segment, ``ceil(numel / N)`` (`fp8_all_reduce`'s chunks) by
    default; the whole tensor for the per-tensor scales of `FP8DataParallel`.
    """
    fmt = format_of(fmt)
    fi = torch.finfo(fmt.dtype)
    u, h = fi.eps / 2, fi.smallest_normal * fi.eps / 2
    world = len(inputs)
    xs = torch.stack([x.detach().reshape(-1).to(torch.float64) for x in inputs])
    chunk = segment or max(1, math.ceil(xs.shape[1] / world))
    abs_sum = xs.abs().sum(0)
    y = xs.sum(0)
    chunk_amax = torch.stack([a.abs().amax(1) for a in xs.split(chunk, dim=1)], 1)  # [rank, chunk]
    amax = chunk_amax.repeat_interleave(chunk, dim=1)[:, : xs.shape[1]]
    e32 = 2.0**-24 * (world + 1) * (1 + u) * abs_sum
    e1 = u * abs_sum + (2 * h / fmt.max) * amax.sum(0) + e32
    bound = (1 + u) * e1 + u * y.abs() + 2 * h * (1 + 2 * u) * amax.sum(0) / fmt.max
    return (bound / world if average else bound).view(inputs[0].shape)
