"""The FP8 reduction engine under every FP8 collective: a flat layout of segments, the staged
reduction, and its two scaling modes.

No backend can sum float8 values, so nothing here asks it to. A reduction is:

1. each rank quantizes each *segment* (a tensor, or a chunk of one) and sends the uint8 payloads
   with one all-to-all: rank ``r`` receives every rank's copy of its shard;
2. rank ``r`` dequantizes and sums its shard in FP32, so the sum never overflows FP8 (a
   reduce-scatter ends here);
3. for an all-reduce, the shard sums are quantized with one output scale per segment that all
   ranks agree on, and the uint8 payloads all-gathered. Every rank dequantizes the same bytes with
   the same scales, so all ranks hold identical results.

How the scales are chosen is the reduction's *scaling*: `LocalScaling` (``"local"``: each rank
scales its own segments, the scales travel in a small all-gather, the output scales come from a
MAX all-reduce of the shard amaxes; nothing saturates) or `SharedScaling` (``"shared"``, the
FP8-LM paper's: one scale per segment from a MAX all-reduce of the amaxes, inputs multiplied by a
factor ``mu``, and the sum quantized with that same scale, as an FP8 sum on the wire would be;
values beyond the format's range saturate and are counted, which is what `AutoScaler` watches).

`BF16Reduction` runs the same stages with BF16 on the wire and no scales, for the gradients
that `sent_in_bf16` keeps out of FP8: those the policy stores in 16 bits (the output head's) and
those of layers switched to high precision.

A `FlatLayout` places segments in a flat buffer of ``world_size * chunk`` elements; rank ``r``
owns ``[r * chunk, (r + 1) * chunk)``. The all-to-all sends each rank the part of its shard that
segments fill, not the padding after it. Contiguous layouts serve data parallelism; owner layouts
(whole tensors per rank) serve FP8 ZeRO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..formats import E4M3, Format, format_of
from ..grad import stores_grad_in_16_bits
from ..ops.cast import amax, saturating_cast, upcast
from ..scaling import compute_scale
from ..tensor import ScalingTensor, switched_to_high_precision
from . import comm

__all__ = [
    "FlatLayout",
    "FP8Reduction",
    "BF16Reduction",
    "sent_in_bf16",
    "split_by_wire",
    "LocalScaling",
    "SharedScaling",
    "SCALINGS",
    "scaling_strategy",
    "quantize_segment",
    "scale_or_nan",
    "dequantize_payload",
]

SCALINGS = ("local", "shared")


@dataclass(frozen=True)
class FlatLayout:
    """Segments (``lengths``) at ``offsets`` of a flat buffer of ``world_size * chunk`` elements."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    world_size: int
    chunk: int
    # per rank, (segment, start, stop) of the parts in its shard: computed once, with the layout
    # (a reduction reads it at every step; not a cached_property, whose lock dynamo cannot trace)
    _pieces: tuple[list[tuple[int, int, int]], ...] = field(init=False, repr=False, compare=False)
    _filled: tuple[int, ...] = field(init=False, repr=False, compare=False)  # `filled`, per rank

    def __post_init__(self) -> None:
        pieces = tuple(self._rank_pieces(r) for r in range(self.world_size))
        object.__setattr__(self, "_pieces", pieces)
        # a list's max, not a generator's with a default: dynamo traces layouts made in compiled code
        object.__setattr__(self, "_filled", tuple(max([0] + [b for _, _, b in p]) for p in pieces))

    @classmethod
    def contiguous(cls, lengths, world_size: int) -> FlatLayout:
        """Segments back to back, the buffer padded to a multiple of ``world_size``."""
        lengths = tuple(int(n) for n in lengths)
        offsets = tuple(int(sum(lengths[:i])) for i in range(len(lengths)))
        return cls(offsets, lengths, world_size, max(1, math.ceil(sum(lengths) / world_size)))

    @classmethod
    def by_owner(cls, lengths, owners, world_size: int) -> FlatLayout:
        """Each segment whole inside its owner's shard; shards padded to the largest one."""
        lengths = tuple(int(n) for n in lengths)
        if len(owners) != len(lengths) or any(not 0 <= o < world_size for o in owners):
            raise ValueError(f"need one owner in [0, {world_size}) per segment, got {list(owners)}")
        used = [0] * world_size
        local = []
        for n, o in zip(lengths, owners, strict=True):
            local.append(used[o])
            used[o] += n
        chunk = max(1, max(used))
        offsets = tuple(o * chunk + at for o, at in zip(owners, local, strict=True))
        return cls(offsets, lengths, world_size, chunk)

    @property
    def numel(self) -> int:
        return self.world_size * self.chunk

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    def filled(self, rank: int) -> int:
        """The elements at the start of ``rank``'s shard that segments reach (the rest is padding:
        both layouts pack a shard's segments from its start)."""
        return self._filled[rank]

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(segment, start, stop)`` for the parts of segments in ``rank``'s shard; start and
        stop are positions in the shard."""
        return self._pieces[rank]

    def _rank_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        low, high = rank * self.chunk, (rank + 1) * self.chunk
        out = []
        for s, (off, n) in enumerate(zip(self.offsets, self.lengths, strict=True)):
            start, stop = max(off, low), min(off + n, high)
            if start < stop:
                out.append((s, start - low, stop - low))
        return out


# -- quantization for the wire ----------------------------------------------------------------
def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, ScalingTensor):
        return t.dequantize(torch.float32)
    return t.detach().to(torch.float32)


def _segment_amax(t: torch.Tensor) -> torch.Tensor:
    """amax of a tensor, +inf when it holds a NaN or inf (a non-finite value must reach every
    rank's result, so it wins the MAX all-reduce)."""
    a = amax(_as_fp32(t))
    return torch.where(torch.isfinite(a), a, torch.full_like(a, math.inf))


def _agreed_scales(amaxes: torch.Tensor, fmt: Format, group) -> torch.Tensor:
    """One scale per entry from the MAX over ranks of ``amaxes``; NaN where any rank's amax was
    not finite, so that segment reads as NaN everywhere."""
    comm.all_reduce(amaxes, dist.ReduceOp.MAX, group)
    scales = compute_scale(amaxes, fmt)
    # masked, not indexed: a boolean index would copy the mask's count to the host
    return scales.masked_fill_(~torch.isfinite(amaxes), math.nan)


def _nan_scale(device: torch.device) -> torch.Tensor:
    """The scale of a non-finite tensor, on the device its payload travels from (NCCL has no CPU
    backend)."""
    return torch.full((), math.nan, dtype=torch.float32, device=device)


def scale_or_nan(a: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The scale of a tensor of amax ``a`` in ``fmt``, NaN where ``a`` is not finite (so the
    receiver reads NaN rather than saturated values). Chosen on the device: reading the flag on
    the host would sync it at every call."""
    return torch.where(torch.isfinite(a), compute_scale(a, fmt), _nan_scale(a.device))


def quantize_segment(t: torch.Tensor, fmt: Format, dst: torch.Tensor) -> torch.Tensor:
    """Write ``t`` (flattened) into ``dst`` in ``fmt`` with its own scale and return that scale (a
    float32 scalar). A `ScalingTensor` whose payload is already ``fmt`` is copied as is; a
    non-finite ``t`` gets a NaN scale, so the receiver reads NaN rather than a saturated value."""
    if isinstance(t, ScalingTensor) and t.payload.dtype == fmt.dtype:
        dst.copy_(t.payload.reshape(-1))  # already in the wire format: send as is
        finite = torch.isfinite(amax(t.payload)) & torch.isfinite(t.scale)
        return torch.where(finite, t.scale.reshape(()).float(), _nan_scale(dst.device))
    value = _as_fp32(t).reshape(-1)
    scale = scale_or_nan(amax(value), fmt)
    dst.copy_(saturating_cast(value, scale, fmt))
    return scale


def dequantize_payload(payload: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``payload * scale_inv`` in FP32 (exact down to BF16's smallest subnormal, 2**-133), for a
    finite FP8 payload off the wire (a payload that may hold inf/NaN codes always travels with a
    NaN scale, which makes the result NaN).

    Goes through `fp8lm.ops.cast.upcast`'s integer rebuild of the BF16 bits: every FP8 value
    times a power of two is a BF16 value, and torch's own float8 conversion is scalar on CPU
    (measured 107 ms for 10M elements to FP32, against 19 ms + a vectorized BF16 -> FP32).
    """
    return upcast(payload, scale_inv, torch.bfloat16, finite=True).to(torch.float32)


# -- the two scaling modes --------------------------------------------------------------------
class LocalScaling:
    """``scaling="local"``: each rank quantizes each segment with a scale from its own amax and
    all-gathers the scales; the output scales come from a MAX all-reduce of the shard sums' amaxes.
    The sum is taken in FP32, so nothing saturates."""

    name = "local"

    def __init__(self, fmt: Format, world_size: int, average: bool):
        self.fmt = fmt
        self.world_size = world_size
        self.wire_factor = 1.0  # the sums go on the wire as they are
        self.divisor = float(world_size) if average else 1.0
        self.saturated = 0  # never counts: nothing saturates
        self.all_scales = torch.empty(0)  # [world_size * segments], from the all-gather

    def agree_input_scales(self, tensors: list[torch.Tensor], group) -> None:
        """Nothing to agree on: each rank scales its own segments."""

    def quantize_input(self, index: int, t: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        return quantize_segment(t, self.fmt, dst)

    def exchange_scales(self, scales: torch.Tensor, group) -> list:
        self.all_scales = torch.empty(self.world_size * scales.numel(), dtype=torch.float32, device=scales.device)
        return [comm.all_gather(self.all_scales, scales, group, async_op=True)]

    def received_scales(self, num_segments: int) -> torch.Tensor:
        """``[world_size, segments]``: the scale each rank sent each segment with."""
        return self.all_scales.view(self.world_size, num_segments)

    def output_scales(self, shard: torch.Tensor, pieces, num_segments: int, group) -> torch.Tensor:
        amaxes = torch.zeros(num_segments, dtype=torch.float32, device=shard.device)  # all-reduced: shard's device
        for s, a, b in pieces:
            amaxes[s] = torch.maximum(amaxes[s], _segment_amax(shard[a:b]))
        return _agreed_scales(amaxes, self.fmt, group)

    def quantize_output(self, value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return saturating_cast(value, scale, self.fmt)


class SharedScaling:
    """``scaling="shared"`` (FP8-LM): one scale per segment from a MAX all-reduce of the ranks'
    amaxes, the inputs multiplied by ``mu`` and the sum quantized with that same scale, as an FP8
    sum on the wire would be. ``saturated`` counts the values this rank clipped to the format's max."""

    name = "shared"

    def __init__(self, fmt: Format, world_size: int, average: bool, mu: float):
        self.fmt = fmt
        self.world_size = world_size
        self.mu = float(mu)
        # mu * (sum over ranks) goes on the wire; the mean is taken after.
        self.wire_factor = self.mu * (world_size if average else 1)
        self.divisor = self.wire_factor
        self.saturated = 0
        self.scales = torch.empty(0)  # one per segment, the same on every rank

    def agree_input_scales(self, tensors: list[torch.Tensor], group) -> None:
        if tensors:
            amaxes = torch.stack([_segment_amax(t) for t in tensors])
        else:  # nothing to send, but the all-reduce still runs on the group's device
            amaxes = torch.zeros(0, device=comm.group_device(group))
        self.scales = _agreed_scales(amaxes, self.fmt, group)

    def quantize_input(self, index: int, t: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        value = _as_fp32(t).reshape(-1) * self.mu
        dst.copy_(self._saturating_cast(value, self.scales[index]))
        return self.scales[index]

    def exchange_scales(self, scales: torch.Tensor, group) -> list:
        return []  # every rank holds them already

    def received_scales(self, num_segments: int) -> torch.Tensor:
        return self.scales.expand(self.world_size, num_segments)

    def output_scales(self, shard: torch.Tensor, pieces, num_segments: int, group) -> torch.Tensor:
        return self.scales  # the paper's FP8 sum: mu * sum quantized with the shared scale

    def quantize_output(self, value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self._saturating_cast(value * self.wire_factor if self.wire_factor != 1 else value, scale)

    def _saturating_cast(self, value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.saturated += int((value.abs() * scale > self.fmt.max).sum())
        return saturating_cast(value, scale, self.fmt)


ScalingStrategy = LocalScaling | SharedScaling


def scaling_strategy(scaling: str, fmt: Format, world_size: int, average: bool, mu: float = 1.0) -> ScalingStrategy:
    """The strategy object for ``scaling`` (one of `SCALINGS`); ``mu`` is used by ``"shared"`` only."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if not mu > 0 or not math.isfinite(mu):
        raise ValueError(f"mu must be a finite positive number, got {mu}")
    if scaling == "local":
        return LocalScaling(fmt, world_size, average)
    return SharedScaling(fmt, world_size, average, mu)


# -- the reductions -----------------------------------------------------------------------------
def _send_shards(flat: torch.Tensor, layout: FlatLayout, rank: int, group) -> tuple[torch.Tensor, object]:
    """Launch the all-to-all that gives each rank every rank's copy of its shard of ``flat`` (a
    buffer in ``layout``), without the shards' padding: returns the ``[world_size, filled]``
    receive buffer and the work handle."""
    world, chunk = layout.world_size, layout.chunk
    filled = [layout.filled(r) for r in range(world)]
    send = torch.cat([flat[r * chunk : r * chunk + n] for r, n in enumerate(filled)])
    recv = torch.empty(world * filled[rank], dtype=flat.dtype, device=flat.device)
    work = comm.all_to_all(recv, send, group, True, output_splits=[filled[rank]] * world, input_splits=filled)
    return recv.view(world, filled[rank]), work


def sent_in_bf16(param: torch.Tensor, layer: torch.nn.Module | None) -> bool:
    """Whether gradient communication sends ``param``'s gradient in BF16 rather than FP8: its
    policy stores it in 16 bits (the output head's: one E4M3 scale per tensor or chunk would zero
    the rows of rare tokens), or ``layer`` (the FP8 layer whose weight it is, or None) is switched
    to high precision now (a fallback, precision annealing: its weight gradient is not FP8 then)."""
    return stores_grad_in_16_bits(param) or switched_to_high_precision(layer)


def split_by_wire(params: list[torch.Tensor], layers: dict[int, torch.nn.Module]) -> list[tuple[bool, list[int]]]:
    """The positions in ``params`` of the gradients sent in FP8, then of those sent in BF16
    (`sent_in_bf16`; ``layers``: the FP8 layers by their weights' ids), as ``(in_bf16, positions)``,
    the empty one left out. Every rank gets the same answer: the policy and the switched layers
    are the same on all."""
    bf16 = [sent_in_bf16(p, layers.get(id(p))) for p in params]
    split = [(wire, [i for i, b in enumerate(bf16) if b == wire]) for wire in (False, True)]
    return [(wire, positions) for wire, positions in split if positions]


def _check_segments(tensors: list[torch.Tensor], layout: FlatLayout, world_size: int) -> None:
    if layout.world_size != world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks but the group has {world_size}")
    if len(tensors) != layout.num_segments or any(t.numel() != n for t, n in zip(tensors, layout.lengths, strict=True)):
        raise ValueError("tensors do not match the layout's segment lengths")


class FP8Reduction:
    """One FP8 reduction of a list of tensors (the segments of ``layout``), in stages so that a
    caller can overlap the all-to-all with other work:

    ``start()`` quantizes and launches the payload all-to-all (asynchronously), ``reduce()``
    waits and returns this rank's FP32 shard of the sum, ``start_gather()`` quantizes the shard
    and launches the all-gather, ``results()`` waits and returns one `ScalingTensor` per segment.
    ``scaling`` is ``"local"`` or ``"shared"`` (see `LocalScaling`, `SharedScaling`); ``mu`` is the
    shared scaling's factor.
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
        self.rank, self.world_size = comm.check_group(group)
        self.fmt = format_of(fmt)
        if not self.fmt.is_fp8:
            raise ValueError(f"FP8 collectives send FP8 payloads; fmt must be E4M3 or E5M2, got {self.fmt}")
        _check_segments(tensors, layout, self.world_size)
        self.strategy = scaling_strategy(scaling, self.fmt, self.world_size, average, mu)
        self.tensors, self.layout, self.group = tensors, layout, group
        # every buffer handed to a collective lives here: NCCL has no CPU backend
        self.device = tensors[0].device if tensors else comm.group_device(group)
        self.shard: torch.Tensor | None = None  # this rank's FP32 sum, between reduce() and start_gather()
        self.out_scales: torch.Tensor | None = None  # one per segment, from start_gather()
        self._works: list = []  # the collectives in flight
        self._recv: torch.Tensor | None = None  # every rank's payload of this rank's shard
        self._gathered: torch.Tensor | None = None  # every rank's quantized shard sum

    @property
    def saturated(self) -> int:
        """Values this rank saturated (shared scaling only; 0 with local scaling)."""
        return self.strategy.saturated

    def _wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []

    # stage 1 ---------------------------------------------------------------------------------
    def start(self) -> FP8Reduction:
        self.strategy.agree_input_scales(self.tensors, self.group)
        payload, scales = self._pack()
        self._recv, work = _send_shards(payload, self.layout, self.rank, self.group)
        self._works = [work]
        self._works += self.strategy.exchange_scales(scales, self.group)
        return self

    def _pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 payload of the whole flat buffer and the scale of each segment."""
        # uint8, written through FP8 views: inductor's CPU code cannot yet write slices of an FP8
        # buffer ("Promotion for Float8 Types is not supported")
        flat = torch.zeros(self.layout.numel, dtype=torch.uint8, device=self.device)
        scales = torch.ones(self.layout.num_segments, dtype=torch.float32, device=self.device)
        for s, (t, off, n) in enumerate(zip(self.tensors, self.layout.offsets, self.layout.lengths, strict=True)):
            scales[s] = self.strategy.quantize_input(s, t, flat[off : off + n].view(self.fmt.dtype))
        return flat, scales

    # stage 2 ---------------------------------------------------------------------------------
    def reduce(self) -> torch.Tensor:
        """This rank's shard of the sum (or mean) in FP32: ``layout.chunk`` elements."""
        self._wait()
        chunk = self.layout.chunk
        recv = self._recv.view(self.fmt.dtype)
        inv = self.strategy.received_scales(self.layout.num_segments).reciprocal()
        shard = torch.zeros(chunk, dtype=torch.float32, device=self.device)
        for s, a, b in self.layout.pieces(self.rank):
            for i in range(self.world_size):  # fixed order: the same sum on every run
                shard[a:b] += dequantize_payload(recv[i, a:b], inv[i, s])
        self._recv = None
        if self.strategy.divisor != 1:
            shard /= self.strategy.divisor
        self.shard = shard
        return shard

    # stage 3 ---------------------------------------------------------------------------------
    def start_gather(self) -> FP8Reduction:
        """Quantize the shard sum and launch the all-gather of the payloads."""
        pieces = self.layout.pieces(self.rank)
        self.out_scales = self.strategy.output_scales(self.shard, pieces, self.layout.num_segments, self.group)
        out = torch.zeros(self.layout.chunk, dtype=torch.uint8, device=self.device)  # uint8: `_pack` says why
        for s, a, b in pieces:
            out[a:b] = self.strategy.quantize_output(self.shard[a:b], self.out_scales[s]).view(torch.uint8)
        self.shard = None
        self._gathered = torch.empty(self.layout.numel, dtype=torch.uint8, device=self.device)
        self._works = [comm.all_gather(self._gathered, out, self.group, async_op=True)]
        return self

    def results(self) -> list[ScalingTensor]:
        """The reduced segments, identical on every rank; a segment in which any rank had a
        non-finite value comes back with a NaN scale, so all its values read as NaN."""
        return [ScalingTensor(payload, scale.clone(), torch.float32) for payload, scale in self._segments()]

    def dequantized_results(self) -> list[torch.Tensor]:
        """`results` in FP32, without making `ScalingTensor`s: dynamo cannot yet build one inside a
        custom autograd Function's backward ("Unexpected type in sourceless builder"), where
        the FP8 all-reduce of a replicated input's gradient runs."""
        return [dequantize_payload(payload, scale.reciprocal()) for payload, scale in self._segments()]

    def _segments(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each segment's gathered payload (of its tensor's shape) and scale."""
        self._wait()
        flat = self._gathered.view(self.fmt.dtype)
        out = []
        for s, (t, off, n) in enumerate(zip(self.tensors, self.layout.offsets, self.layout.lengths, strict=True)):
            scale = self.out_scales[s] * self.strategy.wire_factor  # NaN for a non-finite segment
            out.append((flat[off : off + n].view(t.shape), scale))
        return out

    def global_saturated(self) -> int:
        """Values saturated on all ranks together (one small SUM all-reduce; same on every rank)."""
        count = torch.tensor([self.saturated], dtype=torch.int64, device=self.device)
        return int(comm.all_reduce(count, dist.ReduceOp.SUM, self.group))


class BF16Reduction:
    """`FP8Reduction`'s stages with BF16 on the wire: ``start()`` rounds each segment to BF16 and
    launches the all-to-all, ``reduce()`` returns this rank's FP32 shard of the sum (or mean),
    summed in the same fixed order, ``start_gather()`` rounds the shard to BF16 and launches the
    all-gather, ``results()`` returns one BF16 tensor per segment, identical on every rank. No
    scales: BF16 has FP32's range, and it carries inf and NaN, so a non-finite value reaches every
    rank's result as it is."""

    def __init__(self, tensors: list[torch.Tensor], layout: FlatLayout, group=None, average: bool = False):
        self.rank, self.world_size = comm.check_group(group)
        _check_segments(tensors, layout, self.world_size)
        self.tensors, self.layout, self.group, self.average = tensors, layout, group, average
        self.device = tensors[0].device if tensors else comm.group_device(group)  # NCCL: no CPU backend
        self.shard: torch.Tensor | None = None
        self._works: list = []
        self._recv: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None

    def _wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []

    def start(self) -> BF16Reduction:
        flat = torch.zeros(self.layout.numel, dtype=torch.bfloat16, device=self.device)
        for t, off, n in zip(self.tensors, self.layout.offsets, self.layout.lengths, strict=True):
            flat[off : off + n] = _as_fp32(t).reshape(-1)
        self._recv, work = _send_shards(flat, self.layout, self.rank, self.group)
        self._works = [work]
        return self

    def reduce(self) -> torch.Tensor:
        """This rank's shard of the sum (or mean) in FP32: ``layout.chunk`` elements."""
        self._wait()
        recv, filled = self._recv, self._recv.shape[1]
        shard = torch.zeros(self.layout.chunk, dtype=torch.float32, device=self.device)
        for i in range(self.world_size):  # fixed order: the same sum on every run
            shard[:filled] += recv[i].float()
        self._recv = None
        if self.average:
            shard /= self.world_size
        self.shard = shard
        return shard

    def start_gather(self) -> BF16Reduction:
        out = self.shard.to(torch.bfloat16)
        self.shard = None
        self._gathered = torch.empty(self.layout.numel, dtype=torch.bfloat16, device=self.device)
        self._works = [comm.all_gather(self._gathered, out, self.group, async_op=True)]
        return self

    def results(self) -> list[torch.Tensor]:
        """The reduced segments in BF16, each in its tensor's shape."""
        self._wait()
        return [
            self._gathered[off : off + n].view(t.shape)
            for t, off, n in zip(self.tensors, self.layout.offsets, self.layout.lengths, strict=True)
        ]
