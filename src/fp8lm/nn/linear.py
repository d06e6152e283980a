"""`FP8Linear`: a drop-in `nn.Linear` whose three GEMMs run in FP8.

Forward ``y = x W^T + b``: input in E4M3 (delayed scaling by default), weight in E4M3 (scaled just
in time from its stored value). Backward: the output gradient in E5M2 (delayed scaling) feeds the
input-gradient and weight-gradient GEMMs; the weight gradient is returned quantized (E4M3 by
default), so it is stored at 1 byte per element and micro-batches accumulate into it with
dequantize-add-requantize. Only the FP8 copies of input and weight are saved for backward. The
bias stays in high precision. Under ``torch.autocast`` the output has the autocast dtype.

The weight is an ``nn.Parameter`` wrapping a `ScalingTensor` with an FP16 payload by default
(2 bytes per element, presenting as float32): optimizers, ``clip_grad_norm_`` and checkpoints see
ordinary float values. On an FP8 GEMM backend (``torch._scaled_mm``) its FP8 copy is made once per
change of the weight (optimizer step, load, FSDP2 all-gather), not once per forward, and kept
between steps (1 byte per element, 2 on CUDA with its transpose); a fine-grained recipe's
operands likewise (1 byte per element and its scales; 2 where its two GEMMs read the weight in
different blocks, rowwise and mxfp8; nvfp4 on an FP4 GEMM, its two layouts of packed E2M1, 1 in
all); under ``torch.compile`` they are made in the graph every forward. On CUDA each cast also
writes the transposed payload that the backward GEMMs read, so no FP8 operand is copied to
change its layout. A weight whose payload is
already in the GEMM's format (an E4M3 weight, FSDP2's FP8 all-gather) is its own operand: it is
saved for the backward as it is and transposed there, so that FSDP2 can free the gathered weight
between the forward and the backward, and nothing more is kept between steps.

Hook points: ``fp8_enabled = False`` runs the layer's GEMMs in high precision (BF16 under
autocast), as a precision policy sets it; ``high_precision = True`` (set and cleared by the
automatic fallback, `fp8lm.fallback`) does the same and also keeps the weight gradient in the
weight's dtype; ``keep_weight_operands = False`` keeps no weight operand between forwards (each
forward makes its own, as under torch.compile: up to 2 bytes per weight element less between
steps, for one more cast of the weight per micro-batch); ``input_meta`` and ``grad_output_meta``
are the `ScalingMeta` states of the two delayed-scaled tensor streams.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..block_tensor import gathered_operand
from ..formats import E4M3, FP16, FP32, Format, format_of
from ..ops.cast import saturating_cast_dequantized, saturating_cast_transposed, saturating_cast_with_amax
from ..ops.gemm import FP8Operand, choose_backend, emulation_dtype, fp8_mm, wants_laid_out_operands
from ..ops.library import traceable_amax, traceable_cast, traceable_cast_dequantized, traceable_upcast
from ..recipe import SCALING_MODES, Recipe, recipe_from
from ..scaling import ScalingMeta, ScalingSpec, compute_scale, record_, scale_for_amax_
from ..tensor import ScalingTensor, fsdp_unsharded, quantize
from .finegrained import fine_grained_linear
from .scale_math import _scale_math, _stored_weight_grad
from .state import dequantize_entries

__all__ = ["FP8Linear", "SCALING_MODES"]

State = tuple[torch.Tensor, ...]  # a ScalingMeta's buffers (ScalingMeta.state)


def _on_cpu_eagerly(t: torch.Tensor) -> bool:
    """Whether reading a value of ``t`` costs nothing: a CPU tensor, outside torch.compile tracing
    (where a Python number would specialize the graph on its value)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _finite_hint(amax_value: torch.Tensor) -> bool | None:
    """Whether a tensor with this amax is finite, where asking costs no device sync; else None."""
    return math.isfinite(amax_value.item()) if _on_cpu_eagerly(amax_value) else None


def _carry_nonfinite(scale_inv: torch.Tensor, amax_value: torch.Tensor) -> torch.Tensor:
    """``scale_inv``, made NaN when the tensor of this amax held inf or NaN: a GEMM with the
    operand then gives NaN everywhere (its dequantization multiplies by it), so non-finite checks
    downstream see it, at the cost of one scalar op rather than a pass over the output. (The
    saturating cast alone would turn an inf into the format's max.)"""
    return scale_inv + (amax_value - amax_value)  # + 0, or NaN for an inf/NaN amax


def _cast(
    x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fmt: Format, emulated_as: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The FP8 payload of ``x`` and, for an emulated GEMM multiplying in ``emulated_as``, its values
    read back in that dtype (None on FP8 hardware), so the GEMM needs no separate upcast."""
    if emulated_as is None:
        return traceable_cast(x, scale, fmt), None
    return traceable_cast_dequantized(x, scale, scale_inv, fmt, emulated_as)


def _stream_scales(spec: ScalingSpec, state: State, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x``'s amax, the scale to cast it with (recorded in ``state``) and its inverse, which
    carries non-finite values."""
    x_amax = traceable_amax(x)
    scale = scale_for_amax_(spec, state, x_amax)
    return x_amax, scale, _carry_nonfinite(scale.reciprocal(), x_amax)


def _recorded_scale_inv(spec: ScalingSpec, state: State, x_amax: torch.Tensor) -> torch.Tensor:
    """The inverse of the state's scale, which a tensor of amax ``x_amax`` was just cast with
    (carrying non-finite values); then that amax recorded in ``state`` (the next scale)."""
    scale_inv = _carry_nonfinite(state[0].reciprocal(), x_amax)
    record_(spec, state, x_amax)
    return scale_inv


class _Stream(NamedTuple):
    """How a tensor stream is cast: its scaling spec and state, the dtype an emulated GEMM
    multiplies in (None on FP8 hardware), whether the cast writes the transposed payload too
    (`saturating_cast_transposed`) and whether its scale is known before its amax (delayed, with
    history, on a device, eagerly: the cast takes the amax in the same pass)."""

    spec: ScalingSpec
    state: State
    emulated_as: torch.dtype | None
    relaid: bool
    scale_known: bool


def _stream_operand(x: torch.Tensor, stream: _Stream, sums_dtype: torch.dtype | None = None):
    """A delayed- or current-scaled tensor stream as a GEMM operand; the state is updated in place.
    Returns the operand and, where the cast could take it in the same pass, ``x.sum(0)`` as
    ``sums_dtype`` (else None).

    Where the scale is known in advance (delayed scaling with history) the cast takes the amax in
    the same read of ``x``: on CPU recasting an outlier at once, on a device (no host sync)
    restarting the history so that the following steps are rescaled. Otherwise, and while
    torch.compile traces, the amax comes first and the scale from it in tensor ops
    (`fp8lm.scaling.scale_and_record_`: the numbers of the CPU path, one graph for every step)."""
    spec, state, emulated_as = stream.spec, stream.state, stream.emulated_as
    if _on_cpu_eagerly(x) and spec.delayed and int(state[2]) > 0:
        return _delayed_operand_one_pass(x, spec, state, emulated_as), None
    if stream.scale_known and stream.relaid:
        data, transposed, x_amax, sums = saturating_cast_transposed(x, state[0], spec.fmt, True, sums_dtype)
        assert x_amax is not None  # asked for
        scale_inv = _scale_math(_recorded_scale_inv, x, spec, state, x_amax)
        return FP8Operand(data, scale_inv, relaid=transposed.t()), sums
    x_amax, scale, scale_inv = _scale_math(_stream_scales, x, spec, state, x)
    if stream.relaid:
        data, transposed, _, _ = saturating_cast_transposed(x, scale, spec.fmt)
        return FP8Operand(data, scale_inv, _finite_hint(x_amax), relaid=transposed.t()), None
    data, deq = _cast(x, scale, scale_inv, spec.fmt, emulated_as)
    return FP8Operand(data, scale_inv, _finite_hint(x_amax), dequantized=deq), None


def _delayed_operand_one_pass(
    x: torch.Tensor, spec: ScalingSpec, state: State, emulated_as: torch.dtype | None
) -> FP8Operand:
    """`_stream_operand` on CPU with the scale from the amax history: cast and amax in one pass."""
    scale = state[0].clone()  # the state's scale changes when the amax is recorded
    if emulated_as is None:
        (data, x_amax), deq = saturating_cast_with_amax(x, scale, spec.fmt), None
    else:
        data, deq, cast_amax = saturating_cast_dequantized(x, scale, spec.fmt, emulated_as, with_amax=True)
        assert cast_amax is not None  # asked for with with_amax
        x_amax = cast_amax
    if record_(spec, state, x_amax):  # an outlier for the delayed scale: cast again with its own scale
        scale = state[0].clone()
        data, deq = _cast(x, scale, scale.reciprocal(), spec.fmt, emulated_as)
    finite = _finite_hint(x_amax)
    if not finite:  # read back with a finite scale: the NaN-carrying one reads it again
        return FP8Operand(data, _carry_nonfinite(scale.reciprocal(), x_amax), finite)
    return FP8Operand(data, scale.reciprocal(), finite, dequantized=deq)


def _weight_scales(
    payload: torch.Tensor, payload_amax: torch.Tensor | None, stored_scale: torch.Tensor | None, fmt: Format
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The weight's amax, the scale to cast its ``payload`` to ``fmt`` with (None: it is already
    ``fmt``) and the inverse of the combined scale (the weight's values, not its payload's),
    which carries non-finite values. ``payload_amax``: the payload's amax where its writer
    measured it (`ScalingTensor.known_payload_amax`), else None (measured here)."""
    if payload_amax is None:
        payload_amax = traceable_amax(payload)
    value_amax = payload_amax if stored_scale is None else payload_amax / stored_scale
    if stored_scale is not None and payload.dtype == fmt.dtype:
        return value_amax, None, _carry_nonfinite(stored_scale.reciprocal(), value_amax)
    scale = compute_scale(payload_amax, fmt)
    combined = scale if stored_scale is None else scale * stored_scale
    return value_amax, scale, _carry_nonfinite(combined.reciprocal(), value_amax)


def _weight_operand(
    payload: torch.Tensor,
    stored_scale: torch.Tensor | None,
    fmt: Format,
    emulated_as: torch.dtype | None,
    relaid: bool = False,
    payload_amax: torch.Tensor | None = None,
) -> FP8Operand:
    """FP8 (``fmt``) operand of the weight, scaled just in time. ``payload``: the weight's stored
    values (a ScalingTensor's payload, with its ``stored_scale``; or the plain weight, with None),
    read directly with one combined power-of-two scale (no float32 copy of the weight). A payload
    already in ``fmt`` (an E4M3 weight, FSDP2's FP8 all-gather) is the operand as it is.
    ``emulated_as``: as in `_cast`; ``relaid``: also write the transposed payload (`_Stream`) of
    a payload cast here (not of one already in ``fmt``: see below);
    ``payload_amax``: as in `_weight_scales`."""
    value_amax, scale, scale_inv = _scale_math(_weight_scales, payload, payload, payload_amax, stored_scale, fmt)
    finite = _finite_hint(value_amax)
    if scale is None:
        # The payload itself, without its transpose even where ``relaid`` asks for it: the forward
        # GEMM reads it as it is, and the backward lays it out for the input gradient. Under FSDP2
        # this payload is the gathered parameter, freed after the forward and gathered again for
        # the backward; a transposed copy saved for the backward (or kept between steps) would
        # hold every layer's unsharded weight instead.
        deq = None if emulated_as is None else traceable_upcast(payload, scale_inv, emulated_as)
        return FP8Operand(payload, scale_inv, finite, dequantized=deq)
    if relaid:
        data, transposed, _, _ = saturating_cast_transposed(payload, scale, fmt)
        return FP8Operand(data, scale_inv, finite, relaid=transposed.t())
    data, deq = _cast(payload, scale, scale_inv, fmt, emulated_as)
    return FP8Operand(data, scale_inv, finite, dequantized=deq)


class _WeightOperandCache:
    """An FP8Linear's GEMM operands of its ScalingTensor weight (the tensorwise FP8 operand, or a
    fine-grained recipe's `fp8lm.nn.finegrained.WeightOperands`), made once per change of the
    weight (an optimizer step, a load, an in-place op, FSDP2's all-gather) rather than once per
    forward. Valid while the weight, its payload and its scale are the tensors they were made from,
    unchanged: every in-place change bumps a tensor's version (torch's ops,
    `ScalingTensor.requantize_`, the optimizer's custom op). The layer clears it where it replaces
    its state in other ways (loads, ``.to()``). Copies and pickles of the layer start empty; the
    payload is held weakly (an all-gathered weight is freed after its forward)."""

    def __init__(self) -> None:
        self._entry: tuple | None = None

    def clear(self) -> None:
        self._entry = None

    def operands(self, *weights: ScalingTensor) -> dict:
        """The operands made of ``weights`` (one layer's, or all its experts') as they are now, by
        key: the dict kept since their last change, or a new empty one."""
        tensors = [t for w in weights for t in (w.payload, w.scale)]
        versions = tuple(t._version for t in (*weights, *tensors))
        if self._entry is not None:
            refs, made_at, operands = self._entry
            if made_at == versions and len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors)):
                return operands
        operands = {}
        self._entry = (tuple(weakref.ref(t) for t in tensors), versions, operands)
        return operands

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the kept operands hold (payloads, their other layouts, scales)."""
        operands = [] if self._entry is None else list(self._entry[2].values())
        return [t for operand in operands for t in _operand_tensors(operand)]

    def kept_for(self, stored: Sequence[torch.Tensor], device: torch.device, recipe: Recipe) -> dict | None:
        """Where ``recipe``'s operands of the ``stored`` weights (a layer's, or its experts') are
        kept between forwards (eagerly, on an FP8 GEMM backend, as the tensorwise layer keeps its
        FP8 copy): the dict for the weights as they are now; None for plain weights (a write
        through ``.data`` leaves a version as it was) and for weights FSDP2 all-gathered in their
        own format, whose operands would otherwise stay as large as the unsharded weights."""
        if torch.compiler.is_compiling() or choose_backend(device, recipe.backend) != "scaled_mm":
            return None
        weights = [w for w in stored if isinstance(w, ScalingTensor) and not fsdp_unsharded(w)]
        if not weights or len(weights) != len(stored):
            return None
        return self.operands(*weights)

    def get(self, weight: ScalingTensor, fmt: Format, relaid: bool) -> FP8Operand:
        """`_weight_operand` of ``weight`` for an FP8 GEMM (no emulation), made anew when ``weight``
        changed since the kept one was made."""
        operands = self.operands(weight)
        key = ("tensorwise", fmt, relaid)
        if key not in operands:
            payload, scale = weight.payload, weight.scale
            operands[key] = _weight_operand(payload, scale, fmt, None, relaid, weight.known_payload_amax())
        return operands[key]

    def __deepcopy__(self, memo) -> _WeightOperandCache:
        return _WeightOperandCache()

    def __reduce__(self):
        return (_WeightOperandCache, ())


def _operand_tensors(operand) -> list[torch.Tensor]:
    """The tensors of a kept operand: an `FP8Operand` (its payload layouts, inverse scale and
    cached upcasts) or a tuple of tensors (`BlockOperand`, `FP4Operand`, the FP4 layouts)."""
    if isinstance(operand, torch.Tensor):
        return [operand]
    if isinstance(operand, FP8Operand):
        return [
            t for t in (operand._base, operand._relaid, operand.scale_inv, *operand._cache.values()) if t is not None
        ]
    if isinstance(operand, tuple):
        return [t for part in operand for t in _operand_tensors(part)]
    return []


class _Eager(NamedTuple):
    """What eager execution adds to the Function's tensors (None while torch.compile traces, where
    every step runs one graph): the weight's operand made once per change of the weight (or None),
    else the amax its writer measured of the weight's payload (or None), and the scaling states'
    modules, which know without a host sync whether a delayed stream has history, so its cast can
    take the amax in the same pass."""

    weight: FP8Operand | None
    weight_amax: torch.Tensor | None
    input_meta: ScalingMeta
    grad_output_meta: ScalingMeta


def _scale_known(eager: _Eager | None, meta_name: str) -> bool:
    return eager is not None and getattr(eager, meta_name).scale_known_in_advance


class _FP8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with FP8 GEMMs. Takes only tensors and constants (the frozen recipe and
    scaling specs; in eager mode also `_Eager`), and updates the scaling state (tuples of buffers)
    in place, so that ``torch.compile`` traces it into the model's graph."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        w_payload: torch.Tensor,
        w_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        input_state: State,
        grad_output_state: State,
        recipe: Recipe,
        input_spec: ScalingSpec,
        grad_output_spec: ScalingSpec,
        weight_grad_format: Format,
        eager: _Eager | None,
    ):
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        emulated = choose_backend(x.device, recipe.backend) == "emulated"
        emulated_as = emulation_dtype(out_dtype, x.device) if emulated else None
        laid_out = wants_laid_out_operands(x.device, recipe.backend)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        stream = _Stream(input_spec, input_state, emulated_as, laid_out and need_w, _scale_known(eager, "input_meta"))
        x_op, _ = _stream_operand(x2, stream)
        if eager is not None:
            eager.input_meta.mark_recorded()
        w_op = eager.weight if eager is not None and eager.weight is not None else None
        if w_op is None:
            known_amax = None if eager is None else eager.weight_amax
            w_op = _weight_operand(w_payload, w_scale, recipe.weight_format, emulated_as, laid_out, known_amax)
        b = None if bias is None else bias.detach()
        with torch.autocast(device_type, enabled=False):
            y = fp8_mm(x_op, w_op.t(), out_dtype, bias=b, backend=recipe.backend)

        ctx.recipe, ctx.grad_output_spec, ctx.weight_grad_format = recipe, grad_output_spec, weight_grad_format
        # Not saved tensors: the backward pass updates them in place (version checks would refuse
        # a second backward through a layer after the first updated them).
        ctx.grad_output_state, ctx.eager, ctx.laid_out = grad_output_state, eager, laid_out
        ctx.out_dtype, ctx.emulated_as = out_dtype, emulated_as
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.weight_dtype, ctx.plain_weight = weight.dtype, w_scale is None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_finite, ctx.w_finite = x_op.finite, w_op.finite
        # Each saved in the layout its backward GEMM reads it in (the second operand: column-major).
        x_saved, w_saved = x_op.stored(row_major=False), w_op.stored(row_major=False)
        ctx.save_for_backward(
            (x_op.data if x_saved is None else x_saved) if need_w else None,
            x_op.scale_inv if need_w else None,
            (w_op.data if w_saved is None else w_saved) if need_x else None,
            w_op.scale_inv if need_x else None,
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x8, x_scale_inv, w8, w_scale_inv = ctx.saved_tensors
        backend = ctx.recipe.backend
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_b = ctx.needs_input_grad[4]
        stream = _Stream(
            ctx.grad_output_spec,
            ctx.grad_output_state,
            ctx.emulated_as,
            ctx.laid_out and ctx.needs_input_grad[1],
            _scale_known(ctx.eager, "grad_output_meta"),
        )
        g_op, grad_b = _stream_operand(g2, stream, ctx.bias_dtype if need_b else None)
        if ctx.eager is not None:
            ctx.eager.grad_output_meta.mark_recorded()
        grad_x = grad_w = None
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                w_op = FP8Operand(w8, w_scale_inv, ctx.w_finite)
                grad_x = fp8_mm(g_op, w_op, ctx.out_dtype, backend=backend).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                x_op = FP8Operand(x8, x_scale_inv, ctx.x_finite)
                grad_w = fp8_mm(g_op.t(), x_op, ctx.out_dtype, backend=backend)
                plain = ctx.plain_weight and torch.compiler.is_compiling()
                grad_w = _stored_weight_grad(grad_w, ctx.weight_grad_format, ctx.weight_dtype, plain)
            if need_b and grad_b is None:
                grad_b = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, None, None, grad_b, None, None, None, None, None, None, None


class FP8Linear(nn.Module):
    """``nn.Linear`` with FP8 GEMMs, FP8 weight gradient and a low-precision weight.

    Args beyond ``nn.Linear``'s:
        weight_format: storage of the weight. FP16 (default): a ScalingTensor with an FP16 payload
            and a power-of-two scale; any other fp8lm format likewise; FP32: a plain parameter.
        weight_grad_format: storage of the weight gradient: E4M3 (default) or another format;
            FP32 gives a plain gradient of the weight's dtype.
        recipe: an `fp8lm.Recipe` or a recipe name (default ``"tensorwise-delayed"``): operand
            formats, delayed or current scaling, amax history length, margin, GEMM backend.
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
    ):
        super().__init__()
        recipe = recipe_from(recipe, "FP8Linear")
        self.in_features = in_features
        self.out_features = out_features
        self.weight_format = format_of(weight_format)
        self.weight_grad_format = format_of(weight_grad_format)
        self.recipe = recipe
        self.fp8_enabled = True
        self.high_precision = False
        self.keep_weight_operands = True
        # Checkpoints of a layer converted from a GPT-2 Conv1D keep Conv1D's (in, out) weight layout.
        self.transposed_checkpoint = False
        # Set by fp8lm's row-wise tensor-parallel style: the output is a partial sum that the
        # style reduces over the ranks, and it adds the bias after.
        self.bias_after_reduction = False
        self._weight_operand = _WeightOperandCache()
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

    def _local_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The weight and bias this rank multiplies, and the tensor that holds the weight's stored
        bytes. For the DTensor parameters of the tensor-parallel styles: their local tensors,
        differentiable ``to_local()`` views for the GEMMs, and the DTensor's own local tensor for
        the bytes (torch.compile traces into a graph input's inner tensors, not into those of a
        tensor made inside the graph); no bias where the style adds it after its reduction."""
        weight: torch.Tensor = self.weight
        bias, stored = self.bias, weight
        if isinstance(weight, DTensor):
            stored, weight = weight._local_tensor, weight.to_local()
        if self.bias_after_reduction:
            bias = None
        elif isinstance(bias, DTensor):
            bias = bias.to_local()
        return weight, bias, stored

    def kept_operands(self) -> list[torch.Tensor]:
        """The tensors of the weight operands this layer keeps between forwards (made once per
        change of the weight on an FP8 GEMM backend; see the module doc): what
        `fp8lm.memory_report` counts as ``weight_operands``."""
        return self._weight_operand.tensors()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, stored = self._local_parameters()
        if not self.fp8_enabled or self.high_precision or x.numel() == 0:  # an empty batch has no amax to scale by
            return F.linear(x, weight, bias)
        if isinstance(stored, ScalingTensor):
            payload, stored_scale = stored.payload, stored.scale
        else:
            payload, stored_scale = weight.detach(), None
        keep = self.keep_weight_operands
        if not keep and not torch.compiler.is_compiling():  # switched off: what was kept goes
            self._weight_operand.clear()
        if self.recipe.fine_grained:  # current scaling per block: no scaling state
            # FSDP2 may have gathered the recipe's operand (a BlockScaledTensor)
            operand = gathered_operand(weight)
            keep = keep and operand is None
            kept = self._weight_operand.kept_for((stored,), x.device, self.recipe) if keep else None
            return fine_grained_linear(
                x, weight, bias, self.recipe, operand, self.weight_grad_format, stored=stored, kept_operands=kept
            )
        for meta in (self.input_meta, self.grad_output_meta):
            if meta.scale.device != x.device:
                meta.to(x.device)
        eager = None
        if not torch.compiler.is_compiling():
            weight_op = weight_amax = None  # an emulated GEMM also reads the weight upcast: not kept between steps
            fp8_gemm = choose_backend(x.device, self.recipe.backend) == "scaled_mm"
            if isinstance(stored, ScalingTensor) and fp8_gemm and keep:
                laid_out = wants_laid_out_operands(x.device, self.recipe.backend)
                weight_op = self._weight_operand.get(stored, self.recipe.weight_format, laid_out)
            elif isinstance(stored, ScalingTensor):
                weight_amax = stored.known_payload_amax()
            eager = _Eager(weight_op, weight_amax, self.input_meta, self.grad_output_meta)
        return _FP8LinearFunction.apply(
            x,
            weight,
            payload,
            stored_scale,
            bias,
            self.input_meta.state,
            self.grad_output_meta.state,
            self.recipe,
            self.input_meta.spec,
            self.grad_output_meta.spec,
            self.weight_grad_format,
            eager,
        )

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
        self._weight_operand.clear()
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
