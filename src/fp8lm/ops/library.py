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
| ``cast_transposed(x, scale, dtype)`` | the cast of a 2-D ``x``, its transpose (contiguous: the layout ``_scaled_mm`` reads a transposed operand in) and ``amax(x)``, from one read of ``x`` |
| ``cast_dequantized(x, scale, scale_inv, dtype, out_dtype)`` | the cast, its values read back as ``payload * scale_inv`` in ``out_dtype``, and ``amax(x)`` |
| ``upcast(data, scale_inv, dtype)`` | ``data * scale_inv`` as ``dtype``, exactly |
| ``amax(x)`` | largest absolute value (float32, 0-d; NaN where one is NaN) |
| ``group_amax(x, group)`` | the amax of each group of ``group`` consecutive elements (float32, ``numel / group``) |
| ``group_cast(x, scales, group, dtype)`` | saturating ``cast(x * scale)`` with one scale per group of ``group`` consecutive elements |
| ``group_upcast(data, scales, group, dtype)`` | ``data / scale`` per group, as ``dtype``, exactly |
| ``adam_step(w, g, m, v, scales, new_scales, hyperparams)`` | the FP8 optimizer's fused step over lists of tensors: new w, m, v stored in place with ``new_scales`` (n, 3); returns the amaxes of the stored payloads (n, 3) |
| ``adam_amaxes(w, g, m, v, scales, hyperparams)`` | the amaxes of the new w, m, v (n, 3), nothing stored |

The two Adam ops take, per tensor, the payloads of its weight ``w``, gradient ``g`` and moments
``m``, ``v``, their scales ``scales`` (n, 4, in that order) and the step's coefficients
``hyperparams`` (n, 8; `fp8lm.optim.functional.adam_update`'s). Their CPU kernel is fp8lm's C
kernel (all tensors in one call); their CUDA kernel, in torch ops, is registered by
`fp8lm.optim.fused`, where the Adam arithmetic lives.

Scales are float32 tensors of one element. Non-finite semantics are those of `fp8lm.ops.cast`:
NaN stays NaN, inf becomes NaN, finite values beyond the format's max saturate.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import Format, format_of
from . import cast as cast_ops
from . import native

__all__ = [
    "OPS",
    "cast",
    "cast_with_amax",
    "cast_dequantized",
    "cast_transposed",
    "upcast",
    "amax",
    "adam_step",
    "adam_amaxes",
    "group_amax",
    "group_cast",
    "group_upcast",
    "traceable_amax",
    "traceable_cast",
    "traceable_cast_dequantized",
    "traceable_upcast",
]


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


@torch.library.custom_op("fp8lm::cast_transposed", mutates_args=())
def cast_transposed(x: Tensor, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    payload, transposed, x_amax, _ = cast_ops.saturating_cast_transposed(x, scale, _fmt(dtype), with_amax=True)
    assert x_amax is not None  # with_amax=True always returns it
    return payload, transposed, x_amax


@cast_transposed.register_fake
def _(x: Tensor, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    if x.dim() != 2:
        raise ValueError(f"fp8lm::cast_transposed takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    return x.new_empty((rows, cols), dtype=dtype), x.new_empty((cols, rows), dtype=dtype), _scalar_like(x)


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


def _interleaved(w: list[Tensor], g: list[Tensor], m: list[Tensor], v: list[Tensor]) -> list[Tensor]:
    """The C kernel's order: each tensor's weight, gradient, first and second moment in turn."""
    if not len(w) == len(g) == len(m) == len(v):
        raise ValueError(
            f"adam_step: w, g, m, v must list the same tensors, got {len(w)}, {len(g)}, {len(m)}, {len(v)}"
        )
    tensors = [t for group in zip(w, g, m, v) for t in group]
    if not (all(map(native.supports, tensors)) and native.available()):
        raise ValueError(
            "fp8lm.adam_step on CPU needs contiguous tensors of float32/16, bfloat16 or float8 and fp8lm's "
            "C kernels (FP8LM_NATIVE unset and a C compiler); use FP8AdamW(kernel='compile') otherwise"
        )
    return tensors


# -- group-scaled casts (FP8-saved activations); CPU only: their callers use torch ops elsewhere --
@torch.library.custom_op("fp8lm::group_amax", mutates_args=(), device_types="cpu")
def group_amax(x: Tensor, group: int) -> Tensor:
    return native.group_amax(x, group)


@group_amax.register_fake
def _(x: Tensor, group: int) -> Tensor:
    return x.new_empty(x.numel() // group, dtype=torch.float32)


@torch.library.custom_op("fp8lm::group_cast", mutates_args=(), device_types="cpu")
def group_cast(x: Tensor, scales: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    return native.group_cast(x, scales, group, dtype)


@group_cast.register_fake
def _(x: Tensor, scales: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.custom_op("fp8lm::group_upcast", mutates_args=(), device_types="cpu")
def group_upcast(data: Tensor, scales: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    return native.group_upcast(data, scales, group, dtype)


@group_upcast.register_fake
def _(data: Tensor, scales: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(data, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.custom_op("fp8lm::adam_step", mutates_args=("w", "m", "v"), device_types="cpu")
def adam_step(
    w: list[Tensor],
    g: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    scales: Tensor,
    new_scales: Tensor,
    hyperparams: Tensor,
) -> Tensor:
    return native.adam_step(_interleaved(w, g, m, v), scales, new_scales, hyperparams, write=True)


@adam_step.register_fake
def _(w, g, m, v, scales, new_scales, hyperparams) -> Tensor:
    return scales.new_empty((len(w), 3), dtype=torch.float32)


@torch.library.custom_op("fp8lm::adam_amaxes", mutates_args=(), device_types="cpu")
def adam_amaxes(
    w: list[Tensor], g: list[Tensor], m: list[Tensor], v: list[Tensor], scales: Tensor, hyperparams: Tensor
) -> Tensor:
    tensors = _interleaved(w, g, m, v)
    unused = torch.ones(len(w), 3, dtype=torch.float32)  # the new scales: nothing is stored
    return native.adam_step(tensors, scales, unused, hyperparams, write=False)


@adam_amaxes.register_fake
def _(w, g, m, v, scales, hyperparams) -> Tensor:
    return scales.new_empty((len(w), 3), dtype=torch.float32)


# Every op, by its name in torch.ops.fp8lm: the opcheck test walks this table.
OPS = {
    "cast": cast,
    "cast_with_amax": cast_with_amax,
    "cast_dequantized": cast_dequantized,
    "cast_transposed": cast_transposed,
    "upcast": upcast,
    "amax": amax,
    "adam_step": adam_step,
    "adam_amaxes": adam_amaxes,
    "group_amax": group_amax,
    "group_cast": group_cast,
    "group_upcast": group_upcast,
}


# -- the kernels to call from code that torch.compile may trace -----------------------------------
def _in_cpu_graph(x: Tensor) -> bool:
    """Whether ``torch.compile`` is tracing CPU code with fp8lm's C kernels on: there the ops above
    keep them as one opaque node each (inductor's own float8 conversions are scalar on CPU). On
    CUDA, and on CPU without the C kernels (``FP8LM_NATIVE=0``, no C compiler), the plain
    expressions of `fp8lm.ops.cast` are traced instead, so inductor fuses them."""
    return x.device.type == "cpu" and torch.compiler.is_compiling() and native.KERNELS.enabled


def traceable_amax(x: Tensor) -> Tensor:
    """`fp8lm.ops.cast.amax`, as the ``amax`` op while tracing CPU code."""
    return amax(x) if _in_cpu_graph(x) else cast_ops.amax(x)


def traceable_cast(x: Tensor, scale: Tensor, fmt: Format) -> Tensor:
    """`fp8lm.ops.cast.saturating_cast`, as the ``cast`` op while tracing CPU code."""
    return cast(x, scale, fmt.dtype) if _in_cpu_graph(x) else cast_ops.saturating_cast(x, scale, fmt)


def traceable_cast_dequantized(
    x: Tensor, scale: Tensor, scale_inv: Tensor, fmt: Format, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The payload of `traceable_cast` and its values read back as ``payload * scale_inv`` in
    ``out_dtype`` (`fp8lm.ops.cast.saturating_cast_dequantized`), as the ``cast_dequantized`` op
    while tracing CPU code."""
    if _in_cpu_graph(x):
        payload, deq, _ = cast_dequantized(x, scale, scale_inv, fmt.dtype, out_dtype)
        return payload, deq
    payload, deq, _ = cast_ops.saturating_cast_dequantized(x, scale, fmt, out_dtype, scale_inv=scale_inv)
    return payload, deq


def traceable_upcast(data: Tensor, scale_inv: Tensor, dtype: torch.dtype, finite: bool | None = None) -> Tensor:
    """`fp8lm.ops.cast.upcast`, as the ``upcast`` op while tracing CPU code."""
    return upcast(data, scale_inv, dtype) if _in_cpu_graph(data) else cast_ops.upcast(data, scale_inv, dtype, finite)
