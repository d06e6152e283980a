"""fp8lm's kernels as torch custom ops: ``torch.ops.fp8lm.*``.

Each op has a fake implementation (shapes and dtypes only: `torch.compile`, FakeTensorMode and
the meta device trace it without running it) and one real implementation, the function of
`fp8lm.ops.cast` it is named after (for ``upcast``, the C kernel or the plain expression), which
picks the kernel by device: fp8lm's C kernels on CPU
(`fp8lm.ops.native`, where they take the tensors), the fused compiled cast or torch ops on CUDA
and elsewhere. A traced graph holds each op as one opaque node, so the C kernels run inside
compiled CPU graphs too.

| op | returns |
|---|---|
| ``cast(x, scale, dtype)`` | saturating ``cast(x * scale)`` to the float8 ``dtype`` |
| ``cast_with_amax(x, scale, dtype)`` | the cast and ``amax(x)`` (float32, 0-d), from one read of ``x`` |
| ``cast_dequantized(x, scale, scale_inv, dtype, out_dtype)`` | the cast, its values read back as ``payload * scale_inv`` in ``out_dtype``, and ``amax(x)`` |
| ``upcast(data, scale_inv, dtype)`` | ``data * scale_inv`` as ``dtype``, exactly |
| ``amax(x)`` | largest absolute value (float32, 0-d; NaN where one is NaN) |

Scales are float32 tensors of one element. Non-finite semantics are those of `fp8lm.ops.cast`:
NaN stays NaN, inf becomes NaN, finite values beyond the format's max saturate.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import format_of
from . import cast as cast_ops
from . import native

__all__ = ["OPS", "cast", "cast_with_amax", "cast_dequantized", "upcast", "amax"]


def _fmt(dtype: torch.dtype):
    return format_of(dtype)


@torch.library.custom_op("fp8lm::cast", mutates_args=())
def cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return cast_ops.saturating_cast(x, scale, _fmt(dtype))


@cast.register_fake
def _(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def _scalar_like(x: Tensor) -> Tensor:
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fp8lm::cast_with_amax", mutates_args=())
def cast_with_amax(x: Tensor, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return cast_ops.saturating_cast_with_amax(x, scale, _fmt(dtype))


@cast_with_amax.register_fake
def _(x: Tensor, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format), _scalar_like(x)


@torch.library.custom_op("fp8lm::cast_dequantized", mutates_args=())
def cast_dequantized(
    x: Tensor, scale: Tensor, scale_inv: Tensor, dtype: torch.dtype, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    payload, deq, x_amax = cast_ops.saturating_cast_dequantized(
        x, scale, _fmt(dtype), out_dtype, with_amax=True, scale_inv=scale_inv
    )
    assert x_amax is not None  # with_amax=True always returns it
    return payload, deq, x_amax


@cast_dequantized.register_fake
def _(x: Tensor, scale: Tensor, scale_inv: Tensor, dtype: torch.dtype, out_dtype: torch.dtype):
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(x, dtype=dtype, memory_format=contiguous),
        torch.empty_like(x, dtype=out_dtype, memory_format=contiguous),
        _scalar_like(x),
    )


@torch.library.custom_op("fp8lm::upcast", mutates_args=())
def upcast(data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    if native.supports(data) and dtype in native.DTYPE_CODES and native.available():
        return native.upcast(data, scale_inv.item(), dtype)
    # The plain expression, not cast.upcast's BF16 bit rebuild: its int16 views do not survive
    # the dispatch modes an op may run under (opcheck's schema check).
    return (data.to(torch.float32) * scale_inv.to(data.device, torch.float32)).to(dtype)


@upcast.register_fake
def _(data: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(data, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.custom_op("fp8lm::amax", mutates_args=())
def amax(x: Tensor) -> Tensor:
    return cast_ops.amax(x)


@amax.register_fake
def _(x: Tensor) -> Tensor:
    return _scalar_like(x)


# Every op, by its name in torch.ops.fp8lm: the opcheck test walks this table.
OPS = {
    "cast": cast,
    "cast_with_amax": cast_with_amax,
    "cast_dequantized": cast_dequantized,
    "upcast": upcast,
    "amax": amax,
}
