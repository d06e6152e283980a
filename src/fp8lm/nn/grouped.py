"""`GroupedLinear` and `FP8GroupedLinear`: the linear layers of ``E`` experts over tokens sorted by
expert (a mixture of experts' grouped GEMMs).

The tokens arrive as one ``(T, in)`` tensor, sorted by expert, with ``counts`` (how many rows each
expert takes, in expert order, summing to ``T``); rows of expert ``e`` become ``x W_e^T``. Each
expert's weight is a parameter of its own, ``weight[e]`` of shape ``(out, in)`` (held in an
``nn.ParameterList``), so it is stored like every FP8 weight: `fp8lm.initialize` gives it one
`ScalingTensor` with one scale per expert (O2: an FP16 payload, O3: E4M3 with an FP16 master), an
E4M3 gradient with its own scale, and FP8AdamW moments of its own. An entry may be None: an
expert this rank does not hold (expert parallelism, `fp8lm.distributed.ExpertParallelMoE`), which
must get no rows; the others keep their names (``weight.<expert>``) as in the whole layer.

`FP8GroupedLinear` runs each expert's three GEMMs in FP8 with tensorwise scales per expert:

- forward: expert ``e``'s rows in the recipe's input format (E4M3), scaled by the amax of that
  group of rows; the weight in E4M3, scaled just in time from its stored value;
- input gradient: the output gradient's rows of ``e`` in E5M2, scaled by their own amax, times the
  weight;
- weight gradient: the output gradient's rows times the input's, returned quantized
  (``weight_grad_format``, E4M3 by default) with its own scale.

The token groups are scaled just in time (current scaling) whatever the recipe's scaling: the rows
an expert receives change from step to step, and a rarely routed expert would be cast with a
history of other tokens. The recipe gives the formats, the margin and the GEMM backend. The result
is exactly that of one `fp8lm.ops.gemm.fp8_mm` per expert (the emulation on CPU,
``torch._scaled_mm`` on capable GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import E4M3, FP16, FP32, Format, format_of
from ..ops.gemm import FP8Operand, choose_backend, emulation_dtype, fp8_mm
from ..ops.library import traceable_amax
from ..recipe import Recipe, recipe_from
from ..scaling import compute_scale
from ..tensor import ScalingTensor, quantize
from .linear import _carry_nonfinite, _cast, _finite_hint, _scale_math, _stored_weight_grad, _weight_operand

__all__ = ["GroupedLinear", "FP8GroupedLinear", "group_counts"]


def group_counts(counts: Sequence[int] | torch.Tensor, num_experts: int, rows: int) -> list[int]:
    """``counts`` (tokens per expert, a sequence or a 1-D tensor) as a list of ints, checked
    against the experts and the rows of the tokens."""
    values = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
    if len(values) != num_experts or any(c < 0 for c in values) or sum(values) != rows:
        raise ValueError(
            f"counts must give {num_experts} non-negative token counts, one per expert, summing to the {rows} "
            f"rows of the input; got {values}"
        )
    return values


def _group_scales(x: torch.Tensor, fmt: Format, margin: int) -> tuple[torch.Tensor, ...]:
    """The amax of ``x``, the scale to cast it with and its inverse (carrying non-finite values)."""
    x_amax = traceable_amax(x)
    scale = compute_scale(x_amax, fmt, margin)
    return x_amax, scale, _carry_nonfinite(scale.reciprocal(), x_amax)


def _group_operand(x: torch.Tensor, fmt: Format, margin: int, emulated_as: torch.dtype | None) -> FP8Operand:
    """One expert's rows as an FP8 operand, scaled from their own amax (current scaling); off the
    CPU the amax and scale arithmetic is one compiled function, as FP8Linear's."""
    x_amax, scale, scale_inv = _scale_math(_group_scales, x, x, fmt, margin)
    data, deq = _cast(x, scale, scale_inv, fmt, emulated_as)
    return FP8Operand(data, scale_inv, _finite_hint(x_amax), dequantized=deq)


def _expert_weight_operand(weight: torch.Tensor, fmt: Format, emulated_as: torch.dtype | None) -> FP8Operand:
    """One expert's weight as an FP8 operand, from its stored payload and scale (just in time; the
    payload's amax taken from its writer where it noted one)."""
    if isinstance(weight, ScalingTensor):
        return _weight_operand(weight.payload, weight.scale, fmt, emulated_as, payload_amax=weight.known_payload_amax())
    return _weight_operand(weight.detach(), None, fmt, emulated_as)


class _FP8GroupedFunction(torch.autograd.Function):
    """Rows of expert ``e`` times ``weights[e]^T``, every GEMM in FP8 (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: tuple[int, ...], recipe: Recipe, weight_grad_format: Format, *weights):
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        emulated = choose_backend(x.device, recipe.backend) == "emulated"
        emulated_as = emulation_dtype(out_dtype, x.device) if emulated else None
        out_features = next(w for w in weights if w is not None).shape[0]
        x_ops: list[FP8Operand | None] = []
        w_ops: list[FP8Operand | None] = []
        outputs = []
        with torch.autocast(device_type, enabled=False):
            for rows, weight in zip(x.contiguous().split(list(counts)), weights):
                if rows.shape[0] == 0:  # no tokens (always so for an expert not held): nothing to scale or multiply
                    x_ops.append(None)
                    w_ops.append(None)
                    outputs.append(rows.new_zeros((0, out_features), dtype=out_dtype))
                    continue
                x_op = _group_operand(rows, recipe.input_format, recipe.margin, emulated_as)
                w_op = _expert_weight_operand(weight, recipe.weight_format, emulated_as)
                outputs.append(fp8_mm(x_op, w_op.t(), out_dtype, backend=recipe.backend))
                x_ops.append(x_op)
                w_ops.append(w_op)
        ctx.recipe, ctx.weight_grad_format, ctx.counts = recipe, weight_grad_format, counts
        ctx.out_dtype, ctx.emulated_as, ctx.x_dtype = out_dtype, emulated_as, x.dtype
        ctx.weight_meta = [None if w is None else (w.dtype, w.shape, w.device) for w in weights]
        ctx.finite = []
        saved: list[torch.Tensor | None] = []
        for x_saved, w_saved in zip(x_ops, w_ops):
            if x_saved is None or w_saved is None:
                ctx.finite.append((None, None))
                saved += [None, None, None, None]
            else:
                ctx.finite.append((x_saved.finite, w_saved.finite))
                saved += [x_saved.data, x_saved.scale_inv, w_saved.data, w_saved.scale_inv]
        ctx.save_for_backward(*saved)
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = ctx.saved_tensors
        recipe, counts = ctx.recipe, ctx.counts
        need_x = ctx.needs_input_grad[0]
        grad_x_parts: list[torch.Tensor] = []
        grad_ws: list[torch.Tensor | None] = []
        with torch.autocast(grad_out.device.type, enabled=False):
            for e, rows in enumerate(grad_out.contiguous().split(list(counts))):
                x8, x_inv, w8, w_inv = saved[4 * e : 4 * e + 4]
                if ctx.weight_meta[e] is None:  # an expert held elsewhere: no rows, no gradient
                    grad_ws.append(None)
                    continue
                dtype, shape, device = ctx.weight_meta[e]
                if x8 is None:
                    grad_x_parts.append(rows.new_zeros((0, shape[1]), dtype=ctx.out_dtype))
                    wanted = ctx.needs_input_grad[4 + e]
                    grad_ws.append(_empty_weight_grad(shape, dtype, device, ctx.weight_grad_format) if wanted else None)
                    continue
                x_finite, w_finite = ctx.finite[e]
                g_op = _group_operand(rows, recipe.grad_output_format, recipe.margin, ctx.emulated_as)
                if need_x:
                    w_op = FP8Operand(w8, w_inv, w_finite)
                    grad_x_parts.append(fp8_mm(g_op, w_op, ctx.out_dtype, backend=recipe.backend))
                if ctx.needs_input_grad[4 + e]:
                    grad_w = fp8_mm(g_op.t(), FP8Operand(x8, x_inv, x_finite), ctx.out_dtype, backend=recipe.backend)
                    grad_ws.append(_stored_weight_grad(grad_w, ctx.weight_grad_format, dtype))
                else:
                    grad_ws.append(None)
        grad_x = torch.cat(grad_x_parts).to(ctx.x_dtype) if need_x else None
        return (grad_x, None, None, None, *grad_ws)


def _empty_weight_grad(shape: torch.Size, dtype: torch.dtype, device: torch.device, fmt: Format) -> torch.Tensor:
    """The weight gradient of an expert that got no tokens: zeros, stored like the others."""
    zeros = torch.zeros(shape, dtype=torch.float32, device=device)
    return _stored_weight_grad(zeros, fmt, dtype)


class GroupedLinear(nn.Module):
    """``num_experts`` bias-free linear layers, ``in_features -> out_features``, over tokens
    sorted by expert: ``forward(x, counts)`` (module docstring). Its GEMMs are ``F.linear``, one
    per expert (BF16 under autocast); `fp8lm.initialize` turns it into an `FP8GroupedLinear`."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__()
        if min(num_experts, in_features, out_features) < 1:
            raise ValueError(
                f"GroupedLinear needs >= 1 expert, in and out features; got {num_experts}, {in_features}, {out_features}"
            )
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        factory = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        bound = 1 / math.sqrt(in_features)
        weights = []
        for _ in range(num_experts):
            w = torch.empty(out_features, in_features, **factory)
            if w.device.type != "meta":
                nn.init.uniform_(w, -bound, bound)  # nn.Linear's initialization
            weights.append(self._stored_weight(w))
        self.weight = nn.ParameterList(weights)

    def _stored_weight(self, value: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(value)

    def checked_counts(self, x: torch.Tensor, counts: Sequence[int] | torch.Tensor) -> list[int]:
        """`group_counts` of ``counts`` for input ``x``, refusing rows for an expert not held here."""
        values = group_counts(counts, self.num_experts, x.shape[0])
        absent = [e for e, (n, w) in enumerate(zip(values, self.weight)) if n and w is None]
        if absent:
            raise ValueError(f"rows routed to experts {absent}, which this layer does not hold (another rank does)")
        return values

    def forward(self, x: torch.Tensor, counts: Sequence[int] | torch.Tensor) -> torch.Tensor:
        counts = self.checked_counts(x, counts)
        parts = x.split(counts)
        return torch.cat([F.linear(rows, w) for rows, w in zip(parts, self.weight) if w is not None])

    def held_weights(self) -> list[tuple[int, nn.Parameter]]:
        """``(expert, weight)`` of the experts this layer holds (not None)."""
        return [(e, w) for e, w in enumerate(self.weight) if w is not None]

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}"


class FP8GroupedLinear(GroupedLinear):
    """`GroupedLinear` whose three GEMMs per expert run in FP8 (module docstring).

    Args beyond GroupedLinear's, as `FP8Linear`'s: ``weight_format`` (storage of each expert's
    weight: FP16 by default, a ScalingTensor with its own scale; FP32: plain parameters),
    ``weight_grad_format`` (E4M3 by default; FP32: plain gradients), ``recipe`` (formats, margin
    and backend; its scaling does not apply to the token groups, which are scaled just in time).
    Hook points as FP8Linear's: ``fp8_enabled = False`` or ``high_precision = True`` run the
    GEMMs in high precision.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        device=None,
        dtype=None,
        *,
        weight_format: Format | str = FP16,
        weight_grad_format: Format | str = E4M3,
        recipe: Recipe | str | None = None,
    ) -> None:
        self.weight_format = format_of(weight_format)
        self.weight_grad_format = format_of(weight_grad_format)
        self.recipe = recipe_from(recipe, "FP8GroupedLinear")
        if self.recipe.fine_grained:
            raise ValueError(
                f"FP8GroupedLinear scales each expert's token group as one tensor; the {self.recipe.granularity} "
                "recipe is for FP8Linear: use a tensorwise recipe for the experts"
            )
        self.fp8_enabled = True
        self.high_precision = False
        super().__init__(num_experts, in_features, out_features, device, dtype)

    def _stored_weight(self, value: torch.Tensor) -> nn.Parameter:
        value = value.detach()
        if self.weight_format == FP32 or value.device.type == "meta":
            return nn.Parameter(value.clone() if self.weight_format == FP32 else value)
        return nn.Parameter(quantize(value, self.weight_format))

    @classmethod
    def from_grouped(cls, layer: GroupedLinear, **options) -> FP8GroupedLinear:
        """An FP8GroupedLinear with ``layer``'s weights; ``options`` are the keyword arguments."""
        if not isinstance(layer, GroupedLinear):
            raise TypeError(f"FP8GroupedLinear.from_grouped expects a GroupedLinear, got {type(layer).__name__}")
        source = list(layer.weight)
        dtype = next(w.dtype for w in source if w is not None)
        new = cls(layer.num_experts, layer.in_features, layer.out_features, device="meta", dtype=dtype, **options)
        new.weight = nn.ParameterList(None if w is None else new._stored_weight(w.detach()) for w in source)
        for w, old in zip(new.weight, source):
            if w is not None:
                w.requires_grad_(old.requires_grad)
        return new

    def forward(self, x: torch.Tensor, counts: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled or self.high_precision or x.numel() == 0:
            return super().forward(x, counts)
        counts = self.checked_counts(x, counts)
        return _FP8GroupedFunction.apply(x, tuple(counts), self.recipe, self.weight_grad_format, *self.weight)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, weight={self.weight_format.name}, weight_grad={self.weight_grad_format.name}, "
            f"recipe={self.recipe.name or self.recipe}, fp8_enabled={self.fp8_enabled}, high_precision={self.high_precision}"
        )
