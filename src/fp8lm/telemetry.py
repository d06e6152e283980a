"""FP8 numerics telemetry: how well each tensor fits the format it is cast to.

Per tensor: its amax, the scale it is (or was) cast with, the fraction of its non-zero values
that underflow to zero, and the fraction that saturate at the format's max. `quantization_stats`
measures a high-precision tensor about to be cast; `stored_stats` an already quantized one
(where the lost values can no longer be seen, zeros stand in for underflow).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .formats import Format
from .tensor import ScalingTensor

__all__ = ["TensorStats", "quantization_stats", "stored_stats"]


@dataclass(frozen=True)
class TensorStats:
    amax: float
    scale: float
    underflow: float  # fraction of non-zero values that become zero
    saturation: float  # fraction of values beyond the format's max after scaling (clipped)

    def as_dict(self) -> dict:
        return asdict(self)


def quantization_stats(x: torch.Tensor, fmt: Format, scale: torch.Tensor | float) -> TensorStats:
    """Stats of casting ``x`` to ``fmt`` with ``scale`` (``payload = cast(x * scale)``)."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    scaled = x.detach().abs().to(torch.float32) * scale
    nonzero = int(torch.count_nonzero(x))
    # Round-to-nearest-even sends everything at or below half the smallest subnormal to zero.
    lost = int(torch.count_nonzero((scaled <= fmt.min_subnormal / 2) & (scaled > 0))) if nonzero else 0
    saturated = int(torch.count_nonzero(scaled > fmt.max))
    return TensorStats(
        amax=float(scaled.max() / scale) if x.numel() else 0.0,
        scale=float(scale),
        underflow=lost / nonzero if nonzero else 0.0,
        saturation=saturated / max(x.numel(), 1),
    )


def stored_stats(t: ScalingTensor) -> TensorStats:
    """Stats of a quantized tensor: zeros stand in for underflow, values at +-max for saturation
    (an upper bound: values that rounded up to the max count too)."""
    mags = t.payload.to(torch.float32).abs()
    n = max(t.numel(), 1)
    return TensorStats(
        amax=float(mags.max() / t.scale) if t.numel() else 0.0,
        scale=float(t.scale),
        underflow=int(torch.count_nonzero(mags == 0)) / n,
        saturation=int(torch.count_nonzero(mags >= t.fmt.max)) / n,
    )
