"""FP8 collectives on stock `torch.distributed` (gloo, NCCL): uint8 payloads plus scales.

No backend can sum float8 values, so nothing here asks it to. A reduction is:

1. each rank quantizes each *segment* (a tensor, or a chunk of one) with its own scale and sends
   the uint8 payloads with ``all_to_all_single``: rank ``r`` receives every rank's copy of its
   shard; the scales travel in a small all-gather;
2. rank ``r`` dequantizes and sums its shard in FP32, so the sum never overflows FP8 and ranks
   need not agree on a scale beforehand (reduce-scatter ends here);
3. for an all-reduce, the ranks agree on one output scale per segment (MAX all-reduce of the
   shard amaxes, a few bytes), quantize their shard sums and all-gather the uint8 payloads. Every
   rank dequantizes the same bytes with the same scales, so all ranks hold identical results.

``scaling="shared"`` is the FP8-LM paper's variant instead: one scale per segment from a MAX
all-reduce of the amaxes, inputs pre-multiplied by a factor ``mu``, and the sum quantized with that
same scale, as an FP8 sum on the wire would be; values beyond the format's range saturate and are
counted, which is what `AutoScaler` watches.

A `FlatLayout` places segments in a flat buffer of ``world_size * chunk`` elements; rank ``r``
owns ``[r * chunk, (r + 1) * chunk)``. Contiguous layouts serve data parallelism; owner layouts
(whole tensors per rank) serve FP8 ZeRO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from ..formats import E4M3, Format, format_of
from ..ops.cast import amax as _amax
from ..ops.cast import saturating_cast
from ..ops.gemm import upcast
from ..scaling import compute_scale
from ..tensor import ScalingTensor
from . import accounting

__all__ = [
    "FlatLayout",
    "FP8Reduction",
    "fp8_reduce_scatter",
    "fp8_all_gather",
    "fp8_all_reduce",
    "shared_scale_all_reduce",
    "fp8_all_reduce_error_bound",
    "dequantize_payload",
    "SCALINGS",
]

SCALINGS = ("local", "shared")


# -- layout -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlatLayout:
    """Segments (``lengths``) at ``offsets`` of a flat buffer of ``world_size * chunk`` elements."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    world_size: int
    chunk: int

    @classmethod
    def contiguous(cls, lengths, world_size: int) -> "FlatLayout":
        """Segments back to back, the buffer padded to a multiple of ``world_size``."""
        lengths = tuple(int(n) for n in lengths)
        offsets = tuple(int(sum(lengths[:i])) for i in range(len(lengths)))
        return cls(offsets, lengths, world_size, max(1, math.ceil(sum(lengths) / world_size)))

    @classmethod
    def by_owner(cls, lengths, owners, world_size: int) -> "FlatLayout":
        """Each segment whole inside its owner's shard; shards padded to the largest one."""
        lengths = tuple(int(n) for n in lengths)
        if len(owners) != len(lengths) or any(not 0 <= o < world_size for o in owners):
            raise ValueError(f"need one owner in [0, {world_size}) per segment, got {list(owners)}")
        used = [0] * world_size
        local = []
        for n, o in zip(lengths, owners):
            local.append(used[o])
            used[o] += n
        chunk = max(1, max(used))
        offsets = tuple(o * chunk + at for o, at in zip(owners, local))
        return cls(offsets, lengths, world_size, chunk)

    @property
    def numel(self) -> int:
        return self.world_size * self.chunk

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(segment, start, stop)`` for the parts of segments in ``rank``'s shard; start and
        stop are positions in the shard."""
        return self._pieces[rank]

    @cached_property
    def _pieces(self) -> list[list[tuple[int, int, int]]]:
        out: list[list[tuple[int, int, int]]] = [[] for _ in range(self.world_size)]
        for s, (off, n) in enumerate(zip(self.offsets, self.lengths)):
            pos, end = off, off + n
            while pos < end:
                r = pos // self.chunk
                stop = min(end, (r + 1) * self.chunk)
                out[r].append((s, pos - r * self.chunk, stop - r * self.chunk))
                pos = stop
        return out


# -- accounted collectives ------------------------------------------------------------------
def _check_group(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call fp8lm.distributed.setup() (or "
            "torch.distributed.init_process_group) before an FP8 collective"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_to_all(out, inp, group, async_op=False):
    accounting.record("all_to_all", _bytes(inp), dist.get_world_size(group))
    return dist.all_to_all_single(out, inp, group=group, async_op=async_op)


def _all_gather(out, inp, group, async_op=False):
    accounting.record("all_gather", _bytes(out), dist.get_world_size(group))
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def _all_reduce(t, op, group):
    accounting.record("all_reduce", _bytes(t), dist.get_world_size(group))
    dist.all_reduce(t, op=op, group=group)
    return t


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, ScalingTensor):
        return t.dequantize(torch.float32)
    return t.detach().to(torch.float32)


def _segment_amax(t: torch.Tensor) -> torch.Tensor:
    """amax of a tensor, +inf when it holds a NaN or inf (a non-finite value must reach every
    rank's result, so it wins the MAX all-reduce)."""
    a = _amax(_as_fp32(t))
    return torch.where(torch.isfinite(a), a, torch.full_like(a, math.inf))


def dequantize_payload(payload: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``payload * scale_inv`` in FP32 (exact down to BF16's smallest subnormal, 2**-133), for a
    finite FP8 payload off the wire (a payload that may hold inf/NaN codes always travels with a
    NaN scale, which makes the result NaN).

    Goes through `fp8lm.ops.gemm.upcast`'s integer rebuild of the BF16 bits: every FP8 value
    times a power of two is a BF16 value, and torch's own float8 conversion is scalar on CPU
    (measured 107 ms for 10M elements to FP32, against 19 ms + a vectorized BF16 -> FP32).
    """
    return upcast(payload, scale_inv, torch.bfloat16, finite=True).to(torch.float32)


# -- the reduction engine -------------------------------------------------------------------
class FP8Reduction:
    """One FP8 reduction of a list of tensors (the segments of ``layout``), in stages so that a
    caller can overlap the all-to-all with other work:

    ``start()`` quantizes and launches the payload all-to-all (asynchronously), ``reduce()``
    waits and returns this rank's FP32 shard of the sum, ``start_gather()`` quantizes the shard
    and launches the all-gather, ``results()`` waits and returns one `ScalingTensor` per segment.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        layout: FlatLayout,
        group=None,
        fmt: Format | str = E4M3,
        scaling: str = "local",
        mu: float = 1.0,
        average: bool = False,
    ):
        self.rank, self.world_size = _check_group(group)
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        self.fmt = format_of(fmt)
        if not self.fmt.is_fp8:
            raise ValueError(f"FP8 collectives send FP8 payloads; fmt must be E4M3 or E5M2, got {self.fmt}")
        if layout.world_size != self.world_size:
            raise ValueError(f"layout is for {layout.world_size} ranks but the group has {self.world_size}")
        if len(tensors) != layout.num_segments or any(
            t.numel() != n for t, n in zip(tensors, layout.lengths)
        ):
            raise ValueError("tensors do not match the layout's segment lengths")
        if not mu > 0 or not math.isfinite(mu):
            raise ValueError(f"mu must be a finite positive number, got {mu}")
        self.tensors, self.layout, self.group = tensors, layout, group
        self.scaling, self.mu, self.average = scaling, float(mu), average
        # Shared scaling puts mu * (sum over ranks) on the wire; the mean is taken after.
        self._wire_factor = float(mu) * (self.world_size if average else 1) if scaling == "shared" else 1.0
        self.saturated = 0  # values this rank saturated (shared scaling only)
        self._works: list = []

    # stage 1 ---------------------------------------------------------------------------------
    def start(self) -> "FP8Reduction":
        if self.scaling == "shared":
            amax = torch.stack([_segment_amax(t) for t in self.tensors]) if self.tensors else torch.zeros(0)
            _all_reduce(amax, dist.ReduceOp.MAX, self.group)
            self.in_scales = compute_scale(amax, self.fmt)
            # A segment that is non-finite somewhere becomes NaN everywhere.
            self.in_scales[~torch.isfinite(amax)] = math.nan
        payload, scales = self._pack()
        self._recv = torch.empty_like(payload)
        self._works = [_all_to_all(self._recv, payload, self.group, async_op=True)]
        if self.scaling == "local":
            self._all_scales = torch.empty(self.world_size * scales.numel(), dtype=torch.float32)
            self._works.append(_all_gather(self._all_scales, scales, self.group, async_op=True))
        return self

    def _pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 payload of the whole flat buffer and the scale of each segment."""
        flat = torch.zeros(self.layout.numel, dtype=self.fmt.dtype)
        scales = torch.ones(self.layout.num_segments, dtype=torch.float32)
        for s, (t, off, n) in enumerate(zip(self.tensors, self.layout.offsets, self.layout.lengths)):
            dst = flat[off : off + n]
            if self.scaling == "shared":
                value = _as_fp32(t).reshape(-1) * self.mu
                scale = self.in_scales[s]
                self.saturated += int((value.abs() * scale > self.fmt.max).sum())
                dst.copy_(saturating_cast(value, scale, self.fmt))
            elif isinstance(t, ScalingTensor) and t.payload.dtype == self.fmt.dtype:
                dst.copy_(t.payload.reshape(-1))  # already in the wire format: send as is
                finite = torch.isfinite(_amax(t.payload)) & torch.isfinite(t.scale)
                scales[s] = t.scale if finite else math.nan
            else:
                value = _as_fp32(t).reshape(-1)
                a = _amax(value)
                scales[s] = compute_scale(a, self.fmt) if torch.isfinite(a) else math.nan
                dst.copy_(saturating_cast(value, scales[s], self.fmt))
        return flat.view(torch.uint8), scales

    # stage 2 ---------------------------------------------------------------------------------
    def reduce(self) -> torch.Tensor:
        """This rank's shard of the sum (or mean) in FP32: ``layout.chunk`` elements."""
        for w in self._works:
            w.wait()
        chunk, S = self.layout.chunk, self.layout.num_segments
        recv = self._recv.view(self.fmt.dtype).view(self.world_size, chunk)
        if self.scaling == "local":
            scales = self._all_scales.view(self.world_size, S)
        else:
            scales = self.in_scales.expand(self.world_size, S)
        shard = torch.zeros(chunk, dtype=torch.float32)
        inv = scales.reciprocal()
        for s, a, b in self.layout.pieces(self.rank):
            for i in range(self.world_size):  # fixed order: the same sum on every run
                shard[a:b] += dequantize_payload(recv[i, a:b], inv[i, s])
        self._recv = None
        if self.scaling == "shared":
            shard /= self._wire_factor
        elif self.average:
            shard /= self.world_size
        self.shard = shard
        return shard

    # stage 3 ---------------------------------------------------------------------------------
    def start_gather(self) -> "FP8Reduction":
        """Quantize the shard sum and launch the all-gather of the payloads."""
        S = self.layout.num_segments
        pieces = self.layout.pieces(self.rank)
        if self.scaling == "local":
            amax = torch.zeros(S, dtype=torch.float32)
            for s, a, b in pieces:
                amax[s] = torch.maximum(amax[s], _segment_amax(self.shard[a:b]))
            _all_reduce(amax, dist.ReduceOp.MAX, self.group)
            self.out_scales = compute_scale(amax, self.fmt)
            self.out_scales[~torch.isfinite(amax)] = math.nan
        else:
            # The paper's FP8 sum: mu * sum quantized with the shared scale.
            self.out_scales = self.in_scales
        out = torch.zeros(self.layout.chunk, dtype=self.fmt.dtype)
        for s, a, b in pieces:
            value = self.shard[a:b] * self._wire_factor if self._wire_factor != 1 else self.shard[a:b]
            if self.scaling == "shared":
                self.saturated += int((value.abs() * self.out_scales[s] > self.fmt.max).sum())
            out[a:b] = saturating_cast(value, self.out_scales[s], self.fmt)
        self.shard = None
        self._gathered = torch.empty(self.layout.numel, dtype=torch.uint8)
        self._works = [_all_gather(self._gathered, out.view(torch.uint8), self.group, async_op=True)]
        return self

    def results(self) -> list[ScalingTensor]:
        """The reduced segments, identical on every rank; a segment in which any rank had a
        non-finite value comes back with a NaN scale, so all its values read as NaN."""
        for w in self._works:
            w.wait()
        flat = self._gathered.view(self.fmt.dtype)
        out = []
        for s, (t, off, n) in enumerate(zip(self.tensors, self.layout.offsets, self.layout.lengths)):
            scale = self.out_scales[s] * self._wire_factor  # NaN for a non-finite segment
            out.append(ScalingTensor(flat[off : off + n].view(t.shape), scale.clone(), torch.float32))
        return out

    def global_saturated(self) -> int:
        """Values saturated on all ranks together (one small SUM all-reduce; same on every rank)."""
        count = torch.tensor([self.saturated], dtype=torch.int64)
        _all_reduce(count, dist.ReduceOp.SUM, self.group)
        return int(count)


# -- single-tensor API ----------------------------------------------------------------------
def _chunks(x: torch.Tensor, world_size: int) -> tuple[list[torch.Tensor], FlatLayout]:
    flat = x.detach().reshape(-1)
    chunk = max(1, math.ceil(flat.numel() / world_size))
    pieces = list(flat.split(chunk))
    return pieces, FlatLayout.contiguous([p.numel() for p in pieces], world_size)


def _check_tensor(x, name="x") -> None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x))}")


def fp8_reduce_scatter(
    x: torch.Tensor, group=None, fmt: Format | str = E4M3, average: bool = False
) -> torch.Tensor:
    """Sum (or mean) of ``x`` over the ranks, this rank's shard only, in FP32.

    ``x`` is flattened and cut into ``world_size`` chunks of ``ceil(numel / world_size)``
    elements, each quantized with its own scale; rank ``r`` gets chunk ``r`` (the last one
    shorter when the size does not divide).
    """
    _check_tensor(x)
    rank, world = _check_group(group)
    pieces, layout = _chunks(x, world)
    shard = FP8Reduction(pieces, layout, group, fmt, average=average).start().reduce()
    n = sum(b - a for _, a, b in layout.pieces(rank))
    return shard[:n]


def fp8_all_gather(shard: torch.Tensor, group=None, fmt: Format | str = E4M3) -> torch.Tensor:
    """Every rank's ``shard`` concatenated in rank order, sent as FP8 with one scale per shard.

    All ranks must pass shards of the same size. A `ScalingTensor` shard whose payload is already
    ``fmt`` is sent as is; others are quantized with a scale from their amax.
    """
    _check_tensor(shard, "shard")
    rank, world = _check_group(group)
    fmt = format_of(fmt)
    size = torch.tensor([shard.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    accounting.record("all_gather", size.element_size() * world, world)
    dist.all_gather(sizes, size, group=group)
    if len({int(s) for s in sizes}) != 1:
        raise ValueError(f"fp8_all_gather needs equal shard sizes on every rank, got {[int(s) for s in sizes]}")
    if isinstance(shard, ScalingTensor) and shard.payload.dtype == fmt.dtype:
        payload, scale = shard.payload.reshape(-1), shard.scale.reshape(1)
    else:
        value = _as_fp32(shard).reshape(-1)
        scale = compute_scale(_amax(value), fmt).reshape(1)
        payload = saturating_cast(value, scale, fmt)
    gathered = torch.empty(world * shard.numel(), dtype=torch.uint8)
    scales = torch.empty(world, dtype=torch.float32)
    _all_gather(gathered, payload.contiguous().view(torch.uint8), group)
    _all_gather(scales, scale.to(torch.float32), group)
    parts = gathered.view(fmt.dtype).view(world, -1)
    return torch.cat([dequantize_payload(parts[r], scales[r].reciprocal()) for r in range(world)])


def fp8_all_reduce(
    x: torch.Tensor, group=None, fmt: Format | str = E4M3, average: bool = False
) -> torch.Tensor:
    """Sum (or mean) of ``x`` over the ranks as a reduce-scatter plus an all-gather of FP8
    payloads with per-chunk scales; a float32 tensor of ``x``'s shape, identical on every rank.

    Error: with ``u = 2**-(mantissa bits + 1)`` (1/16 for E4M3) and ``x_i`` the ranks' inputs,
    each element is within ``u * (sum|x_i| + |y|)`` of the exact result ``y``, plus half the
    smallest subnormal step of each quantization (see docs/distributed.md).
    """
    _check_tensor(x)
    _, world = _check_group(group)
    pieces, layout = _chunks(x, world)
    red = FP8Reduction(pieces, layout, group, fmt, average=average).start()
    red.reduce()
    out = red.start_gather().results()
    return torch.cat([dequantize_payload(p.payload, p.scale_inv) for p in out]).view(x.shape)


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
    _check_group(group)
    flat = x.detach().reshape(-1)
    layout = FlatLayout.contiguous([flat.numel()], dist.get_world_size(group))
    red = FP8Reduction([flat], layout, group, fmt, scaling="shared", mu=mu, average=average).start()
    red.reduce()
    (out,) = red.start_gather().results()
    return dequantize_payload(out.payload, out.scale_inv).view(x.shape), red.global_saturated()


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
