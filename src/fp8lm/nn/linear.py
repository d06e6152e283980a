"""`FP8Linear`: a drop-in `nn.Linear` whose three GEMMs run in FP8.

Forward ``y = x W^T + b``: input in E4M3 (delayed scaling by default), weight in E4M3 (scaled just
in time from its stored value). Backward: the output gradient in E5M2 (delayed scaling) feeds the
input-gradient and weight-gradient GEMMs; the weight gradient is returned quantized (E4M3 by
default), so it is stored at 1 byte per element and micro-batches accumulate into it with
dequantize-add-requantize. Only the FP8 copies of input and weight are saved for backward. The
bias stays in high precision. Under ``torch.autocast`` the output has the autocast dtype.

The weight is an ``nn.Parameter`` wrapping a `ScalingTensor` with an FP16 payload by default
(2 bytes per element, presenting as float32): optimizers, ``clip_grad_norm_`` and checkpoints see
ordinary float values.

Hook points: ``fp8_enabled = False`` runs the layer's GEMMs in high precision (BF16 under
autocast), as a precision policy sets it; ``high_precision = True`` (set and cleared by the
automatic fallback, `fp8lm.fallback`) does the same and also keeps the weight gradient in the
weight's dtype; ``input_meta`` and ``grad_output_meta`` are the `ScalingMeta` states of the two
delayed-scaled tensor streams.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import E4M3, FP16, FP32, Format, format_of
from ..ops.cast import amax, saturating_cast, saturating_cast_dequantized, saturating_cast_with_amax
from ..ops.gemm import FP8Operand, choose_backend, emulation_dtype, fp8_mm
from ..recipe import SCALING_MODES, Recipe, recipe_from
from ..scaling import ScalingMeta, compute_scale
from ..tensor import ScalingTensor, quantize
from .state import dequantize_entries

__all__ = ["FP8Linear", "SCALING_MODES"]


def _finite_hint(amax_value: torch.Tensor) -> bool | None:
    """Whether a tensor with this amax is finite, where asking costs no device sync (CPU) and does
    not make torch.compile specialize on the value."""
    if amax_value.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return math.isfinite(amax_value.item())


def _propagate_nonfinite(out: torch.Tensor, amax_value: torch.Tensor, finite: bool | None) -> torch.Tensor:
    """The saturating cast turns inf into the format's max; make ``out`` NaN when its FP8 operand
    came from a non-finite tensor, so non-finite checks downstream still see it."""
    if finite is True:
        return out
    return out.add_((amax_value - amax_value).to(out.dtype))  # 0, or NaN for an inf/NaN amax


def _cast_with(
    x: torch.Tensor, scale: torch.Tensor, meta: ScalingMeta, emulated_as: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The FP8 payload of ``x`` with a known scale, and its values read back in ``emulated_as``."""
    if emulated_as is None:
        return saturating_cast(x, scale, meta.fmt), None
    data, deq, _ = saturating_cast_dequantized(x, scale, meta.fmt, emulated_as)
    return data, deq


def _cast_operand(
    x: torch.Tensor, meta: ScalingMeta, emulated_as: torch.dtype | None
) -> tuple[FP8Operand, torch.Tensor]:
    """A delayed- or current-scaled tensor stream as a GEMM operand, and its amax. With a known
    delayed scale, the cast and this tensor's amax come from one read of ``x``. ``emulated_as``:
    the dtype an emulated GEMM will multiply in (None on FP8 hardware); the cast then also returns
    the values read back in it, so the GEMM needs no separate upcast."""
    if meta.scale_known_in_advance:
        scale = meta.scale
        if emulated_as is None:
            (data, x_amax), deq = saturating_cast_with_amax(x, scale, meta.fmt), None
        else:
            data, deq, cast_amax = saturating_cast_dequantized(x, scale, meta.fmt, emulated_as, with_amax=True)
            assert cast_amax is not None  # asked for with with_amax
            x_amax = cast_amax
        if meta.record(x_amax):  # an outlier for the delayed scale: cast again with its own scale
            scale = meta.scale
            data, deq = _cast_with(x, scale, meta, emulated_as)
    else:
        scale = meta.scale_for(x)
        x_amax = meta.last_amax.clone()
        data, deq = _cast_with(x, scale, meta, emulated_as)
    return FP8Operand(data, scale.reciprocal(), _finite_hint(x_amax), dequantized=deq), x_amax


def _quantize_weight(
    weight: torch.Tensor, fmt: Format, emulated_as: torch.dtype | None
) -> tuple[FP8Operand, torch.Tensor]:
    """FP8 (``fmt``) operand of the weight, scaled just in time; reads a ScalingTensor's payload directly
    with one combined power-of-two scale (no float32 copy of the weight). ``emulated_as``: as in
    `_cast_operand`."""
    if isinstance(weight, ScalingTensor) and weight.payload.dtype == fmt.dtype:
        # Already an operand of this format (an E4M3 weight, FSDP2's FP8 all-gather): no second cast.
        value_amax = amax(weight.payload).float() / weight.scale
        deq = None if emulated_as is None else weight.dequantize(emulated_as)
        return FP8Operand(weight.payload, weight.scale_inv, _finite_hint(value_amax), dequantized=deq), value_amax
    if isinstance(weight, ScalingTensor):
        source, payload_amax = weight.payload, amax(weight.payload)
        scale = compute_scale(payload_amax, fmt)
        value_amax = payload_amax / weight.scale
        scale_inv = (scale * weight.scale).reciprocal()
    else:
        source = weight.detach()
        value_amax = amax(source)
        scale = compute_scale(value_amax, fmt)
        scale_inv = scale.reciprocal()
    if emulated_as is None:
        data, deq = saturating_cast(source, scale, fmt), None
    else:  # read back with the combined scale: the weight's values, not its payload's
        data, deq, _ = saturating_cast_dequantized(source, scale, fmt, emulated_as, scale_inv=scale_inv)
    return FP8Operand(data, scale_inv, _finite_hint(value_amax), dequantized=deq), value_amax


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer: FP8Linear):
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        emulated_as = (
            emulation_dtype(out_dtype, x.device) if choose_backend(x.device, layer.backend) == "emulated" else None
        )
        x_op, x_amax = _cast_operand(x2, layer.input_meta, emulated_as)
        w_op, w_amax = _quantize_weight(weight, layer.recipe.weight_format, emulated_as)
        b = None if bias is None else bias.detach()
        with torch.autocast(device_type, enabled=False):
            y = fp8_mm(x_op, w_op.t(), out_dtype, bias=b, backend=layer.backend)
        if not (x_op.finite and w_op.finite):
            y = _propagate_nonfinite(y, torch.maximum(x_amax, w_amax), None)

        ctx.layer = layer
        ctx.out_dtype = out_dtype
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.x_finite, ctx.w_finite = x_op.finite, w_op.finite
        ctx.emulated_as = emulated_as
        ctx.save_for_backward(
            x_op.data if need_w else None,
            x_op.scale_inv if need_w else None,
            w_op.data if need_x else None,
            w_op.scale_inv if need_x else None,
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        layer: FP8Linear = ctx.layer
        x8, x_scale_inv, w8, w_scale_inv = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_op, g_amax = _cast_operand(g2, layer.grad_output_meta, ctx.emulated_as)
        g_finite = g_op.finite
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                w_op = FP8Operand(w8, w_scale_inv, ctx.w_finite)
                grad_x = fp8_mm(g_op, w_op, ctx.out_dtype, backend=layer.backend)
                grad_x = _propagate_nonfinite(grad_x, g_amax, g_finite).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                x_op = FP8Operand(x8, x_scale_inv, ctx.x_finite)
                grad_w = _propagate_nonfinite(
                    fp8_mm(g_op.t(), x_op, ctx.out_dtype, backend=layer.backend), g_amax, g_finite
                )
                grad_w = layer._store_weight_grad(grad_w, ctx.weight_dtype)
            if ctx.needs_input_grad[2]:
                grad_b = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


# Inside a torch.compile-d model the layer runs as compiled-out eager code: traced, its autograd
# Function would be compiled once per layer (guards on the layer object), and a model has more
# FP8 layers than torch.compile's recompile limit (measured: the limit hit at 17 layers, then eager
# anyway). Its casts are fused kernels of their own (the C kernels on CPU, compiled ones on CUDA).
_fp8_linear = torch.compiler.disable(_FP8LinearFunction.apply, recursive=True)


class FP8Linear(nn.Module):
    """``nn.Linear`` with FP8 GEMMs, FP8 weight gradient and a low-precision weight.

    Args beyond ``nn.Linear``'s:
        weight_format: storage of the weight. FP16 (default): a ScalingTensor with an FP16 payload
            and a power-of-two scale; any other fp8lm format likewise; FP32: a plain parameter.
        weight_grad_format: storage of the weight gradient: E4M3 (default) or another format;
            FP32 gives a plain gradient of the weight's dtype.
        recipe: an `fp8lm.Recipe` or a recipe name (default ``"tensorwise-delayed"``): operand
            formats, delayed or current scaling, amax history length, margin, GEMM backend.
        history_len, scaling, backend: deprecated (a DeprecationWarning names the recipe to pass).
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        weight_format: Format | str = FP16,
        weight_grad_format: Format | str = E4M3,
        recipe: Recipe | str | None = None,
        history_len: int | None = None,
        scaling: str | None = None,
        backend: str | None = None,
    ):
        super().__init__()
        recipe = recipe_from(recipe, "FP8Linear", history_len=history_len, scaling=scaling, backend=backend)
        self.in_features = in_features
        self.out_features = out_features
        self.weight_format = format_of(weight_format)
        self.weight_grad_format = format_of(weight_grad_format)
        self.recipe = recipe
        self.fp8_enabled = True
        self.high_precision = False
        # Checkpoints of a layer converted from a GPT-2 Conv1D keep Conv1D's (in, out) weight layout.
        self.transposed_checkpoint = False
        self.input_meta = ScalingMeta(recipe.input_format, history_len=recipe.steps, margin=recipe.margin)
        self.grad_output_meta = ScalingMeta(recipe.grad_output_format, history_len=recipe.steps, margin=recipe.margin)
        factory = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        weight = torch.empty(out_features, in_features, **factory)
        bias_value = torch.empty(out_features, **factory) if bias else None
        if weight.device.type != "meta":
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            # nn.Linear's initialization (kaiming_uniform with a=sqrt(5) is this bound for the weight).
            nn.init.uniform_(weight, -bound, bound)
            if bias_value is not None:
                nn.init.uniform_(bias_value, -bound, bound)
        # Registered in nn.Linear's order, weight then bias: optimizer param indices, DDP buckets and
        # saved optimizer states follow named_parameters().
        self.weight = self._stored_weight(weight)
        self.register_parameter("bias", None if bias_value is None else nn.Parameter(bias_value))

    @property
    def scaling(self) -> str:
        """``"delayed"`` or ``"current"``: the recipe's scaling."""
        return self.recipe.scaling

    @property
    def backend(self) -> str:
        """The recipe's FP8 GEMM backend."""
        return self.recipe.backend

    def _stored_weight(self, value: torch.Tensor) -> nn.Parameter:
        """``value`` as this layer's weight parameter, in ``weight_format``."""
        value = value.detach()
        if self.weight_format == FP32 or value.device.type == "meta":
            return nn.Parameter(value.clone() if self.weight_format == FP32 else value)
        return nn.Parameter(quantize(value, self.weight_format))

    def _store_weight_grad(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.weight_grad_format == FP32:
            return grad.to(dtype)
        fmt = self.weight_grad_format
        scale = compute_scale(amax(grad), fmt)  # quantize's steps, presenting the weight's dtype
        return ScalingTensor(saturating_cast(grad, scale, fmt), scale, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Module, **options) -> FP8Linear:
        """An FP8Linear with ``linear``'s weight and bias values (an ``nn.Linear``, or a GPT-2
        ``Conv1D``: weight of shape (in, out), attribute ``nf``, detected without importing
        transformers). ``options`` are FP8Linear's keyword arguments."""
        conv1d = is_conv1d(linear)
        if not conv1d and not isinstance(linear, nn.Linear):
            raise TypeError(
                f"FP8Linear.from_linear expects an nn.Linear or a GPT-2 Conv1D, got {type(linear).__name__}"
            )
        source_weight = linear.get_parameter("weight")
        source_bias = None if linear.bias is None else linear.get_parameter("bias")
        weight = source_weight.detach().t() if conv1d else source_weight.detach()
        out_features, in_features = weight.shape
        layer = cls(
            in_features, out_features, bias=source_bias is not None, device="meta", dtype=weight.dtype, **options
        )
        layer.weight = layer._stored_weight(weight.contiguous())
        if source_bias is not None:
            layer.bias = nn.Parameter(source_bias.detach().clone(), requires_grad=source_bias.requires_grad)
        layer.weight.requires_grad_(source_weight.requires_grad)
        layer.transposed_checkpoint = conv1d
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled or self.high_precision or x.numel() == 0:  # an empty batch has no amax to scale by
            return F.linear(x, self.weight, self.bias)
        return _fp8_linear(x, self.weight, self.bias, self)

    # -- checkpoints: plain tensors in the original layout ----------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:
            return
        dequantize_entries(destination, prefix, ("weight",))
        if self.transposed_checkpoint:
            destination[prefix + "weight"] = destination[prefix + "weight"].t().contiguous()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "weight"
        if self.transposed_checkpoint and isinstance(state_dict.get(key), torch.Tensor):
            state_dict = {**state_dict, key: state_dict[key].t()}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight={self.weight_format.name}, weight_grad={self.weight_grad_format.name}, "
            f"recipe={self.recipe.name or self.recipe}, fp8_enabled={self.fp8_enabled}, high_precision={self.high_precision}"
        )


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is laid out like GPT-2's ``transformers.pytorch_utils.Conv1D``: a linear
    layer ``x @ weight + bias`` with weight (in, out) and ``nf == out``; found by class name and
    layout so transformers need not be importable."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and getattr(module, "nf", None) == weight.shape[1]
    )
