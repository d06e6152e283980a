"""FP8 activations across pipeline stage boundaries, on ``torch.distributed.pipelining``
(``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``).

A stage's outputs must be plain tensors that can carry a gradient, and its receive buffers are
plain ``torch.empty`` of the declared shape and dtype, so neither a `ScalingTensor` nor a uint8
tensor can cross a boundary. The mechanism:

- `FP8StageOutput`, the last module of a stage, quantizes the activation to E4M3 with a
  power-of-two scale from its amax and packs the bytes with the scale's 4 bytes appended into a
  *carrier*: a float32 tensor of ``ceil((numel + 4) / 4)`` elements whose memory holds those bytes
  (1 byte per element plus the scale, zero-padded to a multiple of 4). It is an autograd
  Function's output, so it requires grad, and the schedule sends it as it is.
- `FP8StageInput`, the first module of the next stage, reads the payload and scale back from the
  received carrier into an activation of the declared shape and dtype.
- Backward, `FP8StageInput` packs the activation's gradient the same way in E5M2, and the
  schedule sends that carrier back as "the gradient of the carrier"; `FP8StageOutput`'s backward
  unpacks it into the activation's gradient. Nothing on the way does arithmetic on a carrier (it is
  copied, sent and received), so its bytes arrive as they left.

`FP8PipelineStage` is torch's ``PipelineStage`` whose activation and gradient sends and receives
are counted in `fp8lm.distributed.comm_stats` (``send`` / ``recv``), since torch's schedules issue
them with ``batch_isend_irecv`` directly. Give it ``input_args`` and ``output_args`` (static
shapes): dynamic shape inference would exchange pickled metadata outside the count.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..formats import E4M3, E5M2, Format
from ..ops.cast import amax, saturating_cast
from . import accounting, comm
from .reduction import dequantize_payload, scale_or_nan

__all__ = ["FP8StageOutput", "FP8StageInput", "FP8PipelineStage", "carrier_numel", "pack_fp8", "unpack_fp8"]

SCALE_BYTES = 4


def carrier_numel(numel: int) -> int:
    """Float32 elements of the carrier of an activation of ``numel`` elements."""
    return math.ceil((numel + SCALE_BYTES) / 4)


def pack_fp8(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``x`` as ``fmt`` bytes with its scale appended, in a float32 carrier (a NaN scale when ``x``
    holds an inf or NaN, so the receiver reads NaN rather than saturated values)."""
    values = x.detach().reshape(-1)
    scale = scale_or_nan(amax(values), fmt)
    raw = torch.zeros(4 * carrier_numel(values.numel()), dtype=torch.uint8, device=x.device)
    raw[: values.numel()] = saturating_cast(values, scale, fmt).view(torch.uint8)
    raw[values.numel() : values.numel() + SCALE_BYTES] = scale.reshape(1).float().to(x.device).view(torch.uint8)
    return raw.view(torch.float32)


def unpack_fp8(
    carrier: torch.Tensor, shape: torch.Size | tuple[int, ...], fmt: Format, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` that `pack_fp8` packed into ``carrier``."""
    numel = math.prod(shape)
    if carrier.numel() != carrier_numel(numel) or carrier.dtype != torch.float32:
        raise ValueError(
            f"an FP8 carrier for shape {tuple(shape)} has {carrier_numel(numel)} float32 elements, got "
            f"{carrier.numel()} {carrier.dtype}: declare the same activation shape on both sides of the boundary"
        )
    raw = carrier.detach().contiguous().view(torch.uint8)
    scale = raw[numel : numel + SCALE_BYTES].clone().view(torch.float32)  # any byte offset
    return dequantize_payload(raw[:numel].view(fmt.dtype), scale.reciprocal()).to(dtype).view(shape)


class _SendFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return pack_fp8(x, E4M3)

    @staticmethod
    def backward(ctx, carrier_grad):
        return unpack_fp8(carrier_grad, ctx.shape, E5M2, ctx.dtype)


class _ReceiveFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier, shape, dtype):
        return unpack_fp8(carrier, shape, E4M3, dtype)

    @staticmethod
    def backward(ctx, grad):
        return pack_fp8(grad, E5M2), None, None


class FP8StageOutput(nn.Module):
    """Last module of a pipeline stage: the activation leaves as an E4M3 carrier (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SendFP8.apply(x)


class FP8StageInput(nn.Module):
    """First module of a pipeline stage: the activation of ``shape`` (one micro-batch's) and
    ``dtype`` read back from the previous stage's carrier (module docstring)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.shape, self.dtype = tuple(shape), dtype

    def forward(self, carrier: torch.Tensor) -> torch.Tensor:
        return _ReceiveFP8.apply(carrier, self.shape, self.dtype)

    def example_carrier(self, device: torch.device | str | None = None) -> torch.Tensor:
        """A carrier of the right size, for ``PipelineStage``'s ``input_args`` or a receive buffer,
        on ``device`` (the stage's: NCCL has no CPU backend; the CPU when None)."""
        return torch.empty(carrier_numel(math.prod(self.shape)), dtype=torch.float32, device=device)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, dtype={self.dtype}"


class FP8PipelineStage(PipelineStage):
    """torch's ``PipelineStage`` (same arguments) whose point-to-point sends and receives are counted
    in `comm_stats` (``send``: every byte sent; ``recv``: the call)."""

    def _counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        world = dist.get_world_size(self.group)
        for op in ops:
            kind = "send" if op.op in (dist.isend, dist.send) else "recv"
            nbytes = op.tensor.numel() * op.tensor.element_size()
            accounting.record(kind, nbytes, world, nbytes if kind == "send" else 0)
            comm.note_devices(kind, op.tensor)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_recv_ops(bwd_chunk_id))
