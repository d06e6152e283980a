"""The three GEMMs of an `FP8Linear` under a fine-grained recipe (rowwise, blockwise, mxfp8, nvfp4).

Each GEMM quantizes its operands along its own reduction dimension (`fp8lm.ops.finegrained`):

- forward ``y = x W^T``: the input along in_features, the weight along in_features;
- input gradient ``dx = g W``: the output gradient along out_features, the weight along
  out_features (the forward's weight operand where its blocks are square: blockwise, nvfp4);
- weight gradient ``dW = g^T x``: both along the tokens. nvfp4 first applies the random Hadamard
  transform to both along the tokens (`fp8lm.ops.hadamard`); ``weight_grad_gemm="bf16"`` keeps
  this GEMM in BF16 (operands rounded to BF16, FP32 accumulation).

What the backward needs is quantized in the forward and saved quantized (the input for the
weight gradient, the weight for the input gradient), as Transformer Engine does; nvfp4's packed
two elements to a byte with E4M3 block scales; only BF16 copies are saved where the
weight-gradient GEMM is BF16. An operand FSDP2 gathered is saved as it is, so that FSDP2 frees it
after the forward as it frees any gathered parameter; where the input gradient needs the weight
in other blocks (rowwise, mxfp8) the backward requantizes the operand gathered again for it.
An `fp8lm.nn.FP8Linear` on an FP8 GEMM backend keeps its stored weight's operands between
forwards while the weight is unchanged (`WeightOperands`, in the layer's operand cache, as the
tensorwise FP8 operand is kept), so that the micro-batches of one optimizer step and evaluation
batches quantize it once; not while torch.compile traces (the graph quantizes it), nor for a
plain weight or one FSDP2 all-gathered.

The GEMMs (`block_mm`) are ``torch._scaled_mm`` with row-wise scales for the rowwise recipes
where the recipe's backend resolves to it (CUDA of compute capability 9.0+, dims multiples of
16; ``backend="scaled_mm"`` on CPU), else the exact emulation (FP32 GEMMs of the dequantized
operands, one rounding to the output dtype); blockwise takes ``torch._scaled_mm`` with 1 x 128 /
128 x 128 block scales on CUDA of compute capability 9.0
(`fp8lm.ops.finegrained.takes_block_scaled_mm`), mxfp8 with its
E8M0 scales on 10.0 and later (`takes_mx_scaled_mm`), nvfp4 in FP4 on 10.0 and later
(`takes_nvfp4_scaled_mm`) and with fp8lm's Triton GEMM on 8.9 and 9.0 (`takes_triton_nvfp4_mm`).
Where one of those FP4 GEMMs takes all three of an nvfp4 layer's GEMMs (`_fp4_kernel`), the
operands skip the `BlockOperand` form: each is quantized straight into the kernel's layout
(`fp8lm.ops.finegrained.quantize_fp4`) and saved so for the backward; the kernel reads the same
bytes. Scales come from each block's own amax (current scaling), so the layer's `ScalingMeta`
states are not used. The weight is read as it is stored (a `ScalingTensor`'s payload divided by
its scale inside the compiled quantization, so no float32 copy of it is made); its gradient is
returned stored in the layer's weight-gradient format, as the tensorwise path stores it
(`fp8lm.nn.scale_math._stored_weight_grad`).
"""

from __future__ import annotations

import torch

from ..block_tensor import BlockScaledTensor, decoded_scales
from ..formats import Format
from ..ops.finegrained import (
    BlockOperand,
    FP4Operand,
    block_mm,
    fp4_gemm_kernel,
    fp4_mm,
    fp4_shapes_fit,
    pack_nvfp4_operand,
    quantize_fp4,
    quantize_operand,
    requantize_operand,
    unpack_nvfp4_operand,
    warn_if_emulated,
)
from ..ops.gemm import choose_backend, emulation_dtype
from ..ops.hadamard import HADAMARD_SIZE, random_hadamard
from ..recipe import Recipe
from ..tensor import ScalingTensor
from .scale_math import _stored_weight_grad

__all__ = ["fine_grained_linear"]


def _e8m0(recipe: Recipe) -> bool:
    """Whether the recipe's scales are E8M0 (mxfp8: powers of two), for `block_mm`'s MX GEMM."""
    return recipe.granularity == "mxfp8"


# Recipes whose weight blocks are square: one quantization of the weight serves both its GEMMs.
_SQUARE_WEIGHT_BLOCKS = ("blockwise", "nvfp4")


class WeightOperands:
    """A stored weight's operands for a fine-grained recipe's GEMMs, each quantized at its first
    use and kept in ``kept``: a dict that `fp8lm.nn.FP8Linear` keeps while its weight is unchanged
    (its operand cache), so that the micro-batches of one optimizer step quantize the weight once,
    as the tensorwise path casts it once; a new dict per call otherwise. The weight's values are
    ``payload / stored_scale`` (``payload`` itself without a stored scale). A weight is quantized
    without randomness (nvfp4 rounds only gradients stochastically), so a kept operand has the
    bytes a new quantization would give."""

    def __init__(
        self, payload: torch.Tensor, stored_scale: torch.Tensor | None, recipe: Recipe, kept: dict | None = None
    ) -> None:
        self.payload, self.stored_scale, self.recipe = payload.detach(), stored_scale, recipe
        self.kept = {} if kept is None else kept

    def block(self, dim: int) -> BlockOperand:
        """The weight quantized along ``dim``: 1 (in_features) for the forward GEMM, 0
        (out_features) for the input gradient's, which is the forward's operand where the
        recipe's weight blocks are square."""
        if dim == 0 and self.recipe.granularity in _SQUARE_WEIGHT_BLOCKS:
            dim = 1
        key = ("block", self.recipe, dim)
        if key not in self.kept:
            self.kept[key] = quantize_operand(
                self.payload, self.recipe, "weight", dim=dim, stored_scale=self.stored_scale
            )
        return self.kept[key]

    def fp4(self, kernel: str, both_ways: bool) -> tuple[FP4Operand, ...]:
        """The weight quantized straight into ``kernel``'s FP4 layout (`quantize_fp4`) along
        in_features and, with ``both_ways``, also along out_features (its 16 x 16 blocks)."""
        key = ("fp4", self.recipe, kernel)
        operands = self.kept.get(key)
        if operands is None or (both_ways and len(operands) < 2):
            operands = quantize_fp4(self.payload, self.recipe, "weight", 1, kernel, self.stored_scale, both_ways)
            self.kept[key] = operands
        return operands if both_ways else operands[:1]


def _save(
    ctx, name: str, operand: BlockOperand | torch.Tensor | None, gathered: tuple | None = None
) -> list[torch.Tensor | None]:
    """The tensors of ``operand`` to save for backward (an nvfp4 operand as NVFP4 stores it,
    `pack_nvfp4_operand`); its block size kept on ``ctx``. ``gathered``: the operand's bytes as
    FSDP2 gathered them (`_gathered_bytes`), saved as they are: FSDP2 frees them after the
    forward and gathers them again for the backward, while a copy would stay until then."""
    if isinstance(operand, BlockOperand):
        setattr(ctx, name, operand.block)
        if gathered is not None:
            return [*gathered, operand.tensor_scale]
        if operand.tensor_scale is not None:
            return list(pack_nvfp4_operand(operand))
        return [operand.payload, operand.d, None]
    setattr(ctx, name, None)
    return [operand, None, None]


def _restore(
    block, payload: torch.Tensor | None, d: torch.Tensor | None, tensor_scale: torch.Tensor | None
) -> BlockOperand | torch.Tensor | None:
    """The operand `_save` saved."""
    if block is None:
        return payload
    assert payload is not None and d is not None  # saved together
    if tensor_scale is not None:
        return unpack_nvfp4_operand(payload, d, tensor_scale, block)
    return BlockOperand(payload, decoded_scales(d), block)  # scales as gathered (E8M0 codes): decoded


def _weight_grad_input(x2: torch.Tensor, recipe: Recipe) -> BlockOperand | torch.Tensor:
    """The input as the weight-gradient GEMM reads it: quantized along the tokens, or BF16."""
    if recipe.weight_grad_gemm == "bf16":
        return x2.detach().to(torch.bfloat16)
    if recipe.granularity == "nvfp4":
        x2 = random_hadamard(x2.detach(), recipe.hadamard_seed)
    return quantize_operand(x2, recipe, "input", dim=0)


def _weight_grad(
    g2: torch.Tensor, x_op: BlockOperand | torch.Tensor, recipe: Recipe, out_dtype: torch.dtype, backend: str
) -> torch.Tensor:
    """``g^T x``, the weight-gradient GEMM of the recipe."""
    if isinstance(x_op, torch.Tensor):  # weight_grad_gemm="bf16": BF16 operands, FP32 accumulation
        compute = emulation_dtype(out_dtype, g2.device)
        g16 = g2.to(torch.bfloat16).to(compute)
        return torch.mm(g16.t(), x_op.to(compute)).to(out_dtype)
    if recipe.granularity == "nvfp4":
        g2 = random_hadamard(g2, recipe.hadamard_seed)
    g_op = quantize_operand(g2, recipe, "grad_output", dim=0).t()
    return block_mm(g_op, x_op, out_dtype, backend=backend, e8m0_scales=_e8m0(recipe))


class _FineGrainedLinear(torch.autograd.Function):
    """``y = x W^T + b`` with the GEMMs of a fine-grained recipe (module doc). The weight's values
    are ``payload / stored_scale`` (float32; ``weight`` itself where ``payload`` is None), read
    inside the quantization, or those of ``weight_operand``; ``weight`` receives the gradient,
    stored in ``weight_grad_format`` (`_stored_weight_grad`) or, without one, in its own dtype."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        payload: torch.Tensor | None,
        stored_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        recipe: Recipe,
        weight_operand: BlockOperand | None,
        weight_grad_format: Format | None,
        held_payload: torch.Tensor | None = None,
        held_d: torch.Tensor | None = None,
        kept: dict | None = None,
    ):
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        backend = choose_backend(x.device, recipe.backend)
        ctx.recipe, ctx.out_dtype, ctx.backend, ctx.weight_grad_format = recipe, out_dtype, backend, weight_grad_format
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x.shape, x.dtype, weight.dtype, weight.shape
        ctx.plain = stored_scale is None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.empty = x.numel() == 0
        if ctx.empty:  # no rows (an expert without tokens): nothing to multiply, a zero weight gradient
            return x.new_zeros(*x.shape[:-1], weight.shape[0], dtype=out_dtype)
        # a plain weight is its own payload: passed once, as torch.compile traces no Function
        # that takes one tensor twice
        payload = weight if payload is None else payload
        with torch.autocast(device_type, enabled=False):
            x2 = x.detach().reshape(-1, x.shape[-1])
            b = None if bias is None else bias.detach()
            ctx.fp4 = None if weight_operand is not None else _fp4_kernel(x2, weight.shape, recipe, backend, out_dtype)
            weights = WeightOperands(payload, stored_scale, recipe, kept)
            if ctx.fp4:
                y, saved = _fp4_forward(ctx, x2, weights, b)
            else:
                held = None if held_payload is None or held_d is None else (held_payload, held_d)
                y, saved = _block_forward(ctx, x2, weights, b, weight_operand, held)
        ctx.save_for_backward(*saved)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.empty:
            grad_x = grad_out.new_zeros(ctx.x_shape, dtype=ctx.x_dtype) if ctx.needs_input_grad[0] else None
            grad_w = g2.new_zeros(ctx.w_shape, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        else:
            with torch.autocast(grad_out.device.type, enabled=False):
                backward = _fp4_backward if ctx.fp4 else _block_backward
                grad_x, grad_w = backward(ctx, g2, ctx.saved_tensors)
            if grad_x is not None:
                grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
        if grad_w is not None:
            grad_w = _stored_gradient(grad_w, ctx)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
            grad_b = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, None, None, grad_b, None, None, None, None, None, None


def _block_forward(
    ctx,
    x2: torch.Tensor,
    weights: WeightOperands,
    bias: torch.Tensor | None,
    weight_operand: BlockOperand | None,
    held: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The forward GEMM on `BlockOperand`\\ s (`block_mm`), and what the backward needs, quantized.
    ``held``: ``weight_operand``'s bytes as FSDP2 gathered them (`_gathered_bytes`), or None."""
    recipe = ctx.recipe
    w_op = weight_operand or weights.block(1)
    x_op = quantize_operand(x2, recipe, "input", dim=1)
    y = block_mm(x_op, w_op.t(), ctx.out_dtype, bias, ctx.backend, _e8m0(recipe))
    w_dgrad = None
    # Square weight blocks serve both GEMMs. A gathered operand (FSDP2) is saved as it is: FSDP2
    # frees it after the forward and gathers it again for the backward, which requantizes it
    # along out_features there (rowwise, mxfp8) rather than keep a copy of the unsharded weight.
    square = recipe.granularity in _SQUARE_WEIGHT_BLOCKS
    ctx.requantize_weight = weight_operand is not None and not square
    if ctx.needs_input_grad[0]:
        w_dgrad = w_op if weight_operand is not None else weights.block(0)
    x_wgrad = _weight_grad_input(x2, recipe) if ctx.needs_input_grad[1] else None
    gathered = held if w_dgrad is not None and w_dgrad is weight_operand else None
    return y, [*_save(ctx, "w_block", w_dgrad, gathered), *_save(ctx, "x_block", x_wgrad)]


def _gathered_bytes(weight: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The payload and scales of a weight FSDP2 gathered as its forward operand (a
    `BlockScaledTensor`: views of the all-gather buffers) in the form `_restore` reads: float8
    elements with float32 scales or E8M0 codes, or nvfp4's packed elements with E4M3 scale bytes,
    which `pack_nvfp4_operand` gives (an nvfp4 weight held otherwise, such as one gathered
    unpacked for an odd in_features, is packed anew). Read outside the autograd Function, whose
    body torch.compile traces without a source for a subclass's inner tensors."""
    if not isinstance(weight, BlockScaledTensor):
        return None
    payload, d = weight.held
    if recipe.granularity == "nvfp4" and (payload.dtype, d.dtype) != (torch.uint8, torch.float8_e4m3fn):
        return None
    return payload, d


def _block_backward(ctx, g2: torch.Tensor, saved) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input- and weight-gradient GEMMs on `BlockOperand`\\ s."""
    recipe, out_dtype, backend = ctx.recipe, ctx.out_dtype, ctx.backend
    w_payload, w_d, w_scale, x_payload, x_d, x_scale = saved
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        w_op = _restore(ctx.w_block, w_payload, w_d, w_scale)
        assert isinstance(w_op, BlockOperand)  # the weight is always quantized
        if ctx.requantize_weight:  # the gathered forward operand (`_block_forward`)
            w_op = requantize_operand(w_op, recipe, "weight", dim=0)
        g_op = quantize_operand(g2, recipe, "grad_output", dim=1)
        grad_x = block_mm(g_op, w_op, out_dtype, backend=backend, e8m0_scales=_e8m0(recipe))
    if ctx.needs_input_grad[1]:
        x_op = _restore(ctx.x_block, x_payload, x_d, x_scale)
        assert x_op is not None  # saved when the weight needs a gradient
        grad_w = _weight_grad(g2, x_op, recipe, out_dtype, backend)
    return grad_x, grad_w


def _fp4_kernel(
    x2: torch.Tensor, weight_shape: torch.Size, recipe: Recipe, backend: str, out_dtype: torch.dtype
) -> str | None:
    """The FP4 GEMM (`fp8lm.ops.finegrained.fp4_gemm_kernel`) on which an nvfp4 layer's three GEMMs
    all run, their operands quantized straight into its layout (`quantize_fp4`), or None: another
    recipe, the emulation, a BF16 weight-gradient GEMM, or a GEMM whose shape the kernel does not
    take (the weight gradient's K is the tokens, padded to the Hadamard transform's 16)."""
    if recipe.granularity != "nvfp4" or backend != "scaled_mm" or recipe.weight_grad_gemm == "bf16":
        return None
    kernel = fp4_gemm_kernel(x2.device)
    tokens, (out_features, in_features) = x2.shape[0], weight_shape
    padded = -(-tokens // HADAMARD_SIZE) * HADAMARD_SIZE
    gemms = (
        (tokens, in_features, out_features),
        (tokens, out_features, in_features),
        (out_features, padded, in_features),
    )
    if kernel is None or not all(fp4_shapes_fit(m, k, n, out_dtype) for m, k, n in gemms):
        return None
    return kernel


def _fp4_forward(
    ctx, x2: torch.Tensor, weights: WeightOperands, bias: torch.Tensor | None
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The forward GEMM on the FP4 kernel ``ctx.fp4``; saved for the backward, laid out for its
    GEMMs: the weight along out_features (from the forward's quantization: its 16 x 16 blocks)
    and the input, Hadamard-transformed, along the tokens."""
    recipe, kernel = ctx.recipe, ctx.fp4
    x_fp4 = quantize_fp4(x2, recipe, "input", 1, kernel)[0]
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    w_fp4, *w_dgrad = weights.fp4(kernel, both_ways=need_x)
    y = fp4_mm(x_fp4, w_fp4, ctx.out_dtype, bias, kernel)
    x_wgrad = None
    if need_w:
        x_wgrad = quantize_fp4(random_hadamard(x2, recipe.hadamard_seed), recipe, "input", 0, kernel)[0]
    none = (None, None, None)
    return y, [*(w_dgrad[0] if w_dgrad else none), *(x_wgrad or none)]


def _fp4_backward(ctx, g2: torch.Tensor, saved) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input- and weight-gradient GEMMs on the FP4 kernel ``ctx.fp4``, the output gradient
    quantized (stochastically rounded) straight into its layout, as `_block_backward` quantizes it."""
    recipe, kernel, out_dtype = ctx.recipe, ctx.fp4, ctx.out_dtype
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        g_fp4 = quantize_fp4(g2, recipe, "grad_output", 1, kernel)[0]
        grad_x = fp4_mm(g_fp4, FP4Operand(*saved[:3]), out_dtype, kernel=kernel)
    if ctx.needs_input_grad[1]:
        hg_fp4 = quantize_fp4(random_hadamard(g2, recipe.hadamard_seed), recipe, "grad_output", 0, kernel)[0]
        grad_w = fp4_mm(hg_fp4, FP4Operand(*saved[3:]), out_dtype, kernel=kernel)
    return grad_x, grad_w


def _stored_gradient(grad_w: torch.Tensor, ctx) -> torch.Tensor:
    """The weight gradient (in the GEMM's output dtype) as the weight takes it: stored in the
    layer's weight-gradient format (`_stored_weight_grad`; plain for a plain weight while
    torch.compile traces), or in the weight's dtype without one."""
    if ctx.weight_grad_format is None:
        return grad_w.to(ctx.w_dtype)
    plain = ctx.plain and torch.compiler.is_compiling()
    return _stored_weight_grad(grad_w, ctx.weight_grad_format, ctx.w_dtype, plain)


def fine_grained_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    weight_operand: BlockOperand | None = None,
    weight_grad_format: Format | None = None,
    stored: torch.Tensor | None = None,
    kept_operands: dict | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the GEMMs of the fine-grained ``recipe`` (module doc).
    Output in the autocast dtype under ``torch.autocast``, else ``x``'s dtype. ``weight``: a plain
    tensor, or a stored `fp8lm.ScalingTensor` (its values ``payload / scale``, read inside the
    quantization). ``weight_operand``: the forward GEMM's weight operand where it is already
    quantized (`quantize_operand` of the weight along in_features, as FSDP2 gathers it): the
    input-gradient GEMM's operand is quantized from its values where its blocks are not the
    forward's (rowwise, mxfp8). ``weight_grad_format``: the weight's gradient is stored in it, as
    `fp8lm.nn.FP8Linear` stores it; without one it is a plain tensor of the weight's dtype.
    ``stored``: where ``weight`` is a view of a stored tensor made in the forward (a tensor-parallel
    parameter's local tensor), that tensor: its payload and scale are read. ``kept_operands``: a
    dict in which the weight's quantized operands are kept for later calls (`WeightOperands`;
    eager only), which the caller empties whenever the weight changes; a kept operand is used
    as it is."""
    if not recipe.fine_grained:
        raise ValueError(f"fine_grained_linear takes a fine-grained recipe, got granularity {recipe.granularity!r}")
    if x.device.type == "cuda" and not torch.compiler.is_compiling():
        warn_if_emulated(recipe, x.device)
    stored = weight if stored is None else stored
    if isinstance(stored, ScalingTensor):
        payload, stored_scale = stored.payload, stored.scale
    else:
        payload, stored_scale = weight, None
    held = _gathered_bytes(payload, recipe) if weight_operand is not None else None
    held_payload, held_d = held or (None, None)
    stored_payload = None if payload is weight else payload
    args = (x, weight, stored_payload, stored_scale, bias, recipe, weight_operand, weight_grad_format)
    if torch.compiler.is_compiling():  # the graph quantizes the weight in every call
        kept_operands = None
    return _FineGrainedLinear.apply(*args, held_payload, held_d, kept_operands)
