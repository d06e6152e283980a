"""Scale arithmetic compiled off the CPU, and a weight gradient as an FP8 layer stores it.

Shared by the tensorwise GEMMs (`fp8lm.nn.linear`), the fine-grained ones
(`fp8lm.nn.finegrained`) and the grouped experts (`fp8lm.nn.grouped`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..formats import FP32, Format
from ..ops.fastpath import COMPILED_CASTS, FastPath
from ..ops.library import traceable_amax, traceable_cast
from ..scaling import compute_scale
from ..tensor import ScalingTensor

__all__ = ["SCALE_MATH"]

T = TypeVar("T")

# Off the CPU, the amax and scale arithmetic of one cast (an amax reduction and a dozen ops on a
# few scalars) runs as one compiled function, a reduction and one small kernel instead of a dozen
# launches. While torch.compile traces the layer it is inlined; FP8LM_FUSED_CAST=0 turns it off.
SCALE_MATH = FastPath("compiled scale arithmetic", fallback="eager ops", switch=COMPILED_CASTS)
_compiled_scale_math: dict[Callable, Callable] = {}


def _scale_math(fn: Callable[..., T], x: torch.Tensor, *args) -> T:
    """``fn(*args)``, compiled (see `SCALE_MATH`) when ``x`` is off the CPU and nothing traces."""
    if x.device.type == "cpu" or torch.compiler.is_compiling() or not SCALE_MATH.enabled:
        return fn(*args)
    if fn not in _compiled_scale_math:
        _compiled_scale_math[fn] = torch.compile(fn, dynamic=True)  # one graph for every layer shape
    return SCALE_MATH.run(lambda: _compiled_scale_math[fn](*args), lambda: fn(*args))


def _grad_scale(grad: torch.Tensor, fmt: Format) -> torch.Tensor:
    return compute_scale(traceable_amax(grad), fmt)


def _stored_weight_grad(grad: torch.Tensor, fmt: Format, dtype: torch.dtype, plain: bool = False) -> torch.Tensor:
    """The weight gradient as stored: a ScalingTensor of ``fmt`` presenting ``dtype`` (quantize's
    steps), or for FP32 a plain tensor of ``dtype``. ``plain``: the same values (rounded to
    ``fmt``) in a plain tensor of ``dtype``, for a plain weight under torch.compile, whose
    AOTAutograd traces a plain parameter's gradient as a plain tensor."""
    if fmt == FP32:
        return grad.to(dtype)
    scale = _scale_math(_grad_scale, grad, grad, fmt)
    payload = traceable_cast(grad, scale, fmt)
    if plain:
        return (payload.to(torch.float32) / scale).to(dtype)
    return ScalingTensor(payload, scale, dtype)
