"""Per-block scale rules of the fine-grained recipes, from each block's amax.

Each rule gives ``d``, the float32 factor that a block's stored values are read back with
(``value = q * d``; the cast divides by it: ``q = cast(x / d)``), one per block:

- `pow2_ceil`: the smallest power of two with ``amax / d <= fmax`` (nothing saturates): row-wise
  scaling (torchao's power-of-two row scales), power-of-two block scales, MX's ``RCEIL``.
- `pow2_floor`: ``2**(floor(log2(amax)) - emax)``, ``emax = floor(log2(fmax))``: the OCP MX v1.0
  shared exponent (values above ``fmax * d`` saturate).
- `amax_over_max`: ``amax / fmax`` rounded to float32 (DeepSeek-V3's block scales), at least
  float32's smallest subnormal.

Power-of-two exponents are exact (from ``frexp``, never ``log2``) and kept in E8M0's range
[-127, 127]. Every rule gives ``d = 1`` to a block of zeros and ``d = NaN`` to a block holding inf
or NaN, which then reads back as NaN throughout (E8M0's NaN code).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "pow2_ceil",
    "pow2_floor",
    "amax_over_max",
    "exp2i",
    "e8m0_codes",
    "e8m0_values",
    "E8M0_MIN_EXP",
    "E8M0_MAX_EXP",
]

E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
_SMALLEST_SUBNORMAL = 2.0**-149


def exp2i(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as float32, exactly, for an integer tensor ``e`` in [-149, 127] (built from bits)."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _finish(amax: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``d``, with 1 for blocks of zeros and NaN for blocks holding inf or NaN."""
    d = torch.where(amax == 0, torch.ones_like(d), d)
    return torch.where(torch.isfinite(amax), d, torch.full_like(d, math.nan))


def _exponent(amax: torch.Tensor, fmax: float, round_up: bool) -> torch.Tensor:
    """The exponent of `pow2_ceil` (``round_up``) or `pow2_floor` for positive finite amaxes."""
    mantissa, exp = torch.frexp(amax)  # amax = mantissa * 2**exp, mantissa in [0.5, 1)
    fmax_mantissa, fmax_exp = math.frexp(fmax)
    e = exp - fmax_exp  # floor(log2(amax)) - floor(log2(fmax))
    if round_up:
        e = e + (mantissa > fmax_mantissa).to(e.dtype)
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def pow2_ceil(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The smallest power of two ``d`` with ``amax / d <= fmax`` (see the module doc)."""
    return _finish(amax, exp2i(_exponent(amax, fmax, round_up=True)))


def pow2_floor(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """``2**(floor(log2(amax)) - floor(log2(fmax)))``: the OCP MX shared scale (see the module doc)."""
    return _finish(amax, exp2i(_exponent(amax, fmax, round_up=False)))


def amax_over_max(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """``amax / fmax`` in float32, at least 2**-149 (see the module doc)."""
    return _finish(amax, (amax / fmax).clamp(min=_SMALLEST_SUBNORMAL))


def e8m0_codes(d: torch.Tensor) -> torch.Tensor:
    """Float32 powers of two as E8M0 codes (uint8, ``2**(code - 127)``): their float32 exponent
    field, taken from the bits (2**-127, a subnormal, has 0; NaN has 255)."""
    return ((d.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) as float32 ``2**(code - 127)``: `e8m0_codes` reversed, built from the
    bits (code 0 is the subnormal 2**-127, 255 NaN) rather than through the float8_e8m0fnu
    dtype, which compiled code may not support."""
    bits = codes.to(torch.int32) << 23
    bits = torch.where(codes == 0, 0x00400000, bits)  # 2**-127: float32's subnormal bit 22
    return torch.where(codes == 255, 0x7FC00000, bits).view(torch.float32)
