"""FP8 storage of the activations that autograd saves outside the linear layers.

`FP8Linear` saves its input in FP8. What else a transformer block keeps for its backward is the
input of its norms (the residual stream, FP32 under autocast) and of its activation function
(GELU's input; SwiGLU's gate and up halves), in BF16 or FP32. The modules here compute exactly
what the plain modules compute and save those inputs in E4M3 instead, with one power-of-two
scale per group of ``group_size`` columns of each row (`quantize_groups`): each token's features
get their own scales, because the rows of these tensors differ widely in range (COAT's finding
for the non-linear layers), and one scale per tensor would flush the small rows to zero. The
backward pass is the exact gradient of the same function (torch's own backward kernels where
there is one) at the dequantized input: a norm's statistics are those of the dequantized input.

=====================  ============================  ===================================
module                 saves for backward            instead of
=====================  ============================  ===================================
`FP8SavedLayerNorm`    input in E4M3 + scales        the input
`FP8SavedRMSNorm`      input in E4M3 + scales        the input and the normalized input
`FP8SavedGELU`         input in E4M3 + scales        the input
`FP8SavedSwiGLU`       gate and up in E4M3 + scales  gate, up and silu(gate)
`FP8SavedAttention`    q, k and v in E4M3 + scales   q, k, v, the output and the
                                                     log-sum-exp (BF16/FP32)
=====================  ============================  ===================================

``fp8lm.initialize(..., activations="fp8")`` swaps them in (`saving_counterpart`) for
``nn.LayerNorm`` over the last dimension, `RMSNorm` (and Hugging Face's ``*RMSNorm`` modules
with a ``variance_epsilon``, which compute the same), ``nn.GELU``, `SwiGLU` and
`ScaledDotProductAttention`; each keeps the module's parameters (the same objects) and state-dict
keys. Without gradients (evaluation) they run the plain module.

The attention saves only its inputs: its backward runs the attention kernel's forward again on
the dequantized q, k and v and differentiates that (the kernel's own backward), so it is the exact
gradient of attention at the dequantized inputs, like the norms'; the price is one more attention
forward per backward. With dropout (``dropout_p > 0``) it runs the plain kernel: a recomputation
would draw another mask. What stays in high precision: the loss's softmax, activations and
attention computed by functional calls in a ``forward`` (``F.gelu``,
``F.scaled_dot_product_attention``), which no module swap can reach, and the block inputs that
activation checkpointing keeps (its recomputation must start from the exact values).

Why autograd Functions and not ``torch.autograd.graph.saved_tensors_hooks``: a hook sees every
tensor saved in its scope (the linear layers' FP8 inputs, the attention's tensors, views of
parameters) and would have to guess which to compress; ``torch.compile(fullgraph=True)`` refuses
to trace the hooks' context manager; and their pack/unpack pairs would nest with activation
checkpointing's own hooks. A Function says what it saves and how it uses it: it traces into a
fullgraph compile like `FP8Linear`'s, runs on FSDP2's gathered parameters as any module does,
and under sequence parallelism (a DTensor input sharded on the sequence) computes on the local
shard, its parameters' gradients partial sums as torch's own norms give them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..formats import E4M3, Format, format_of
from ..ops import library, native
from ..scaling import pow2_scale

__all__ = [
    "GROUP_SIZE",
    "quantize_groups",
    "dequantize_groups",
    "group_columns",
    "rms_norm",
    "RMSNorm",
    "SwiGLU",
    "FP8SavedLayerNorm",
    "FP8SavedRMSNorm",
    "FP8SavedGELU",
    "FP8SavedSwiGLU",
    "ScaledDotProductAttention",
    "FP8SavedAttention",
    "attention_backward",
    "SAVING_MODULES",
    "saving_counterpart",
    "activation_targets",
]

# Columns per scale: a row of up to 128 features (or one that 128 does not divide) has one scale.
GROUP_SIZE = 128


# -- numerics -----------------------------------------------------------------------------------


def group_columns(columns: int, group_size: int) -> int:
    """Columns per scale for rows of ``columns``: ``group_size`` where it divides them, else the
    whole row."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return group_size if columns % group_size == 0 else columns


def _native(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether fp8lm's C kernels do a group cast between ``x`` and ``dtype`` (CPU, FP32/BF16 on
    the wide side, FP8 on the other): the same results as the torch expressions below, one pass
    instead of six (torch converts to FP8 one element at a time on CPUs)."""
    wide = dtype if x.dtype.itemsize == 1 else x.dtype
    if not (x.device.type == "cpu" and wide in (torch.float32, torch.bfloat16)):
        return False
    # while torch.compile traces, only kernels loaded before (loading cannot be traced): else the
    # torch expressions, which give the same results
    return native.loaded() if torch.compiler.is_compiling() else native.available()


def quantize_groups(
    x: torch.Tensor, fmt: Format = E4M3, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., C) as a payload of ``fmt`` (x's shape) and float32 scales (..., C / g), one per
    group of g = `group_columns` (C, group_size) consecutive columns: the power-of-two scale of the
    group's amax (`fp8lm.scaling.pow2_scale`; 1 for an all-zero group), ``payload =
    saturate(x * scale)`` rounded to nearest even. A group holding inf or NaN gets a NaN scale,
    so that it reads back as NaN (the step's non-finite check sees it).

    Memory: one temporary of x's size and dtype (a power-of-two scale multiplies a BF16 or FP32
    value exactly, so the product is formed in x's dtype; FP16 and others go through FP32); on CPU
    fp8lm's C kernels (`fp8lm.ops.native`), none beyond a contiguous copy of a strided ``x``."""
    columns = x.shape[-1]
    g = group_columns(columns, group_size) if columns else 1
    if x.numel() and fmt.is_fp8 and _native(x, fmt.dtype):
        flat = x.detach().contiguous()
        amax = library.group_amax(flat, g)
        scale = torch.where(torch.isfinite(amax), pow2_scale(amax, fmt.max), torch.nan)
        return library.group_cast(flat, scale, g, fmt.dtype), scale.view(*x.shape[:-1], columns // g)
    exact = x.dtype in (torch.float32, torch.bfloat16)
    grouped = x.detach().unflatten(-1, (columns // g, g))
    if not exact:
        grouped = grouped.to(torch.float32)
    if grouped.numel():
        low, high = torch.aminmax(grouped, dim=-1, keepdim=True)  # no |x| temporary
        amax = torch.maximum(high.float(), -low.float())  # NaN where the group holds one
    else:
        amax = torch.zeros(*grouped.shape[:-1], 1, device=x.device)
    scale = torch.where(torch.isfinite(amax), pow2_scale(amax, fmt.max), torch.nan)
    scaled = grouped * scale.to(grouped.dtype)
    payload = scaled.clamp_(-fmt.max, fmt.max).to(fmt.dtype)
    return payload.flatten(-2), scale.squeeze(-1)


def dequantize_groups(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of `quantize_groups`' ``payload`` and ``scale``, as ``dtype`` (exact in any float
    dtype that holds the values: FP8 values and power-of-two scales multiply exactly)."""
    groups = scale.shape[-1]
    if payload.numel() and _native(payload, dtype):
        return library.group_upcast(payload.contiguous(), scale.contiguous(), payload.shape[-1] // groups, dtype)
    wide = dtype in (torch.float32, torch.bfloat16, torch.float64)  # holds any scale's reciprocal
    values = payload.to(dtype if wide else torch.float32).unflatten(-1, (groups, payload.shape[-1] // groups))
    values = values.mul_(scale.reciprocal().to(values.dtype).unsqueeze(-1)).flatten(-2)
    return values if wide else values.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, computed in at least FP32
    (Hugging Face Llama's order: normalized, cast back to x's dtype, then times the gain)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, fmt: Format, group_size: int):
        y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)  # the module's output, autocast and all
        payload, scale = quantize_groups(x, fmt, group_size)
        ctx.save_for_backward(payload, scale, weight, bias)
        ctx.x_dtype, ctx.eps = x.dtype, eps
        return y

    @staticmethod
    def backward(ctx, grad):
        payload, scale, weight, bias = ctx.saved_tensors
        mask = [
            ctx.needs_input_grad[0],
            weight is not None and ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        ]
        gx, gw, gb = layer_norm_backward(
            grad, dequantize_groups(payload, scale, torch.float32), weight, bias, ctx.eps, mask
        )
        return (None if gx is None else gx.to(ctx.x_dtype), gw, gb, None, None, None)


def layer_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of a layer norm over the last dimension (input, weight, bias; each where
    ``mask`` asks) at the FP32 input ``x``: torch's backward kernel in FP32, with the mean and
    1/std of ``x`` itself as torch's forward kernel computes them (``native_layer_norm``: a tenth of
    ``var_mean``'s time on CPUs). The parameters' gradients come in the parameters' dtypes."""
    with torch.autocast(x.device.type, enabled=False):
        _, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), None, None, eps)
    w = None if weight is None else weight.to(torch.float32)
    b = None if bias is None else bias.to(torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
            grad.to(torch.float32), x, (x.shape[-1],), mean, rstd, w, b, mask
        )
    return (
        gx,
        None if gw is None or weight is None else gw.to(weight.dtype),
        None if gb is None or bias is None else gb.to(bias.dtype),
    )


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, fmt: Format, group_size: int):
        y = rms_norm(x, weight, eps)
        payload, scale = quantize_groups(x, fmt, group_size)
        ctx.save_for_backward(payload, scale, weight)
        ctx.x_dtype, ctx.eps = x.dtype, eps
        return y

    @staticmethod
    def backward(ctx, grad):
        payload, scale, weight = ctx.saved_tensors
        xf = dequantize_groups(payload, scale, torch.promote_types(ctx.x_dtype, torch.float32))
        gx, gw = rms_norm_backward(grad, xf, weight, ctx.eps, ctx.x_dtype)
        return gx, (gw if ctx.needs_input_grad[1] else None), None, None, None


def rms_norm_backward(
    grad: torch.Tensor, xf: torch.Tensor, weight: torch.Tensor, eps: float, x_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `rms_norm` (input, weight) from the output gradient, the input ``xf`` in the
    dtype the norm computes in and the gain, following autograd's dtypes: with
    ``rstd = 1/sqrt(mean(x^2) + eps)``, ``n = x * rstd`` cast to ``x_dtype`` is multiplied by the
    gain, so ``d weight = sum(grad * n)`` and ``d n = grad * weight`` (in ``x_dtype``); then
    ``d x = rstd * d n - x * rstd^3 * mean(d n * x)``."""
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = (xf * rstd).to(x_dtype)
    out_dtype = torch.promote_types(x_dtype, weight.dtype)
    gw = (grad.to(out_dtype) * n.to(out_dtype)).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
    gn = (grad * weight).to(x_dtype).to(xf.dtype)
    gx = rstd * gn - xf * rstd.pow(3) * (gn * xf).mean(-1, keepdim=True)
    return gx.to(x_dtype), gw


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate: str, fmt: Format, group_size: int):
        y = F.gelu(x, approximate=approximate)
        payload, scale = quantize_groups(x, fmt, group_size)
        ctx.save_for_backward(payload, scale)
        ctx.x_dtype, ctx.approximate = x.dtype, approximate
        return y

    @staticmethod
    def backward(ctx, grad):
        payload, scale = ctx.saved_tensors
        x = dequantize_groups(payload, scale, ctx.x_dtype)
        return torch.ops.aten.gelu_backward(grad, x, approximate=ctx.approximate), None, None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt: Format, group_size: int):
        gate, up = x.chunk(2, dim=-1)
        y = F.silu(gate) * up
        # gate and up quantized as two halves of each row: their groups never mix the two
        payload, scale = quantize_groups(x.unflatten(-1, (2, -1)), fmt, group_size)
        ctx.save_for_backward(payload, scale)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        payload, scale = ctx.saved_tensors
        gate, up = dequantize_groups(payload, scale, ctx.x_dtype).unbind(-2)
        return swiglu_backward(grad, gate, up), None, None


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gradient of `SwiGLU`'s input (gate half, then up half) as autograd computes it for
    ``silu(gate) * up``: ``d up = grad * silu(gate)``, ``d gate = silu'(gate) * grad * up``."""
    d_gate = torch.ops.aten.silu_backward(grad * up, gate)
    return torch.cat((d_gate, grad * F.silu(gate)), dim=-1)


def _attention_forward(q, k, v, is_causal: bool, scale: float | None):
    """The attention kernel's forward (output, and what its backward needs), as
    ``F.scaled_dot_product_attention`` runs it: the CPU flash kernel, or CUDA's flash kernel."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)


def attention_backward(grad, q, k, v, is_causal: bool, scale: float | None):
    """Gradients (q, k, v) of causal or full attention at ``q, k, v`` for the output gradient
    ``grad``: the kernel's forward run again for its output and log-sum-exp, then its backward
    (aten ops, so ``torch.compile`` traces it where ``torch.autograd.grad`` would break the graph)."""
    if q.device.type == "cpu":
        out, lse = _attention_forward(q, k, v, is_causal, scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )
    out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = _attention_forward(q, k, v, is_causal, scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, rng, unused, scale=scale
    )


def attention_saves_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `FP8SavedAttention` recomputes for these inputs: the CPU's flash kernel (any float
    dtype), CUDA's flash kernel (BF16/FP16, as under autocast); else it runs the plain kernel."""
    if q.device.type == "cpu":
        return True
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool, scale: float | None, fmt: Format, group_size: int):
        out = _attention_forward(q, k, v, is_causal, scale)[0]
        # each in the layout its projection wrote it, (batch, sequence, heads, head_dim), where that
        # is contiguous: no copy to quantize, the same groups (one row of head_dim per token and head)
        heads_last = [q.ndim == 4 and z.transpose(1, 2).is_contiguous() for z in (q, k, v)]
        saved = [
            t
            for z, swap in zip((q, k, v), heads_last, strict=True)
            for t in quantize_groups(z.transpose(1, 2) if swap else z, fmt, group_size)
        ]
        ctx.save_for_backward(*saved)
        ctx.dtypes, ctx.is_causal, ctx.scale = (q.dtype, k.dtype, v.dtype), is_causal, scale
        ctx.heads_last = heads_last
        return out

    @staticmethod
    def backward(ctx, grad):
        p = ctx.saved_tensors
        q, k, v = (
            dequantize_groups(p[2 * i], p[2 * i + 1], dtype).transpose(1, 2)
            if swap
            else dequantize_groups(p[2 * i], p[2 * i + 1], dtype)
            for i, (dtype, swap) in enumerate(zip(ctx.dtypes, ctx.heads_last, strict=True))
        )
        gq, gk, gv = attention_backward(grad.contiguous(), q, k, v, ctx.is_causal, ctx.scale)
        return gq, gk, gv, None, None, None, None


# -- modules ------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned per-channel gain (no mean, no bias): `rms_norm`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """``silu(gate) * up`` of the two halves of the last dimension (gate first): the activation of
    a SwiGLU MLP whose gate and up projections are one linear layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class ScaledDotProductAttention(nn.Module):
    """``F.scaled_dot_product_attention`` as a module (no parameters), so that
    ``fp8lm.initialize(activations="fp8")`` can swap it for `FP8SavedAttention`."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        dropout_p: float = 0.0,
        scale: float | None = None,
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


class _SavesFP8:
    """What the FP8-saving modules share: the format and group size of what they save."""

    saved_format: Format
    group_size: int

    def _init_saving(self, fmt: Format | str, group_size: int) -> None:
        self.saved_format = format_of(fmt)
        if not self.saved_format.is_fp8:
            raise ValueError(f"saved activations are stored in E4M3 or E5M2, not {self.saved_format.name}")
        group_columns(1, group_size)  # refuses a group size < 1
        self.group_size = group_size

    def _saves(self, x: torch.Tensor, params: tuple) -> bool:
        """Whether this forward keeps anything for backward (else the plain computation runs)."""
        wants_grad = x.requires_grad or any(p is not None and p.requires_grad for p in params)
        return torch.is_grad_enabled() and wants_grad and x.numel() > 0

    def _saving_repr(self) -> str:
        return f"saved={self.saved_format.name}, group_size={self.group_size}"


def _on_local_shard(fn: Callable, x: torch.Tensor, params: tuple, *args, module: str):
    """``fn(x, *params, *args)``; for a DTensor ``x`` (sequence parallelism) on its local shard:
    the output is a DTensor of x's placements, and a parameter's gradient is a partial sum over
    the ranks that hold other rows (``Partial``), as DTensor's own ops give it."""
    if not isinstance(x, DTensor):
        return fn(x, *params, *args)
    last = x.ndim - 1
    if any(isinstance(p, Shard) and p.dim in (-1, last) for p in x.placements):
        raise ValueError(
            f"{module} computes over the last dimension, which this DTensor input shards ({x.placements}); "
            "shard it on another dimension (sequence parallelism shards dimension 1)"
        )
    partial = any(isinstance(p, Shard) for p in x.placements)
    grad_placements = tuple(Partial() if partial else Replicate() for _ in x.placements)
    local = tuple(p.to_local(grad_placements=grad_placements) if isinstance(p, DTensor) else p for p in params)
    out = fn(x.to_local(), *local, *args)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


class FP8SavedLayerNorm(_SavesFP8, nn.LayerNorm):
    """``nn.LayerNorm`` over the last dimension that saves its input in FP8 (module docstring)."""

    def __init__(self, *args, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FP8SavedLayerNorm normalizes the last dimension only, got {self.normalized_shape}")
        self._init_saving(saved_format, group_size)

    @classmethod
    def from_module(cls, module: nn.LayerNorm, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE):
        new = cls(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            bias=module.bias is not None,
            device="meta",
            saved_format=saved_format,
            group_size=group_size,
        )
        new.weight, new.bias = module.weight, module.bias  # the same Parameters
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._saves(x, (self.weight, self.bias)):
            return super().forward(x)
        return _on_local_shard(
            _LayerNorm.apply,
            x,
            (self.weight, self.bias),
            self.eps,
            self.saved_format,
            self.group_size,
            module=type(self).__name__,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._saving_repr()}"


class FP8SavedRMSNorm(_SavesFP8, RMSNorm):
    """`RMSNorm` that saves its input in FP8 (module docstring)."""

    def __init__(self, dim: int, eps: float, *, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE):
        super().__init__(dim, eps)
        self._init_saving(saved_format, group_size)

    @classmethod
    def from_module(cls, module: nn.Module, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE):
        """From a `RMSNorm` or a Hugging Face ``*RMSNorm`` (``weight``, ``variance_epsilon``)."""
        eps = module.eps if isinstance(module, RMSNorm) else module.variance_epsilon
        weight = module.get_parameter("weight")
        with torch.device("meta"):
            new = cls(weight.shape[0], float(eps), saved_format=saved_format, group_size=group_size)  # type: ignore[arg-type]
        new.weight = weight
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._saves(x, (self.weight,)):
            return super().forward(x)
        return _on_local_shard(
            _RMSNorm.apply, x, (self.weight,), self.eps, self.saved_format, self.group_size, module=type(self).__name__
        )

    def extra_repr(self) -> str:
        return f"eps={self.eps}, {self._saving_repr()}"


class FP8SavedGELU(_SavesFP8, nn.GELU):
    """``nn.GELU`` that saves its input in FP8 (module docstring)."""

    def __init__(
        self, approximate: str = "none", *, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE
    ) -> None:
        super().__init__(approximate)
        self._init_saving(saved_format, group_size)

    @classmethod
    def from_module(cls, module: nn.GELU, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE):
        return cls(module.approximate, saved_format=saved_format, group_size=group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._saves(x, ()):
            return super().forward(x)
        return _on_local_shard(
            _GELU.apply, x, (), self.approximate, self.saved_format, self.group_size, module=type(self).__name__
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._saving_repr()}"


class FP8SavedSwiGLU(_SavesFP8, SwiGLU):
    """`SwiGLU` that saves its gate and up halves in FP8 (module docstring)."""

    def __init__(self, *, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        self._init_saving(saved_format, group_size)

    @classmethod
    def from_module(cls, module: SwiGLU, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE):
        return cls(saved_format=saved_format, group_size=group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._saves(x, ()):
            return super().forward(x)
        if x.shape[-1] % 2:
            raise ValueError(f"SwiGLU splits the last dimension in two halves; it has odd size {x.shape[-1]}")
        return _on_local_shard(_SwiGLU.apply, x, (), self.saved_format, self.group_size, module=type(self).__name__)

    def extra_repr(self) -> str:
        return self._saving_repr()


class FP8SavedAttention(_SavesFP8, ScaledDotProductAttention):
    """`ScaledDotProductAttention` that saves q, k and v in FP8 and recomputes the rest in its
    backward (module docstring). Inputs (..., sequence, head_dim), as the kernel takes them; one
    scale per token and head (a group of ``head_dim`` columns, or of ``group_size`` where that
    divides it)."""

    def __init__(self, *, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        self._init_saving(saved_format, group_size)

    @classmethod
    def from_module(
        cls, module: ScaledDotProductAttention, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE
    ):
        return cls(saved_format=saved_format, group_size=group_size)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        dropout_p: float = 0.0,
        scale: float | None = None,
    ) -> torch.Tensor:
        wants_grad = any(t.requires_grad for t in (q, k, v))
        plain = dropout_p > 0 or not (torch.is_grad_enabled() and wants_grad and q.numel() > 0)
        if plain or any(isinstance(t, DTensor) for t in (q, k, v)):
            return super().forward(q, k, v, is_causal, dropout_p, scale)
        device = q.device.type
        if torch.is_autocast_enabled(device):  # the kernel's inputs as autocast makes them for SDPA
            q, k, v = (t.to(torch.get_autocast_dtype(device)) for t in (q, k, v))
        if not attention_saves_fp8(q, k, v):
            return super().forward(q, k, v, is_causal, dropout_p, scale)
        return _Attention.apply(q, k, v, is_causal, scale, self.saved_format, self.group_size)

    def extra_repr(self) -> str:
        return self._saving_repr()


SAVING_MODULES = (FP8SavedLayerNorm, FP8SavedRMSNorm, FP8SavedGELU, FP8SavedSwiGLU, FP8SavedAttention)


def _is_hf_rms_norm(module: nn.Module) -> bool:
    """A Hugging Face ``LlamaRMSNorm``-like module (found by name and attributes, so transformers
    need not be importable): `rms_norm` with ``variance_epsilon`` as eps and a 1-D ``weight``."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
    )


def _counterpart(module: nn.Module) -> type | None:
    """The FP8-saving class that replaces ``module``, or None."""
    kind = type(module)
    if isinstance(module, nn.LayerNorm) and kind is nn.LayerNorm and len(module.normalized_shape) == 1:
        return FP8SavedLayerNorm
    if kind is RMSNorm or (_is_hf_rms_norm(module) and not isinstance(module, SAVING_MODULES)):
        return FP8SavedRMSNorm
    return {nn.GELU: FP8SavedGELU, SwiGLU: FP8SavedSwiGLU, ScaledDotProductAttention: FP8SavedAttention}.get(kind)


def saving_counterpart(
    module: nn.Module, saved_format: Format | str = E4M3, group_size: int = GROUP_SIZE
) -> nn.Module | None:
    """The FP8-saving module that replaces ``module`` (sharing its parameters), or None when it
    has none (or already is one)."""
    cls = _counterpart(module)
    return None if cls is None else cls.from_module(module, saved_format, group_size)  # type: ignore[attr-defined]


def activation_targets(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that `saving_counterpart` replaces."""
    return [name for name, m in model.named_modules() if _counterpart(m) is not None]
