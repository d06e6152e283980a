"""Number formats: the storage dtypes fp8lm quantizes to, with their range and size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Format", "E4M3", "E5M2", "FP16", "BF16", "FP32", "format_of", "FORMATS"]


@dataclass(frozen=True)
class Format:
    """A storage format: ``dtype`` is the torch dtype of the payload, ``max`` its largest finite
    value, ``bytes`` its size per element."""

    name: str
    dtype: torch.dtype
    max: float
    bytes: int

    @property
    def is_fp8(self) -> bool:
        return self.bytes == 1

    @property
    def min_normal(self) -> float:
        return torch.finfo(self.dtype).tiny

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value; half of it and below round to zero."""
        info = torch.finfo(self.dtype)
        return info.tiny * info.eps

    def __repr__(self) -> str:
        return f"fp8lm.{self.name}"


E4M3 = Format("E4M3", torch.float8_e4m3fn, 448.0, 1)
E5M2 = Format("E5M2", torch.float8_e5m2, 57344.0, 1)
FP16 = Format("FP16", torch.float16, 65504.0, 2)
BF16 = Format("BF16", torch.bfloat16, torch.finfo(torch.bfloat16).max, 2)
FP32 = Format("FP32", torch.float32, torch.finfo(torch.float32).max, 4)

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E5M2, FP16, BF16, FP32)}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}


def format_of(spec: Format | str | torch.dtype) -> Format:
    """The `Format` named by a Format, its name (case-insensitive) or its torch dtype."""
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, torch.dtype) and spec in _BY_DTYPE:
        return _BY_DTYPE[spec]
    if isinstance(spec, str) and spec.upper() in FORMATS:
        return FORMATS[spec.upper()]
    raise ValueError(f"unknown format {spec!r}: use one of {', '.join(FORMATS)} (or their torch dtypes)")
