"""`GroupedLinear` and `FP8GroupedLinear`: the linear layers of ``E`` experts over tokens sorted by
expert (a mixture of experts' grouped GEMMs).

The tokens arrive as one ``(T, in)`` tensor, sorted by expert, with how many rows each expert
takes: a `Groups` (`groups_of`: the counts, their cumulative ends and each row's expert, all on the
rows' device), or the counts themselves (a 1-D tensor or a sequence, in expert order, summing to
``T``). Rows of expert ``e`` become ``x W_e^T``. Each expert's weight is a parameter of its own,
``weight[e]`` of shape ``(out, in)`` (held in an `ExpertWeights`, an ``nn.ParameterList``), so it
is stored like every FP8 weight: `fp8lm.initialize` gives it one `ScalingTensor` with one scale per
expert (O2: an FP16 payload, O3: E4M3 with an FP16 master), an E4M3 gradient with its own scale,
and FP8AdamW moments of its own. An entry may be None: an expert this rank does not hold (expert
parallelism, `fp8lm.distributed.ExpertParallelMoE`), which must get no rows; the others keep their
names (``weight.<expert>``) as in the whole layer.

No host synchronization: on a GPU the layers read the groups from device tensors (offsets for
``torch._grouped_mm`` / ``torch._scaled_grouped_mm``, each row's expert for the per-expert scales).
What needs the sizes on the host (`Groups.sizes`: free on CPU, one device-to-host copy per
`Groups` on a GPU, shared by the mixture's two layers) is the per-expert loop: the CPU emulation,
FP32 GEMMs on a GPU (torch's grouped GEMM is BF16/FP8 only) and the blockwise and mxfp8 recipes.

`FP8GroupedLinear` runs each expert's three GEMMs in FP8. With a tensorwise recipe, the scales are
per expert:

- forward: expert ``e``'s rows in the recipe's input format (E4M3), scaled by the amax of that
  group of rows; the weight in E4M3, scaled just in time from its stored value;
- input gradient: the output gradient's rows of ``e`` in E5M2, scaled by their own amax, times the
  weight;
- weight gradient: the output gradient's rows times the input's, returned quantized
  (``weight_grad_format``, E4M3 by default) with its own scale.

The token groups are scaled just in time (current scaling) whatever the recipe's scaling: the rows
an expert receives change from step to step, and a rarely routed expert would be cast with a
history of other tokens. The recipe gives the formats, the margin and the GEMM backend. The
numbers are exactly those of one `fp8lm.ops.gemm.fp8_mm` per expert. The GEMMs: on CUDA, one
``torch._scaled_grouped_mm`` per pass for E4M3 x E4M3 with a BF16 output (each row scaled by its
expert's scale, each weight column by its expert's: tensorwise per expert as row-wise scales), on
compute capability 9.0+ with dims multiples of 16; otherwise the exact emulation (operands upcast
with their scales, `grouped_mm`: one BF16 ``torch._grouped_mm`` on CUDA, a GEMM per expert on CPU
and for FP32). E5M2 output gradients have no grouped FP8 kernel: their two GEMMs are emulated.

With a fine-grained recipe every block scale is the expert's own (no block straddles two experts),
as with one `FP8Linear` per expert (`fp8lm.nn.finegrained`). The rowwise recipes run all experts at
once (`_RowwiseGroupedFunction`): the input and output-gradient rows each with their own scale,
each expert's weight rows (forward) and columns (input gradient), and, for the weight gradient,
each expert's columns of both operands along its own tokens (one scale per expert and column,
from a ``scatter_reduce`` of the column amaxes): E4M3 throughout, so on CUDA all three GEMMs are
``torch._scaled_grouped_mm`` (row-wise scales are its native form). Blockwise, mxfp8 and nvfp4
send each expert's rows through `fp8lm.nn.finegrained.fine_grained_linear` with that expert's
weight (nvfp4: each expert with its own tensor scales, its tokens padded to whole 16-row groups
for the Hadamard transform of its weight gradient, as one `FP8Linear` per expert would).

On an FP8 GEMM backend, eagerly, the experts' weight operands are made once per change of the
weights and kept between forwards, as an `FP8Linear` keeps its weight's: all experts' stacked
FP8 weights at once on the tensorwise and rowwise paths, each expert's block operands on the
others (`FP8GroupedLinear.kept_operands`).

Under FSDP2 (torch's ``fully_shard`` or `fp8lm.distributed.fully_shard`) each expert's weight is
all-gathered as an `FP8Linear`'s is: in E4M3 with a tensorwise recipe, and as a fine-grained
recipe's forward operand where its shards hold whole blocks (`fp8lm.block_tensor`):
a `BlockScaledTensor` per expert, which both paths multiply as it is. The rowwise path saves the
experts' gathered bytes for the backward, not a stack of them, and requantizes them along
out_features there (FSDP2 frees them after the forward and gathers them again).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..block_tensor import BlockScaledTensor, decoded_scales, gathered_operand
from ..formats import E4M3, FP16, FP32, Format, format_of
from ..ops.block_scales import pow2_ceil
from ..ops.cast import _eager_cast
from ..ops.finegrained import BlockOperand
from ..ops.gemm import choose_backend, emulation_dtype
from ..recipe import Recipe, recipe_from
from ..scaling import compute_scale
from ..tensor import ScalingTensor, quantize
from .finegrained import fine_grained_linear
from .linear import _carry_nonfinite, _WeightOperandCache
from .scale_math import _scale_math

__all__ = [
    "ExpertWeights",
    "GroupedLinear",
    "FP8GroupedLinear",
    "Groups",
    "groups_of",
    "group_counts",
    "grouped_mm",
    "grouped_mm_t",
    "uses_grouped_kernel",
]


def group_counts(counts: Sequence[int] | torch.Tensor | Groups, num_experts: int, rows: int) -> list[int]:
    """``counts`` (tokens per expert: a sequence, a 1-D tensor or a `Groups`) as a list of ints,
    checked against the experts and the rows of the tokens (a host read of a device tensor)."""
    if isinstance(counts, Groups):
        counts = counts.counts
    values = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
    if len(values) != num_experts or any(c < 0 for c in values) or sum(values) != rows:
        raise ValueError(
            f"counts must give {num_experts} non-negative token counts, one per expert, summing to the {rows} "
            f"rows of the input; got {values}"
        )
    return values


class Groups:
    """Rows sorted by expert, on the rows' device: ``counts`` (E,) int64, ``ends`` (E,) int32 (the
    cumulative counts: the offsets of ``torch._grouped_mm``) and ``expert`` (T,) int64, the
    expert of each row. `sizes` reads the counts on the host once (see the module docstring)."""

    __slots__ = ("counts", "ends", "expert", "_sizes")

    def __init__(self, counts: torch.Tensor, rows: int) -> None:
        self.counts = counts.to(torch.int64)
        ends = torch.cumsum(self.counts, 0)
        self.ends = ends.to(torch.int32)
        rows_index = torch.arange(rows, device=counts.device, dtype=torch.int64)
        self.expert = torch.searchsorted(ends, rows_index, right=True)  # the first group ending past the row
        self._sizes: list[int] | None = None

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def rows(self) -> int:
        return self.expert.shape[0]

    def sizes(self) -> list[int]:
        """The counts as Python ints (on a GPU, a device-to-host copy: a sync; made once)."""
        if self._sizes is None:
            self._sizes = self.counts.tolist()
        return self._sizes

    def select(self, experts: list[int]) -> Groups:
        """The groups of ``experts`` only (the others must have no rows): this rank's experts."""
        if experts == list(range(self.num_experts)):
            return self
        index = torch.tensor(experts, dtype=torch.int64, device=self.counts.device)
        return Groups(self.counts.index_select(0, index), self.rows)


def groups_of(counts: Sequence[int] | torch.Tensor | Groups, num_experts: int, rows: int, device=None) -> Groups:
    """``counts`` (see the module docstring) as a `Groups` on ``device``. Counts given on the host
    (a sequence, a CPU tensor) are checked (`group_counts`); a device tensor only by its length,
    since reading it would synchronize."""
    if isinstance(counts, Groups):
        if counts.num_experts != num_experts or counts.rows != rows:
            raise ValueError(
                f"groups of {counts.num_experts} experts over {counts.rows} rows given for {num_experts} experts "
                f"and {rows} rows"
            )
        return counts
    if isinstance(counts, torch.Tensor) and counts.device.type != "cpu":
        if tuple(counts.shape) != (num_experts,):
            raise ValueError(
                f"counts must give {num_experts} token counts, one per expert; got shape {tuple(counts.shape)}"
            )
        values = counts
    else:
        values = torch.tensor(group_counts(counts, num_experts, rows), dtype=torch.int64)
    return Groups(values.to(device if device is not None else values.device), rows)


# -- grouped GEMMs ---------------------------------------------------------------------------------
def uses_grouped_kernel(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `grouped_mm` of ``a`` and ``b`` is one ``torch._grouped_mm``: BF16 operands on
    CUDA, their dims multiples of 8 (its 16-byte strides); else a GEMM per expert."""
    return (
        a.device.type == "cuda"
        and a.dtype == b.dtype == torch.bfloat16
        and not (a.shape[-1] % 8 or b.shape[-1] % 8 or b.shape[-2] % 8)
    )


def grouped_mm(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows of expert ``e`` of ``a`` (T, K) times ``b[e]`` (K, N), in ``a``'s dtype (FP32
    accumulation), (T, N); ``b`` is (E, K, N)."""
    if uses_grouped_kernel(a, b):
        return torch._grouped_mm(a, b, offs=groups.ends)
    parts = a.split(groups.sizes())
    return torch.cat([torch.mm(rows, b[e]) for e, rows in enumerate(parts)])


def grouped_mm_t(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Expert ``e``'s rows of ``a`` (T, M), transposed, times its rows of ``b`` (T, N): (E, M, N)
    (the weight gradients; zeros for an expert without rows)."""
    if uses_grouped_kernel(a.t(), b):
        return torch._grouped_mm(a.t(), b, offs=groups.ends)
    sizes = groups.sizes()
    return torch.stack([torch.mm(x.t(), y) for x, y in zip(a.split(sizes), b.split(sizes))])


def _rows_scales(x: torch.Tensor, expert: torch.Tensor, num_experts: int, fmt: Format, margin: int):
    """Each expert's rows of ``x`` cast to ``fmt`` with the scale of their group's amax: the payload,
    each group's inverse scale (NaN where the group holds inf or NaN) and each row's."""
    row_amax = x.abs().amax(1).to(torch.float32)
    group_amax = torch.zeros(num_experts, dtype=torch.float32, device=x.device)
    group_amax = group_amax.scatter_reduce(0, expert, row_amax, "amax")
    scale = compute_scale(group_amax, fmt, margin)
    scale_inv = _carry_nonfinite(scale.reciprocal(), group_amax)
    payload = _eager_cast(x, scale[expert].unsqueeze(1), fmt.max, fmt.dtype)
    return payload, scale_inv, scale_inv[expert]


def _experts_scales(payloads: list[torch.Tensor], stored: list[torch.Tensor] | None, fmt: Format):
    """The experts' weights in ``fmt`` (E, out, in), each scaled just in time from its stored
    payload (and stored scale), and their inverse scales (E,) (as `fp8lm.nn.linear._weight_operand`)."""
    stacked = torch.stack(payloads)
    readable = stacked.to(torch.float16) if stacked.element_size() == 1 else stacked  # FP8 has no amax kernel
    payload_amax = readable.abs().amax((1, 2)).to(torch.float32)
    stored_scale = None if stored is None else torch.stack(stored).to(torch.float32)
    value_amax = payload_amax if stored_scale is None else payload_amax / stored_scale
    if stored_scale is not None and stacked.dtype == fmt.dtype:
        return stacked, _carry_nonfinite(stored_scale.reciprocal(), value_amax)
    scale = compute_scale(payload_amax, fmt)
    combined = scale if stored_scale is None else scale * stored_scale
    return _eager_cast(stacked, scale[:, None, None], fmt.max, fmt.dtype), _carry_nonfinite(
        combined.reciprocal(), value_amax
    )


def _stored_grads(grad: torch.Tensor, fmt: Format, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The experts' weight gradients (E, out, in) as stored: each a ScalingTensor of ``fmt`` with a
    scale of its own (as `fp8lm.nn.scale_math._stored_weight_grad`), or plain for FP32."""
    if fmt == FP32:
        return grad.to(dtype).unbind(0)
    payload, scale = _scale_math(_grads_cast, grad, grad, fmt)
    return tuple(ScalingTensor(p, s, dtype) for p, s in zip(payload.unbind(0), scale.unbind(0)))


def _grads_cast(grad: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The payloads (E, out, in) and scales (E,) of `_stored_grads`."""
    scale = compute_scale(grad.abs().amax((1, 2)).to(torch.float32), fmt)
    return _eager_cast(grad, scale[:, None, None], fmt.max, fmt.dtype), scale


def _dequantize(payload: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``payload * scale_inv`` (broadcast) as ``dtype``: exact (FP8 values times powers of two);
    one compiled pass off the CPU."""
    return _scale_math(_upcast, payload, payload, scale_inv, dtype)


def _upcast(payload: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (payload.to(torch.float32) * scale_inv).to(dtype)


def _takes_scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, backend: str) -> bool:
    """Whether ``torch._scaled_grouped_mm`` multiplies these payloads: E4M3 both, a BF16 result,
    CUDA of compute capability 9.0+ with ``backend`` resolving to ``scaled_mm``, dims multiples of 16."""
    return (
        a.device.type == "cuda"
        and backend == "scaled_mm"
        and a.dtype == b.dtype == torch.float8_e4m3fn
        and out_dtype == torch.bfloat16
        and torch.cuda.get_device_capability(a.device) >= (9, 0)
        and not (a.shape[-1] % 16 or b.shape[-1] % 16 or b.shape[-2] % 16)
    )


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last two dims column-major (a copy unless it is)."""
    return t if t.transpose(-2, -1).is_contiguous() else t.transpose(-2, -1).contiguous().transpose(-2, -1)


class _FP8GroupedFunction(torch.autograd.Function):
    """Rows of expert ``e`` times ``weights[e]^T``, every GEMM in FP8 with tensorwise scales per
    expert (module docstring). ``weights``: the experts held, in order (``groups`` is theirs)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, groups: Groups, recipe: Recipe, weight_grad_format: Format, kept: dict | None, *weights
    ):
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        backend = choose_backend(x.device, recipe.backend)
        compute = emulation_dtype(out_dtype, x.device)
        num = len(weights)
        with torch.autocast(device_type, enabled=False):
            x8, x_inv, x_row_inv = _scale_math(
                _rows_scales, x, x.detach(), groups.expert, num, recipe.input_format, recipe.margin
            )
            payloads, stored = _weight_payloads(weights)
            restack = stored is not None and all(p.dtype == recipe.weight_format.dtype for p in payloads)
            w8, w_inv = _kept(
                None if restack else kept,
                ("experts", recipe.weight_format),
                lambda: _scale_math(_experts_scales, x, payloads, stored, recipe.weight_format),
            )
            out_features = w8.shape[1]
            if _takes_scaled_grouped_mm(x8, w8, out_dtype, backend):
                scale_b = w_inv[:, None].expand(num, out_features).contiguous()
                y = torch._scaled_grouped_mm(
                    x8, _col_major(w8.transpose(1, 2)), x_row_inv, scale_b, offs=groups.ends, out_dtype=out_dtype
                )
            else:
                w_hp = _dequantize(w8, w_inv[:, None, None], compute)
                y = grouped_mm(_dequantize(x8, x_row_inv[:, None], compute), w_hp.transpose(1, 2), groups)
        ctx.recipe, ctx.weight_grad_format, ctx.groups = recipe, weight_grad_format, groups
        ctx.out_dtype, ctx.compute, ctx.backend, ctx.x_dtype = out_dtype, compute, backend, x.dtype
        ctx.weight_dtypes = [w.dtype for w in weights]
        # Payloads already in the GEMM's format (FSDP2's FP8 all-gather, E4M3 weights) are saved as
        # they are and stacked again in the backward: FSDP2 frees gathered experts after the
        # forward and gathers them again for the backward, which a saved stack would defeat.
        ctx.restack = restack
        ctx.save_for_backward(x8, x_inv, w_inv, *(payloads if ctx.restack else [w8]))
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x8, x_inv, w_inv, *w_saved = ctx.saved_tensors
        recipe, groups, compute, backend = ctx.recipe, ctx.groups, ctx.compute, ctx.backend
        # a backward run under autocast (a pipeline schedule's) must not reach the FP8 payloads
        with torch.autocast(grad_out.device.type, enabled=False):
            w8 = torch.stack(w_saved) if ctx.restack else w_saved[0]
            num, (out_features, in_features) = w8.shape[0], w8.shape[1:]
            grad_x: torch.Tensor | None = None
            grad_ws: list[torch.Tensor | None] = [None] * num
            g = grad_out.contiguous()
            g8, g_inv, g_row_inv = _scale_math(
                _rows_scales, g, g, groups.expert, num, recipe.grad_output_format, recipe.margin
            )
            g_hp = None
            if ctx.needs_input_grad[0]:
                if _takes_scaled_grouped_mm(g8, w8, ctx.out_dtype, backend):
                    scale_b = w_inv[:, None].expand(num, in_features).contiguous()
                    grad_x = torch._scaled_grouped_mm(
                        g8, _col_major(w8), g_row_inv, scale_b, offs=groups.ends, out_dtype=ctx.out_dtype
                    )
                else:
                    g_hp = _dequantize(g8, g_row_inv[:, None], compute)
                    grad_x = grouped_mm(g_hp, _dequantize(w8, w_inv[:, None, None], compute), groups)
                grad_x = grad_x.to(ctx.out_dtype).to(ctx.x_dtype)
            if any(ctx.needs_input_grad[_WEIGHTS_AT:]):
                if _takes_scaled_grouped_mm(g8, x8, ctx.out_dtype, backend):
                    scale_a = g_inv.repeat_interleave(out_features)
                    scale_b = x_inv.repeat_interleave(in_features)
                    grad_w = torch._scaled_grouped_mm(
                        g8.t().contiguous(), _col_major(x8), scale_a, scale_b, offs=groups.ends, out_dtype=ctx.out_dtype
                    )
                else:
                    g_hp = _dequantize(g8, g_row_inv[:, None], compute) if g_hp is None else g_hp
                    x_hp = _dequantize(x8, x_inv[groups.expert][:, None], compute)
                    grad_w = grouped_mm_t(g_hp, x_hp, groups)
                stored = _stored_grads(grad_w.to(ctx.out_dtype), ctx.weight_grad_format, ctx.weight_dtypes[0])
                grad_ws = [s if ctx.needs_input_grad[_WEIGHTS_AT + e] else None for e, s in enumerate(stored)]
        return (grad_x, None, None, None, None, *grad_ws)


# Where the experts' weights begin among the grouped Functions' inputs (after x, groups, recipe,
# weight_grad_format and kept).
_WEIGHTS_AT = 5


def _kept(kept: dict | None, key: tuple, make):
    """``kept[key]``, made by ``make()`` and kept there the first time; ``make()`` without a dict."""
    if kept is None:
        return make()
    if key not in kept:
        kept[key] = make()
    return kept[key]


def _weight_payloads(weights) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The experts' stored payloads and scales (None for plain weights)."""
    if all(isinstance(w, ScalingTensor) for w in weights):
        return [w.payload for w in weights], [w.scale for w in weights]
    return [w.detach() if not isinstance(w, ScalingTensor) else w.dequantize() for w in weights], None


def _rowwise(x: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (R, C) quantized row by row along C (the rowwise recipe: `pow2_ceil` of each row's
    amax, as `fp8lm.ops.finegrained.quantize_operand` does): the payload and each row's ``d`` (R,)."""
    d = pow2_ceil(x.abs().amax(1).to(torch.float32), fmt.max)
    return (x.to(torch.float32) / d[:, None]).clamp(-fmt.max, fmt.max).to(fmt.dtype), d


def _rowwise_over_tokens(x: torch.Tensor, expert: torch.Tensor, num_experts: int, fmt: Format):
    """``x`` (T, C) quantized along the tokens of each expert's group (the weight-gradient GEMM's
    reduction dimension): one ``d`` per expert and column (E, C), from that group's column amax."""
    amax = torch.zeros(num_experts, x.shape[1], dtype=torch.float32, device=x.device)
    index = expert[:, None].expand(x.shape)
    d = pow2_ceil(amax.scatter_reduce(0, index, x.abs().to(torch.float32), "amax"), fmt.max)
    return (x.to(torch.float32) / d[expert]).clamp(-fmt.max, fmt.max).to(fmt.dtype), d


def _rowwise_weights(payloads: list[torch.Tensor], stored: list[torch.Tensor] | None, fmt: Format):
    """The experts' weights (from their stored payloads and scales) quantized row by row for the
    forward GEMM, ``(E, out, in)`` with ``d`` (E, out), and column by column for the input
    gradient's (`_rowwise_columns`)."""
    values = torch.stack(payloads).to(torch.float32)
    if stored is not None:
        values = values / torch.stack(stored).to(torch.float32)[:, None, None]
    num, out_features, in_features = values.shape
    w8, w_d = _rowwise(values.reshape(num * out_features, in_features), fmt)
    return (w8.reshape(num, out_features, in_features), w_d.reshape(num, out_features), *_rowwise_columns(values, fmt))


def _rowwise_columns(values: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weight values ``(E, out, in)`` quantized column by column for the input
    gradient's GEMM: ``(E, in, out)`` with ``d`` (E, in)."""
    num, out_features, in_features = values.shape
    wt8, wt_d = _rowwise(values.transpose(1, 2).reshape(num * in_features, out_features), fmt)
    return wt8.reshape(num, in_features, out_features), wt_d.reshape(num, in_features)


def _gathered_operands(weights) -> list[BlockOperand] | None:
    """The experts' forward operands where FSDP2 gathered every one in the recipe's blocks (a
    `BlockScaledTensor` each), else None."""
    if weights and all(isinstance(w, BlockScaledTensor) for w in weights):
        return [w.operand for w in weights]
    return None


class _RowwiseGroupedFunction(torch.autograd.Function):
    """The experts' three GEMMs under a rowwise recipe, all experts at once (module docstring):
    per-row scales of the input and the output gradient, per-expert row (forward) and column
    (input gradient) scales of the weights, per-expert column scales along each group's tokens for
    the weight gradient: ``torch._scaled_grouped_mm`` where it runs, else the exact emulation."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, groups: Groups, recipe: Recipe, weight_grad_format: Format, kept: dict | None, *weights
    ):
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        backend, num = choose_backend(x.device, recipe.backend), len(weights)
        gathered = _gathered_operands(weights)
        with torch.autocast(device_type, enabled=False):
            x2 = x.detach()
            if gathered is None:
                payloads, stored = _weight_payloads(weights)
                w8, w_d, wt8, wt_d = _kept(
                    kept,
                    ("experts rowwise", recipe.weight_format),
                    lambda: _scale_math(_rowwise_weights, x2, payloads, stored, recipe.weight_format),
                )
                w_saved = [wt8, wt_d]
            else:  # FSDP2 gathered each expert's rowwise operand: saved as gathered (`_restacked_columns`)
                w8 = torch.stack([op.payload for op in gathered])
                w_d = torch.stack([op.d.reshape(-1) for op in gathered])
                w_saved = [t for w in weights for t in w.held]
                ctx.w_block = gathered[0].block
            x8, x_d = _scale_math(_rowwise, x2, x2, recipe.input_format)
            y = _rowwise_gemm(x8, x_d, w8.transpose(1, 2), w_d, groups, out_dtype, backend)
            if recipe.weight_grad_gemm == "bf16":
                xt8, xt_d = x2.to(torch.bfloat16), None
            else:
                xt8, xt_d = _scale_math(_rowwise_over_tokens, x2, x2, groups.expert, num, recipe.input_format)
        ctx.recipe, ctx.weight_grad_format, ctx.groups, ctx.backend = recipe, weight_grad_format, groups, backend
        ctx.out_dtype, ctx.x_dtype, ctx.w_dtype = out_dtype, x.dtype, weights[0].dtype
        ctx.gathered, ctx.num = gathered is not None, num
        ctx.save_for_backward(xt8, xt_d, *w_saved)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xt8, xt_d, *w_saved = ctx.saved_tensors
        recipe, groups, out_dtype, backend, num = ctx.recipe, ctx.groups, ctx.out_dtype, ctx.backend, ctx.num
        grad_x: torch.Tensor | None = None
        grad_ws: list[torch.Tensor | None] = [None] * num
        with torch.autocast(grad_out.device.type, enabled=False):
            g = grad_out.contiguous()
            if ctx.needs_input_grad[0]:
                if ctx.gathered:
                    wt8, wt_d = _restacked_columns(w_saved, ctx.w_block, recipe.weight_format)
                else:
                    wt8, wt_d = w_saved
                g8, g_d = _scale_math(_rowwise, g, g, recipe.grad_output_format)
                grad_x = _rowwise_gemm(g8, g_d, wt8.transpose(1, 2), wt_d, groups, out_dtype, backend).to(ctx.x_dtype)
            if any(ctx.needs_input_grad[_WEIGHTS_AT:]):
                if xt_d is None:  # weight_grad_gemm="bf16": BF16 operands, FP32 accumulation
                    compute = emulation_dtype(out_dtype, g.device)
                    grad_w = grouped_mm_t(g.to(torch.bfloat16).to(compute), xt8.to(compute), groups)
                else:
                    gt8, gt_d = _scale_math(_rowwise_over_tokens, g, g, groups.expert, num, recipe.grad_output_format)
                    grad_w = _rowwise_wgrad(gt8, gt_d, xt8, xt_d, groups, out_dtype, backend)
                stored = _stored_grads(grad_w.to(out_dtype), ctx.weight_grad_format, ctx.w_dtype)
                grad_ws = [s if ctx.needs_input_grad[_WEIGHTS_AT + e] else None for e, s in enumerate(stored)]
        return (grad_x, None, None, None, None, *grad_ws)


def _restacked_columns(held: list[torch.Tensor], block, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The input gradient's weight operand (`_rowwise_columns`) requantized from the experts'
    gathered forward operands, saved as FSDP2 gathered them (payload and scale bytes, expert after
    expert): FSDP2 frees them after the forward and gathers them again for the backward, where a
    stack saved in the forward would hold every expert's unsharded weight until then."""
    values = torch.stack(
        [BlockOperand(p, decoded_scales(d), block).dequantize() for p, d in zip(held[::2], held[1::2])]
    )
    return _scale_math(_rowwise_columns, values, values, fmt)


def _rowwise_gemm(a8, a_d, b8, b_d, groups: Groups, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """Rows of expert ``e`` of ``a8`` (T, K; one ``d`` per row) times ``b8[e]`` (K, N; one ``d``
    per column and expert, ``b_d`` (E, N)), as ``out_dtype``."""
    if _takes_scaled_grouped_mm(a8, b8, out_dtype, backend):
        return torch._scaled_grouped_mm(
            a8.contiguous(), _col_major(b8), a_d, b_d.contiguous(), offs=groups.ends, out_dtype=out_dtype
        )
    compute = emulation_dtype(out_dtype, a8.device)
    a = _dequantize(a8, a_d[:, None], compute)
    return grouped_mm(a, _dequantize(b8, b_d[:, None, :], compute), groups).to(out_dtype)


def _rowwise_wgrad(g8, g_d, x8, x_d, groups: Groups, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """Each expert's ``g^T x`` (E, out, in) from operands quantized along its tokens (``g_d``
    (E, out), ``x_d`` (E, in))."""
    if _takes_scaled_grouped_mm(g8, x8, out_dtype, backend):
        return torch._scaled_grouped_mm(
            g8.t().contiguous(), _col_major(x8), g_d.flatten(), x_d.flatten(), offs=groups.ends, out_dtype=out_dtype
        )
    compute = emulation_dtype(out_dtype, g8.device)
    return grouped_mm_t(
        _dequantize(g8, g_d[groups.expert], compute), _dequantize(x8, x_d[groups.expert], compute), groups
    )


class _BF16GroupedFunction(torch.autograd.Function):
    """The plain experts' GEMMs under BF16 autocast on CUDA as three ``torch._grouped_mm`` (BF16
    operands, FP32 accumulation, BF16 results), as ``F.linear`` per expert computes them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: Groups, *weights):
        with torch.autocast(x.device.type, enabled=False):
            x16 = x.detach().to(torch.bfloat16)
            w16 = torch.stack([_plain(w) for w in weights]).to(torch.bfloat16)
            y = torch._grouped_mm(x16, w16.transpose(1, 2), offs=groups.ends)
        ctx.groups, ctx.dtypes = groups, (x.dtype, [w.dtype for w in weights])
        ctx.save_for_backward(x16, w16)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x16, w16 = ctx.saved_tensors
        x_dtype, w_dtypes = ctx.dtypes
        g16 = grad_out.contiguous().to(torch.bfloat16)
        with torch.autocast(grad_out.device.type, enabled=False):
            grad_x = torch._grouped_mm(g16, w16, offs=ctx.groups.ends).to(x_dtype) if ctx.needs_input_grad[0] else None
            grad_w = torch._grouped_mm(g16.t(), x16, offs=ctx.groups.ends)
        grad_ws = [
            gw.to(dt) if ctx.needs_input_grad[2 + e] else None
            for e, (gw, dt) in enumerate(zip(grad_w.unbind(0), w_dtypes))
        ]
        return (grad_x, None, *grad_ws)


def _plain(w: torch.Tensor) -> torch.Tensor:
    return w.dequantize() if isinstance(w, ScalingTensor) else w.detach()


def _autocast_bf16(x: torch.Tensor) -> bool:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device) == torch.bfloat16
    return x.dtype == torch.bfloat16


class ExpertWeights(nn.ParameterList):
    """A `GroupedLinear`'s experts' weights (``weight.<expert>``; None for an expert not held here):
    an ``nn.ParameterList`` that knows its layer, ``grouped_layer`` (an attribute, not a
    submodule). FSDP2 hands an expert's all-gather the module that holds the parameter, this list,
    and the format it gathers in depends on the layer: whether its GEMMs run in FP8, and in which
    recipe's blocks (`fp8lm.tensor.fsdp_gather_recipe`)."""

    def __init__(self, layer: GroupedLinear, values: Iterable[nn.Parameter | None] = ()) -> None:
        super().__init__(values)
        object.__setattr__(self, "grouped_layer", layer)  # not registered: the layer is this list's parent


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
        self.weight = ExpertWeights(self, weights)

    def _stored_weight(self, value: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(value)

    def groups(self, x: torch.Tensor, counts: Sequence[int] | torch.Tensor | Groups) -> Groups:
        """`groups_of` ``counts`` for input ``x``, over the experts this layer holds; counts on the
        host are checked to give no rows to an expert not held here."""
        groups = groups_of(counts, self.num_experts, x.shape[0], x.device)
        held = [e for e, w in enumerate(self.weight) if w is not None]
        if len(held) < self.num_experts and groups.counts.device.type == "cpu":
            absent = [e for e, n in enumerate(groups.sizes()) if n and self.weight[e] is None]
            if absent:
                raise ValueError(f"rows routed to experts {absent}, which this layer does not hold (another rank does)")
        return groups.select(held)

    def forward(self, x: torch.Tensor, counts: Sequence[int] | torch.Tensor | Groups) -> torch.Tensor:
        groups = self.groups(x, counts)
        weights = [w for w in self.weight if w is not None]
        if x.device.type == "cuda" and _autocast_bf16(x) and not (self.in_features % 8 or self.out_features % 8):
            return _BF16GroupedFunction.apply(x, groups, *weights)  # no host read of the counts
        parts = x.split(groups.sizes())
        return torch.cat([F.linear(rows, w) for rows, w in zip(parts, weights)])

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
    GEMMs in high precision; ``keep_weight_operands = False`` keeps no weight operand between
    forwards.
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
        self.fp8_enabled = True
        self.high_precision = False
        super().__init__(num_experts, in_features, out_features, device, dtype)
        # The experts' weight operands, kept between forwards as FP8Linear keeps its own: all
        # experts' at once (tensorwise, rowwise), or each expert's (blockwise, mxfp8, nvfp4).
        self.keep_weight_operands = True
        self._experts_operands = _WeightOperandCache()
        self._weight_operands = [_WeightOperandCache() for _ in range(num_experts)]

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
        new.weight = ExpertWeights(new, (None if w is None else new._stored_weight(w.detach()) for w in source))
        for w, old in zip(new.weight, source):
            if w is not None:
                w.requires_grad_(old.requires_grad)
        return new

    def forward(self, x: torch.Tensor, counts: Sequence[int] | torch.Tensor | Groups) -> torch.Tensor:
        if not self.fp8_enabled or self.high_precision or x.numel() == 0:
            return super().forward(x, counts)
        groups = self.groups(x, counts)
        weights = [w for w in self.weight if w is not None]
        if not self.keep_weight_operands and not torch.compiler.is_compiling():  # what was kept goes
            for cache in (self._experts_operands, *self._weight_operands):
                cache.clear()
        if self.recipe.granularity == "rowwise":
            kept = self._kept_for(self._experts_operands, weights, x)
            return _RowwiseGroupedFunction.apply(x, groups, self.recipe, self.weight_grad_format, kept, *weights)
        if self.recipe.fine_grained:
            return self._fine_grained(x, groups, weights)
        kept = self._kept_for(self._experts_operands, weights, x)
        return _FP8GroupedFunction.apply(x, groups, self.recipe, self.weight_grad_format, kept, *weights)

    def _fine_grained(self, x: torch.Tensor, groups: Groups, weights: list) -> torch.Tensor:
        """Each expert's rows through `fine_grained_linear` with its weight (module docstring),
        its operands kept between forwards as `FP8Linear`'s are; an expert without rows gets a
        zero gradient, as on the tensorwise path."""
        held = [e for e, w in enumerate(self.weight) if w is not None]
        outputs = []
        for rows, expert, w in zip(x.split(groups.sizes()), held, weights):
            operand = gathered_operand(w)
            kept = None if operand is not None else self._kept_for(self._weight_operands[expert], (w,), x)
            outputs.append(
                fine_grained_linear(rows, w, None, self.recipe, operand, self.weight_grad_format, kept_operands=kept)
            )
        return torch.cat(outputs)

    def _kept_for(self, cache: _WeightOperandCache, weights: Sequence[torch.Tensor], x: torch.Tensor) -> dict | None:
        """Where the operands of ``weights`` are kept (`_WeightOperandCache.kept_for`), or None
        with ``keep_weight_operands`` off."""
        return cache.kept_for(weights, x.device, self.recipe) if self.keep_weight_operands else None

    def kept_operands(self) -> list[torch.Tensor]:
        """The tensors of the weight operands the experts keep between forwards (as
        `FP8Linear.kept_operands`)."""
        return [t for cache in (self._experts_operands, *self._weight_operands) for t in cache.tensors()]

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        for cache in (self._experts_operands, *self._weight_operands):
            cache.clear()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, weight={self.weight_format.name}, weight_grad={self.weight_grad_format.name}, "
            f"recipe={self.recipe.name or self.recipe}, fp8_enabled={self.fp8_enabled}, high_precision={self.high_precision}"
        )
