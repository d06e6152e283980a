"""Fine-grained quantization of GEMM operands under a `Recipe`, and the emulated GEMM of them.

`quantize_operand(x, recipe, role, dim)` quantizes a 2-D operand along ``dim``, the reduction
dimension of the GEMM that reads it (1: along rows, as the forward GEMM reads the input and the
weight; 0: along columns, as the weight-gradient GEMM reads the input and the output gradient),
in the blocks of the recipe's granularity (`fp8lm.ops.blocks`; the last block of a dim may be
partial):

| granularity | input, grad_output | weight | scale (`fp8lm.ops.block_scales`) |
|---|---|---|---|
| tensorwise | the tensor | the tensor | `pow2_ceil` (current scaling) |
| rowwise | a row along ``dim`` | the same | `pow2_ceil` |
| blockwise | 1 x 128 along ``dim`` | 128 x 128 | `amax_over_max` (`pow2_ceil` with ``pow2_scales``) |
| mxfp8 | 1 x 32 along ``dim`` | the same | `pow2_floor` (`pow2_ceil` with ``mx_rounding="rceil"``) |
| nvfp4 | 1 x 16 along ``dim`` | 16 x 16 | two levels, `fp8lm.ops.nvfp4` (or Four Over Six, ``nvfp4_scale_rule``) |

Elements are the role's format of the recipe (``input_format``, ``weight_format``,
``grad_output_format``), ``cast(x / d)`` rounded to nearest even and saturating; nvfp4's are E2M1,
stochastically rounded for ``grad_output`` (uniform noise from ``generator``, else torch's default
generator: ``torch.manual_seed`` makes it reproducible). A `BlockOperand` holds the payload and
one float32 ``d`` per block; its values are ``payload * d``. `block_mm` multiplies two of them
as an FP8 GEMM with FP32 accumulation does: ``torch._scaled_mm`` with row-wise scales where it
takes them (the rowwise recipes on CUDA) or with 1 x 128 / 128 x 128 block scales (blockwise, on
CUDA of compute capability 9.0: cuBLAS's block-scaled GEMM) or with MX scales (mxfp8, on compute
capability 10.0+) or as NVFP4 (nvfp4 on compute capability 10.0+: `nvfp4_scaled_mm`, the E2M1
elements packed, the operands' ``tensor_scale`` in the epilogue; on 8.9 and 9.0 with Triton
installed, the Triton kernel of `fp8lm.ops.triton_nvfp4` on the same packed operands), else
exactly, the dequantized operands in FP32.
"""

from __future__ import annotations

import types
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..formats import format_of
from ..recipe import Recipe, recipe_from
from . import nvfp4
from .block_scales import amax_over_max, e8m0_codes, pow2_ceil, pow2_floor
from .blocks import Block, block_amax, from_blocks, per_block, to_blocks
from .cast import upcast
from .fastpath import COMPILED_CASTS, FastPath

__all__ = [
    "ROLES",
    "BlockOperand",
    "operand_block",
    "quantize_operand",
    "requantize_operand",
    "block_mm",
    "takes_rowwise_scaled_mm",
    "rowwise_scaled_mm",
    "takes_block_scaled_mm",
    "block_scaled_mm",
    "takes_mx_scaled_mm",
    "mx_scaled_mm",
    "mx_blocked_scales",
    "takes_nvfp4_scaled_mm",
    "nvfp4_scaled_mm",
    "fp4_gemm_kernel",
    "fine_grained_kernel",
    "warn_if_emulated",
    "fp4_shapes_fit",
    "FP4Operand",
    "quantize_fp4",
    "fp4_mm",
    "nvfp4_blocked_scales",
    "takes_triton_nvfp4_mm",
    "nvfp4_row_operand",
    "pack_nvfp4_operand",
    "unpack_nvfp4_operand",
    "fake_quantize",
]

ROLES = ("input", "weight", "grad_output")
# Off the CPU, one operand's quantization (block amaxes, scales, the cast: a dozen eager kernels)
# runs as one compiled function; FP8LM_FUSED_CAST=0 turns it off.
FUSED_QUANTIZE = FastPath("compiled block quantization", fallback="eager ops", switch=COMPILED_CASTS)
_compiled: dict = {}
_ONE = torch.ones(())  # `upcast`'s scale: the payload's own values


class BlockOperand(NamedTuple):
    """A quantized 2-D operand: a float8 ``payload`` and one float32 ``d`` per ``block`` of it.
    ``tensor_scale``: nvfp4's per-tensor decode scale ``s_dec`` (a 0-d float32 tensor), of which
    each ``d`` is its block's E4M3 scale times (`fp8lm.ops.nvfp4`); None for the other recipes."""

    payload: torch.Tensor
    d: torch.Tensor
    block: Block
    tensor_scale: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The values the GEMM sees, ``payload * d``, as float32 (compiled off the CPU, as
        `quantize_operand`; one op on the CPU while torch.compile traces, `CPU_QUANTIZE_OP`)."""
        if _quantizes_as_op(self.payload.device):
            return _dequantize_blocks(self.payload, self.d, self.block[0], self.block[1])
        return _fused(_dequantize, (self.block,), self.payload.device, self.payload, self.d, self.block)

    def t(self) -> BlockOperand:
        """The transposed operand (a view of the payload)."""
        return BlockOperand(self.payload.t(), self.d.t(), (self.block[1], self.block[0]), self.tensor_scale)


def _dequantize(payload: torch.Tensor, d: torch.Tensor, block: Block) -> torch.Tensor:
    return _scaled_values(_float32_values(payload), d, block)


def _scaled_values(values: torch.Tensor, d: torch.Tensor, block: Block) -> torch.Tensor:
    return from_blocks(to_blocks(values, block) * per_block(d), values.shape)


def _float32_values(payload: torch.Tensor) -> torch.Tensor:
    """``payload.to(torch.float32)``, with its strides (the GEMM's summation order follows them).
    On CPU torch converts float8 one element at a time; `upcast`'s kernel is ~5x faster."""
    if payload.device.type == "cpu" and payload.dim() == 2 and not torch.compiler.is_compiling():
        if payload.is_contiguous():
            return upcast(payload, _ONE, torch.float32)
        if payload.t().is_contiguous():
            return upcast(payload.t(), _ONE, torch.float32).t()
    return payload.to(torch.float32)


def _fused(fn, key: tuple, device: torch.device, *args):
    """``fn(*args)``, as one compiled function (once per ``key``) off the CPU (`FUSED_QUANTIZE`):
    eager on the CPU, while torch.compile traces, or with the fast path off."""
    if device.type == "cpu" or torch.compiler.is_compiling() or not FUSED_QUANTIZE.enabled:
        return fn(*args)
    compiled = _compiled_fn(fn, *key)
    return FUSED_QUANTIZE.run(lambda: compiled(*args), lambda: fn(*args))


def _compiled_fn(fn, *key):
    """``fn`` compiled, once per ``key``: each key gets a code object of its own, since
    torch.compile's recompile limit counts graphs per code object (as `fp8lm.ops.cast` does)."""
    full = (fn, *key)
    if full not in _compiled:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(_compiled)}")
        _compiled[full] = torch.compile(types.FunctionType(code, fn.__globals__), dynamic=True)
    return _compiled[full]


def operand_block(recipe: Recipe, role: str, shape: tuple[int, ...] | torch.Size, dim: int) -> Block:
    """The block of a 2-D operand of ``shape`` in ``role`` quantized along ``dim`` (see the module doc)."""
    rows, cols = max(shape[0], 1), max(shape[1], 1)
    if recipe.granularity == "tensorwise":
        return rows, cols
    if recipe.granularity == "rowwise":
        return (1, cols) if dim == 1 else (rows, 1)
    size = recipe.block
    assert size is not None  # every other granularity has one (Recipe)
    if role == "weight" and recipe.granularity in ("blockwise", "nvfp4"):
        return size, size
    return (1, size) if dim == 1 else (size, 1)


def _role_format(recipe: Recipe, role: str):
    return {"input": recipe.input_format, "weight": recipe.weight_format, "grad_output": recipe.grad_output_format}[
        role
    ]


_SCALE_RULES = {"amax_over_max": amax_over_max, "pow2_floor": pow2_floor, "pow2_ceil": pow2_ceil}


def _scale_rule(recipe: Recipe) -> str:
    """The name (in `_SCALE_RULES`) of the rule that gives each block its scale."""
    if recipe.granularity == "blockwise" and not recipe.pow2_scales:
        return "amax_over_max"
    if recipe.granularity == "mxfp8" and recipe.mx_rounding == "floor":
        return "pow2_floor"
    return "pow2_ceil"


def quantize_operand(
    x: torch.Tensor,
    recipe: Recipe,
    role: str,
    dim: int = 1,
    generator: torch.Generator | None = None,
    tensor_amax: torch.Tensor | None = None,
    stored_scale: torch.Tensor | None = None,
) -> BlockOperand:
    """``x`` (2-D) quantized as the recipe's ``role`` operand along ``dim`` (see the module doc).
    ``tensor_amax``: nvfp4's per-tensor amax when ``x`` is part of a larger tensor (an FSDP2
    shard), else ``x``'s own. ``stored_scale``: ``x`` is a stored payload whose values are ``x /
    stored_scale`` in float32 (an FP8 layer's weight), computed inside the quantization. Off the
    CPU it runs as one compiled function (`FUSED_QUANTIZE`), unless a ``generator`` is given or
    torch.compile is already tracing."""
    block = operand_block(recipe, role, x.shape, dim)
    x = x.detach()
    if generator is None and _quantizes_as_op(x.device):
        payload, d, tensor_scale = _opaque_quantize(_stored_values(x, stored_scale), recipe, role, block, tensor_amax)
        return BlockOperand(payload, d, block, tensor_scale)
    if x.device.type == "cpu" or generator is not None or torch.compiler.is_compiling() or not FUSED_QUANTIZE.enabled:
        payload, d, tensor_scale = _quantize(
            _stored_values(x, stored_scale), recipe, role, block, generator, tensor_amax
        )
        return BlockOperand(payload, d, block, tensor_scale)
    column_major = _column_major(recipe, block, dim)
    with torch.no_grad():
        payload, d, tensor_scale = _fused(
            _quantize_laid_out,
            (recipe, role, block, column_major),
            x.device,
            x,
            recipe,
            role,
            block,
            tensor_amax,
            stored_scale,
            column_major,
        )
    return BlockOperand(payload, d, block, tensor_scale)


def requantize_operand(op: BlockOperand, recipe: Recipe, role: str, dim: int) -> BlockOperand:
    """`quantize_operand` of ``op``'s values (``op.dequantize()``) along ``dim``: an FSDP2-gathered
    weight's operand for its other GEMM. Off the CPU one compiled function, which never writes the
    float32 values (`FUSED_QUANTIZE`)."""
    block = operand_block(recipe, role, op.payload.shape, dim)
    column_major = _column_major(recipe, block, dim)
    if _quantizes_as_op(op.payload.device):
        payload, d, tensor_scale = _opaque_quantize(op.dequantize(), recipe, role, block, None)
        return BlockOperand(_laid_out(payload, column_major), d, block, tensor_scale)
    with torch.no_grad():
        payload, d, tensor_scale = _fused(
            _requantize,
            (op.block, recipe, role, block, column_major),
            op.payload.device,
            op,
            recipe,
            role,
            block,
            column_major,
        )
    return BlockOperand(payload, d, block, tensor_scale)


def _requantize(
    op: BlockOperand, recipe: Recipe, role: str, block: Block, column_major: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    values = _dequantize(op.payload, op.d, op.block)
    payload, d, tensor_scale = _quantize(values, recipe, role, block, None)
    return _laid_out(payload, column_major), d, tensor_scale


def _column_major(recipe: Recipe, block: Block, dim: int) -> bool:
    """Whether the compiled quantization writes an operand column-major: an FP8 GEMM reads one
    quantized along dim 0 so (`block_mm`'s ``b``, or the transposed ``a`` of the weight
    gradient), and writing it so spares the GEMM a copy. Square blocks serve two GEMMs in both
    layouts; nvfp4 is repacked for its GEMM."""
    return dim == 0 and block[1] == 1 and recipe.granularity != "nvfp4"


def _laid_out(payload: torch.Tensor, column_major: bool) -> torch.Tensor:
    return payload.t().contiguous().t() if column_major else payload


def _stored_values(x: torch.Tensor, stored_scale: torch.Tensor | None) -> torch.Tensor:
    """The values of a stored payload ``x`` (`quantize_operand`'s ``stored_scale``)."""
    return x if stored_scale is None else x.to(torch.float32) / stored_scale


def _quantize_laid_out(
    x: torch.Tensor,
    recipe: Recipe,
    role: str,
    block: Block,
    tensor_amax: torch.Tensor | None,
    stored_scale: torch.Tensor | None,
    column_major: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_quantize` of `_stored_values`, its payload stored column-major where ``column_major`` says so."""
    payload, d, tensor_scale = _quantize(_stored_values(x, stored_scale), recipe, role, block, None, tensor_amax)
    return _laid_out(payload, column_major), d, tensor_scale


def _quantize(
    x: torch.Tensor,
    recipe: Recipe,
    role: str,
    block: Block,
    generator: torch.Generator | None,
    tensor_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The payload, scales and (nvfp4) tensor scale of `quantize_operand`."""
    return _quantize_as(x, _QuantizeRule.of(recipe, role), block, generator, tensor_amax)


class _QuantizeRule(NamedTuple):
    """What `_quantize` reads of a recipe and a role: strings and a dtype, which a `torch.library`
    op takes as arguments (`_quantize_blocks`)."""

    granularity: str
    dtype: torch.dtype  # of the elements (not read for nvfp4: E2M1 values in E4M3 bytes)
    scale_rule: str  # of `_SCALE_RULES` (not read for nvfp4)
    nvfp4_scale_rule: str
    stochastic: bool  # nvfp4's grad_output

    @classmethod
    def of(cls, recipe: Recipe, role: str) -> _QuantizeRule:
        nvfp4 = recipe.granularity == "nvfp4"
        dtype = _role_format(recipe, role).dtype
        stochastic = nvfp4 and role == "grad_output"
        return cls(recipe.granularity, dtype, _scale_rule(recipe), recipe.nvfp4_scale_rule, stochastic)


def _quantize_as(
    x: torch.Tensor,
    rule: _QuantizeRule,
    block: Block,
    generator: torch.Generator | None,
    tensor_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    xb = to_blocks(x, block)
    amax = block_amax(xb)
    if rule.granularity == "nvfp4":
        whole = amax.amax() if tensor_amax is None else tensor_amax.to(torch.float32)
        return _nvfp4_operand(x, xb, amax, whole, block, rule.nvfp4_scale_rule, rule.stochastic, generator)
    fmax = format_of(rule.dtype).max
    d = _SCALE_RULES[rule.scale_rule](amax, fmax)
    q = (xb.to(torch.float32) / per_block(d)).clamp(-fmax, fmax).to(rule.dtype)
    return from_blocks(q, x.shape), d, None


def _nvfp4_operand(
    x: torch.Tensor,
    xb: torch.Tensor,
    amax: torch.Tensor,
    tensor_amax: torch.Tensor,
    block: Block,
    scale_rule: str,
    stochastic: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s_enc, s_dec = nvfp4.tensor_scales(tensor_amax, scale_rule)
    d = nvfp4.block_scales(amax, s_enc, s_dec)
    nearest = None
    if scale_rule == "4over6":  # its choice already rounded the values to nearest
        d, nearest = nvfp4.four_over_six(xb, d, nvfp4.block_scales(amax, s_enc, s_dec, element_max=4.0))
    if stochastic:
        # generator=None is not passed on: torch.compile with dynamic shapes cannot trace it
        # (torch.rand's generator overload takes concrete sizes only)
        uniform = (
            torch.rand(x.shape, device=x.device)
            if generator is None
            else torch.rand(x.shape, generator=generator, device=x.device)
        )
        noise = to_blocks(uniform, block)
        q = nvfp4.round_e2m1(nvfp4.scaled(xb, d), noise)
    else:
        q = nearest if nearest is not None else nvfp4.round_e2m1(nvfp4.scaled(xb, d))
    return from_blocks(q.to(torch.float8_e4m3fn), x.shape), d, s_dec


def block_mm(
    a: BlockOperand,
    b: BlockOperand,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    backend: str = "emulated",
    e8m0_scales: bool = False,
) -> torch.Tensor:
    """``values(a) @ values(b) (+ bias)`` as ``out_dtype``, ``a`` (M, K) and ``b`` (K, N), with
    FP32 accumulation. ``backend="scaled_mm"`` (as `fp8lm.ops.gemm.choose_backend` resolves it)
    runs ``torch._scaled_mm`` with row-wise scales where it takes the operands (`rowwise_scaled_mm`)
    or with DeepSeek-V3's block scales (`block_scaled_mm`, CUDA of compute capability 9.0) or,
    where ``e8m0_scales`` says the scales are powers of two (mxfp8), with MX scales
    (`mx_scaled_mm`, compute capability 10.0+), or nvfp4 operands as NVFP4 (`nvfp4_scaled_mm`,
    compute capability 10.0+; `fp8lm.ops.triton_nvfp4` on 8.9 and 9.0 with Triton); otherwise,
    and with ``"emulated"``, an FP32 GEMM of the exact float32 values, rounded once."""
    if a.payload.shape[1] != b.payload.shape[0]:
        raise ValueError(f"block_mm: shapes {tuple(a.payload.shape)} and {tuple(b.payload.shape)} cannot be multiplied")
    if backend == "scaled_mm" and takes_rowwise_scaled_mm(a, b, out_dtype):
        return rowwise_scaled_mm(a, b, out_dtype, bias)
    if backend == "scaled_mm" and takes_block_scaled_mm(a, b, out_dtype):
        return block_scaled_mm(a, b, out_dtype, bias)
    if backend == "scaled_mm" and e8m0_scales and takes_mx_scaled_mm(a, b, out_dtype):
        return mx_scaled_mm(a, b, out_dtype, bias)
    if backend == "scaled_mm" and takes_nvfp4_scaled_mm(a, b, out_dtype):
        return nvfp4_scaled_mm(a, b, out_dtype, bias)
    if backend == "scaled_mm" and takes_triton_nvfp4_mm(a, b, out_dtype):
        from .triton_nvfp4 import triton_nvfp4_mm

        return triton_nvfp4_mm(a, b, out_dtype, bias)
    a32, b32 = a.dequantize(), b.dequantize()
    out = torch.mm(a32, b32) if bias is None else torch.addmm(bias.to(torch.float32), a32, b32)
    return out.to(out_dtype)


def takes_rowwise_scaled_mm(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` multiplies ``a`` and ``b`` with their own scales: E4M3 operands
    with one scale per row of ``a`` and per column of ``b`` (row-wise scaling along the reduction
    dimension), a BF16 result, and on CUDA dims that are multiples of 16 on a device of compute
    capability 9.0 or more."""
    (m, k), n = a.payload.shape, b.payload.shape[1]
    if not (a.payload.dtype == b.payload.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16):
        return False
    if tuple(a.d.shape) != (m, 1) or tuple(b.d.shape) != (1, n) or min(m, k, n) == 0:
        return False
    if a.payload.device.type != "cuda":
        return True
    return _runs_fp8("rowwise", a.payload.device) and not (m % 16 or k % 16 or n % 16)


def rowwise_scaled_mm(
    a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`block_mm` of row-wise scaled operands (`takes_rowwise_scaled_mm`) by ``torch._scaled_mm``:
    ``a`` row-major, ``b`` column-major (a copy where the payload is not laid out so), the scales
    as its ``scale_a`` (M, 1) and ``scale_b`` (1, N), the bias in its epilogue."""
    a_data = a.payload.contiguous()
    b_data = b.payload if b.payload.t().is_contiguous() else b.payload.t().contiguous().t()
    epilogue = None if bias is None else bias.to(out_dtype)
    # Unit strides: a transposed operand's (M, 1) scales may be a view with stride (1, M).
    scale_a, scale_b = a.d.flatten().unsqueeze(1), b.d.flatten().unsqueeze(0)
    return torch._scaled_mm(a_data, b_data, scale_a=scale_a, scale_b=scale_b, bias=epilogue, out_dtype=out_dtype)


def takes_block_scaled_mm(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` multiplies ``a`` and ``b`` with DeepSeek-V3's block scales
    (cuBLAS; CUDA only, compute capability 9.0): `block_scales_fit` and a CUDA device of
    capability 9.0 (torch has no CPU kernel for them)."""
    if a.payload.device.type != "cuda" or not block_scales_fit(a, b, out_dtype):
        return False
    return _runs_fp8("blockwise", a.payload.device)


def block_scales_fit(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype) -> bool:
    """Whether ``a`` (M, K) and ``b`` (K, N) have the layout cuBLAS's block-scaled FP8 GEMM takes:
    E4M3 payloads, ``a`` in 1 x 128 blocks along K, ``b`` in 128 x 128 blocks or 128 x 1 (1 x 128
    along K), K a multiple of 128 (of 512 with 128 x 128 blocks, whose scales cuBLAS reads in
    groups of 4), M and N multiples of 16, a BF16 or FP32 result."""
    (m, k), n = a.payload.shape, b.payload.shape[1]
    if not (a.payload.dtype == b.payload.dtype == torch.float8_e4m3fn and out_dtype in (torch.bfloat16, torch.float32)):
        return False
    if a.block != (1, 128) or b.block not in ((128, 128), (128, 1)) or min(m, k, n) == 0:
        return False
    k_multiple = 512 if b.block == (128, 128) else 128
    return not (k % k_multiple or m % 16 or n % 16)


def block_scaled_mm(
    a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`block_mm` of block-scaled operands (`takes_block_scaled_mm`) by ``torch._scaled_mm``:
    ``a`` row-major with its (M, K / 128) scales outer-dim-major (stride (1, M)); ``b``
    column-major with its 128 x 128 block scales (K / 128, N / 128) as the transpose of a row-major
    tensor, or its 1 x 128 scales (K / 128, N) row-major (the layouts torch's tests give cuBLAS).
    A bias is added to the FP32 result before the one rounding to ``out_dtype``, as the emulation
    adds it."""
    a_data = a.payload.contiguous()
    b_data = b.payload if b.payload.t().is_contiguous() else b.payload.t().contiguous().t()
    scale_a = a.d.t().contiguous().t()
    scale_b = b.d.t().contiguous().t() if b.block == (128, 128) else b.d.contiguous()
    if bias is None:
        return torch._scaled_mm(a_data, b_data, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    out = torch._scaled_mm(a_data, b_data, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    return _add_bias_rounded(out, bias, out_dtype)


def _add_bias_rounded(out: torch.Tensor, bias: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """An FP32 GEMM result plus ``bias``, rounded once to ``out_dtype``: how the block-scaled GEMMs
    add a bias as the emulation does (cuBLAS takes a bias in its epilogue only in the output's
    dtype, rounded first). One compiled function off the CPU (`FUSED_QUANTIZE`): one read of the
    FP32 result, one write of the output."""
    return _fused(_add_bias, (out_dtype,), out.device, out, bias, out_dtype)


def _add_bias(out: torch.Tensor, bias: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (out + bias.to(torch.float32)).to(out_dtype)


def takes_mx_scaled_mm(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` multiplies ``a`` and ``b`` with MX scales (cuBLAS; CUDA of
    compute capability 10.0 or more): `mx_scales_fit` on such a device. The caller vouches that
    the scales are powers of two (E8M0 holds them exactly)."""
    if a.payload.device.type != "cuda" or not mx_scales_fit(a, b, out_dtype):
        return False
    return _runs_fp8("mxfp8", a.payload.device)


def mx_scales_fit(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype) -> bool:
    """Whether ``a`` (M, K) and ``b`` (K, N) are MXFP8 operands of cuBLAS's MX GEMM: E4M3
    payloads in blocks of 32 along K (``a`` 1 x 32, ``b`` 32 x 1), K a multiple of 32, M and N
    multiples of 16, a BF16 or FP32 result."""
    (m, k), n = a.payload.shape, b.payload.shape[1]
    if not (a.payload.dtype == b.payload.dtype == torch.float8_e4m3fn and out_dtype in (torch.bfloat16, torch.float32)):
        return False
    if a.block != (1, 32) or b.block != (32, 1) or min(m, k, n) == 0:
        return False
    return not (k % 32 or m % 16 or n % 16)


def mx_blocked_scales(d: torch.Tensor) -> torch.Tensor:
    """The scales ``d`` (rows, K / 32; powers of two) as cuBLAS reads MX scales: E8M0 bytes in its
    blocked layout, padded with zeros to 128 rows by 4 columns, each 128 x 4 tile stored as 32
    rows of 16 bytes (row ``r`` of the tile at ``r % 32``, byte ``4 * (r // 32) + column``), the
    tiles row-major. Flat, as ``torch._scaled_mm`` takes them. Off the CPU one compiled function
    (`FUSED_QUANTIZE`)."""
    return _fused(_blocked_e8m0, (), d.device, d).view(torch.float8_e8m0fnu)


def _blocked_e8m0(d: torch.Tensor) -> torch.Tensor:
    """`mx_blocked_scales` as bytes (`e8m0_codes`)."""
    return _blocked(e8m0_codes(d))


def _blocked(codes: torch.Tensor) -> torch.Tensor:
    """One-byte scale codes (rows, K / block) in cuBLAS's blocked layout (`mx_blocked_scales`),
    which MX and NVFP4 scales share."""
    rows, cols = codes.shape
    tiles_r, tiles_c = -(-rows // 128), -(-cols // 4)
    padded = F.pad(codes, (0, tiles_c * 4 - cols, 0, tiles_r * 128 - rows))
    tiles = padded.view(tiles_r, 4, 32, tiles_c, 4).permute(0, 3, 2, 1, 4)  # (tr, tc, r % 32, r // 32, col)
    return tiles.reshape(-1)


def mx_scaled_mm(
    a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`block_mm` of MXFP8 operands (`takes_mx_scaled_mm`) by ``torch._scaled_mm``: ``a``
    row-major, ``b`` column-major, the scales of each as (rows, K / 32) in cuBLAS's blocked E8M0
    layout (`mx_blocked_scales`). A bias is added to the FP32 result before the one rounding, as
    in `block_scaled_mm`."""
    a_data = a.payload.contiguous()
    b_data = b.payload if b.payload.t().is_contiguous() else b.payload.t().contiguous().t()
    scale_a, scale_b = mx_blocked_scales(a.d), mx_blocked_scales(b.d.t())
    if bias is None:
        return torch._scaled_mm(a_data, b_data, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    out = torch._scaled_mm(a_data, b_data, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    return _add_bias_rounded(out, bias, out_dtype)


# The CUDA compute capabilities on which torch's scaled GEMM takes each block format (cuBLAS):
# row-wise scales from Hopper on, DeepSeek-V3's 1 x 128 / 128 x 128 block scales on Hopper only,
# MX scales from Blackwell on.
_SCALED_MM_CAPABILITIES = {
    "rowwise": lambda capability: capability >= (9, 0),
    "blockwise": lambda capability: capability == (9, 0),
    "mxfp8": lambda capability: capability >= (10, 0),
}
_KERNEL_NAMES = {
    "rowwise": "torch._scaled_mm with row-wise scales",
    "blockwise": "torch._scaled_mm with 1 x 128 / 128 x 128 block scales",
    "mxfp8": "torch._scaled_mm with MX scales",
    "cublas": "cuBLAS's FP4 GEMM",
    "triton": "fp8lm's Triton FP4 GEMM",
}
_FAST_WHERE = {  # where each recipe multiplies in FP8, and what to use elsewhere
    "rowwise": "compute capability 9.0 and later",
    "blockwise": "compute capability 9.0 only (torch's block-scaled GEMM); on 10.0 and later use mxfp8 or rowwise",
    "mxfp8": "compute capability 10.0 and later; on 9.0 use rowwise or blockwise",
    "nvfp4": "compute capability 10.0 and later, or 8.9 / 9.0 with Triton (pip install 'fp8lm[triton]')",
}
_checked_emulation: set = set()


def _runs_fp8(granularity: str, device: torch.device) -> bool:
    """Whether torch's scaled GEMM takes ``granularity``'s blocks on CUDA ``device``."""
    return _SCALED_MM_CAPABILITIES[granularity](torch.cuda.get_device_capability(device))


def fine_grained_kernel(recipe: Recipe, device: torch.device) -> str | None:
    """The kernel that multiplies a fine-grained ``recipe``'s GEMMs on ``device`` (where their
    shapes fit it, `block_mm`), by name, or None where they are emulated: FP32 GEMMs of the
    dequantized operands (the CPU, and CUDA devices without that kernel)."""
    if device.type != "cuda" or not recipe.fine_grained:
        return None
    if recipe.granularity == "nvfp4":
        kernel = fp4_gemm_kernel(device)
        return None if kernel is None else _KERNEL_NAMES[kernel]
    return _KERNEL_NAMES[recipe.granularity] if _runs_fp8(recipe.granularity, device) else None


def warn_if_emulated(recipe: Recipe, device: torch.device) -> None:
    """One warning per recipe and kind of GPU where a fine-grained recipe's GEMMs would run
    emulated on a CUDA ``device`` (`fine_grained_kernel` is None) though the recipe asks for
    FP8 GEMMs (``backend`` not ``"emulated"``): FP32 GEMMs, several times slower than BF16."""
    if device.type != "cuda" or recipe.backend == "emulated" or not recipe.fine_grained:
        return
    capability = torch.cuda.get_device_capability(device)
    key = (recipe.granularity, capability)
    if key in _checked_emulation:  # each recipe and kind of GPU looked up once, in every forward
        return
    _checked_emulation.add(key)
    if fine_grained_kernel(recipe, device) is not None:
        return
    name = recipe.name or recipe.granularity
    where = f"{device} (compute capability {capability[0]}.{capability[1]})"
    warnings.warn(
        f"fp8lm: recipe {name} has no FP8 GEMM on {where}: its GEMMs run emulated in FP32, slower than "
        f"BF16; {recipe.granularity} multiplies in FP8 on {_FAST_WHERE[recipe.granularity]}",
        stacklevel=3,
    )


def fp4_gemm_kernel(device: torch.device) -> str | None:
    """The FP4 GEMM nvfp4 operands take on ``device``: ``"cublas"`` (`nvfp4_scaled_mm`, compute
    capability 10.0 and later), ``"triton"`` (`fp8lm.ops.triton_nvfp4`, 8.9 up to 10.0, with
    Triton installed), or None (the CPU, older GPUs: the emulation)."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= (10, 0):
        return "cublas"
    from .triton_nvfp4 import AVAILABLE

    return "triton" if AVAILABLE and capability >= (8, 9) else None


def takes_nvfp4_scaled_mm(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` multiplies ``a`` and ``b`` as NVFP4 (cuBLAS's FP4 GEMM with
    E4M3 scales per 16 elements; CUDA of compute capability 10.0 or more): `nvfp4_scales_fit` on
    such a device."""
    return nvfp4_scales_fit(a, b, out_dtype) and fp4_gemm_kernel(a.payload.device) == "cublas"


def takes_triton_nvfp4_mm(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype) -> bool:
    """Whether the Triton GEMM of nvfp4 operands (`fp8lm.ops.triton_nvfp4`) multiplies ``a`` and
    ``b``: `nvfp4_scales_fit` on a CUDA device without FP4 tensor cores (compute capability 8.9
    up to 10.0, where `takes_nvfp4_scaled_mm` takes them) and Triton installed."""
    return nvfp4_scales_fit(a, b, out_dtype) and fp4_gemm_kernel(a.payload.device) == "triton"


def nvfp4_scales_fit(a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype) -> bool:
    """Whether ``a`` (M, K) and ``b`` (K, N) are nvfp4 operands cuBLAS's FP4 GEMM takes: both with
    a tensor scale, blocks of 16 along K (``a`` 1 x 16 or 16 x 16, ``b`` 16 x 1 or 16 x 16), and
    `fp4_shapes_fit`."""
    (m, k), n = a.payload.shape, b.payload.shape[1]
    if a.tensor_scale is None or b.tensor_scale is None:
        return False
    if a.block not in ((1, 16), (16, 16)) or b.block not in ((16, 1), (16, 16)):
        return False
    return fp4_shapes_fit(m, k, n, out_dtype)


def fp4_shapes_fit(m: int, k: int, n: int, out_dtype: torch.dtype) -> bool:
    """Whether an FP4 GEMM of (M, K) by (K, N) to ``out_dtype`` is one the FP4 kernels take: K a
    multiple of 32 (16 bytes packed), M and N multiples of 16, none of them 0, a BF16 or FP32
    result."""
    if out_dtype not in (torch.bfloat16, torch.float32) or min(m, k, n) == 0:
        return False
    return not (k % 32 or m % 16 or n % 16)


def _nvfp4_row_scales(op: BlockOperand) -> torch.Tensor:
    """The E4M3 block scales of ``op`` (rows, K), an nvfp4 operand blocked along K, as bytes
    (rows, K / 16), one per row and 16 elements (a 16 x 16 block's repeated on its 16 rows):
    ``d / tensor_scale``, each an E4M3 value up to float32 rounding, so the cast gives it back
    exactly."""
    assert op.tensor_scale is not None  # nvfp4_scales_fit
    stored = nvfp4.stored_block_scales(op.d, op.tensor_scale).view(torch.uint8)
    if op.block[0] > 1:
        stored = stored.repeat_interleave(op.block[0], dim=0)[: op.payload.shape[0]]
    return stored.contiguous()


def nvfp4_blocked_scales(op: BlockOperand) -> torch.Tensor:
    """`_nvfp4_row_scales` in cuBLAS's blocked layout (`mx_blocked_scales`), flat, as
    ``torch.float8_e4m3fn``."""
    return _blocked(_nvfp4_row_scales(op)).view(torch.float8_e4m3fn)


def _nvfp4_gemm_operand(op: BlockOperand, blocked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``op`` (rows, K) as an FP4 GEMM reads it: the E2M1 elements packed along K (row-major
    (rows, K / 2) bytes) and the E4M3 scale bytes, in cuBLAS's blocked layout or row-major
    (rows, K / 16)."""
    scales = _nvfp4_row_scales(op)
    return nvfp4.pack_e2m1_bytes(op.payload), _blocked(scales) if blocked else scales


def nvfp4_row_operand(op: BlockOperand) -> tuple[torch.Tensor, torch.Tensor]:
    """``op`` (rows, K), an nvfp4 operand blocked along K, as packed E2M1 bytes (rows, K / 2) and
    row-major E4M3 scale bytes (rows, K / 16) (`fp8lm.ops.triton_nvfp4`'s operands), as one
    compiled function off the CPU (`FUSED_QUANTIZE`)."""
    return _laid_out_fp4(op, blocked=False)


def _laid_out_fp4(op: BlockOperand, blocked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`_nvfp4_gemm_operand`, as one compiled function off the CPU (`FUSED_QUANTIZE`)."""
    return _fused(_nvfp4_gemm_operand, (op.block, blocked), op.payload.device, op, blocked)


class FP4Operand(NamedTuple):
    """An nvfp4 operand (rows, K) as an FP4 GEMM reads it along K: its E2M1 elements packed two to
    a byte (``packed``, uint8 (rows, K / 2), row-major), its E4M3 scale bytes, one per row and 16
    elements (``scales``: cuBLAS's blocked layout, flat, or row-major (rows, K / 16) for the
    Triton kernel) and its per-tensor decode scale."""

    packed: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor


def quantize_fp4(
    x: torch.Tensor,
    recipe: Recipe,
    role: str,
    dim: int,
    kernel: str,
    stored_scale: torch.Tensor | None = None,
    both_ways: bool = False,
) -> tuple[FP4Operand, ...]:
    """``x`` (2-D) quantized as `quantize_operand` quantizes it for an nvfp4 ``recipe``, straight
    into the layout ``kernel``'s FP4 GEMM reads (`fp4_gemm_kernel`): along ``dim``, so ``x``
    transposed where ``dim`` is 0; with ``both_ways`` also along the other dim (a weight's 16 x
    16 blocks serve its two GEMMs). One compiled function off the CPU (`FUSED_QUANTIZE`): the E4M3
    elements and float32 scales in between are never written. ``stored_scale`` as in
    `quantize_operand`."""
    block = operand_block(recipe, role, x.shape, dim)
    with torch.no_grad():
        laid_out = _fused(
            _quantize_fp4,
            (recipe, role, block, dim, kernel, both_ways),
            x.device,
            x.detach(),
            recipe,
            role,
            block,
            dim,
            kernel == "cublas",
            stored_scale,
            both_ways,
        )
    return tuple(FP4Operand(*parts) for parts in laid_out)


def _quantize_fp4(
    x: torch.Tensor,
    recipe: Recipe,
    role: str,
    block: Block,
    dim: int,
    blocked: bool,
    stored_scale: torch.Tensor | None,
    both_ways: bool,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    payload, d, tensor_scale = _quantize(_stored_values(x, stored_scale), recipe, role, block, None)
    assert tensor_scale is not None  # an nvfp4 recipe
    op = BlockOperand(payload, d, block, tensor_scale)
    along = (op, op.t()) if dim == 1 else (op.t(), op)
    return tuple((*_nvfp4_gemm_operand(o, blocked), tensor_scale) for o in along[: 2 if both_ways else 1])


def fp4_mm(
    a: FP4Operand, bt: FP4Operand, out_dtype: torch.dtype, bias: torch.Tensor | None = None, kernel: str = "cublas"
) -> torch.Tensor:
    """``values(a) @ values(bt).T (+ bias)`` as ``out_dtype``: ``a`` (M, K) and ``bt`` (N, K)
    laid out along K for ``kernel`` (`quantize_fp4`). ``"cublas"``: ``torch.nn.functional.scaled_mm``
    with NVIDIA's two-level scales (the E4M3 block scales in cuBLAS's blocked layout and the
    per-tensor decode scales, applied in the GEMM's epilogue before the one rounding; a bias is
    added to the FP32 result before the rounding, as in `block_scaled_mm`). ``"triton"``:
    `fp8lm.ops.triton_nvfp4`'s kernel, which adds the bias itself."""
    if kernel == "triton":
        epilogue = None if bias is None else bias.detach().to(torch.float32).contiguous()
        return torch.ops.fp8lm.triton_nvfp4_mm(
            a.packed, a.scales, bt.packed, bt.scales, a.tensor_scale, bt.tensor_scale, epilogue, out_dtype
        )
    two_level = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swizzle = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    out = F.scaled_mm(
        a.packed.view(torch.float4_e2m1fn_x2),
        bt.packed.view(torch.float4_e2m1fn_x2).t(),
        scale_a=[a.scales.view(torch.float8_e4m3fn), a.tensor_scale.reshape(1)],
        scale_recipe_a=two_level,
        scale_b=[bt.scales.view(torch.float8_e4m3fn), bt.tensor_scale.reshape(1)],
        scale_recipe_b=two_level,
        swizzle_a=swizzle,
        swizzle_b=swizzle,
        output_dtype=out_dtype if bias is None else torch.float32,
    )
    return out if bias is None else _add_bias_rounded(out, bias, out_dtype)


def nvfp4_scaled_mm(
    a: BlockOperand, b: BlockOperand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`block_mm` of nvfp4 operands (`takes_nvfp4_scaled_mm`) by cuBLAS's FP4 GEMM (`fp4_mm`):
    ``a`` and ``b`` packed two elements to a byte along K, each with its E4M3 block scales in
    cuBLAS's blocked layout (`nvfp4_blocked_scales`) and its per-tensor decode scale, each laid
    out in one compiled function (`FUSED_QUANTIZE`)."""
    assert a.tensor_scale is not None and b.tensor_scale is not None  # nvfp4_scales_fit
    a_fp4 = FP4Operand(*_laid_out_fp4(a), a.tensor_scale)
    bt_fp4 = FP4Operand(*_laid_out_fp4(b.t()), b.tensor_scale)
    return fp4_mm(a_fp4, bt_fp4, out_dtype, bias, "cublas")


def pack_nvfp4_operand(op: BlockOperand) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An nvfp4 operand as NVFP4 stores it, 0.5625 bytes per element instead of 1.25: its E2M1
    elements packed two to a byte along its stored last dim (uint8 bytes, `fp8lm.ops.nvfp4.pack_e2m1`;
    an odd last dim stays E4M3), its E4M3 block scales (`fp8lm.ops.nvfp4.stored_block_scales`)
    and its tensor scale. `unpack_nvfp4_operand` gives the operand back; off the CPU each is one
    compiled function (`FUSED_QUANTIZE`)."""
    return _fused(_pack_nvfp4, (op.block,), op.payload.device, op)


def _pack_nvfp4(op: BlockOperand) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert op.tensor_scale is not None  # an nvfp4 operand
    payload = op.payload if op.payload.shape[-1] % 2 else nvfp4.pack_e2m1_bytes(op.payload)
    return payload, nvfp4.stored_block_scales(op.d, op.tensor_scale), op.tensor_scale


def unpack_nvfp4_operand(
    payload: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, block: Block
) -> BlockOperand:
    """The operand `pack_nvfp4_operand` stored, bit for bit (its ``d`` computed as
    `fp8lm.ops.nvfp4.block_scales` computes it)."""
    values, d = _fused(_unpack_nvfp4, (), payload.device, payload, scales, tensor_scale)
    return BlockOperand(values, d, block, tensor_scale)


def _unpack_nvfp4(
    payload: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if payload.dtype == torch.uint8:  # packed
        payload = nvfp4.unpack_e2m1_as_e4m3(payload)
    return payload, nvfp4.decoded_block_scales(scales, tensor_scale)


def fake_quantize(
    x: torch.Tensor, recipe: Recipe | str, role: str, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The values an FP8 GEMM sees for ``x`` as the ``role`` operand (``"input"``, ``"weight"``,
    ``"grad_output"``) of ``recipe`` (an `fp8lm.Recipe` or its name), in ``x``'s dtype.

    ``x`` is quantized along its last dimension, the reduction dimension of the first GEMM that
    reads it (the forward GEMM for an input (..., in_features) or a weight (out_features,
    in_features), the input-gradient GEMM for an output gradient (..., out_features)); leading
    dimensions are rows. A weight is 2-D. A tensorwise recipe is scaled from ``x``'s own amax
    here (current scaling). ``generator``: nvfp4's stochastic rounding of output gradients. No
    gradient flows through it."""
    recipe = recipe_from(recipe, "fake_quantize")
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    if x.dim() == 0 or (role == "weight" and x.dim() != 2):
        raise ValueError(
            f"fake_quantize: a {role} must be {'2-D' if role == 'weight' else 'at least 1-D'}, got shape {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        raise TypeError(f"fake_quantize takes a floating-point tensor, got {x.dtype}")
    if x.numel() == 0:
        return x.detach().clone()
    x2 = x.detach().reshape(-1, x.shape[-1])
    return quantize_operand(x2, recipe, role, generator=generator).dequantize().to(x.dtype).reshape(x.shape)


# -- the CPU emulation as ops under torch.compile -------------------------------------------------
# On the CPU, while torch.compile traces, an operand's quantization and dequantization are one
# `torch.library` op each (`fp8lm::quantize_blocks`, `fp8lm::dequantize_blocks`), which run the
# eager code:
# - Traced, one operand's quantization is some 50 to 150 ATen ops (nvfp4's two-level scales and
#   rounding the most), which dynamo and AOTAutograd trace one by one: a compiled block compiles
#   in about half the time as ops (docs/performance.md).
# - Inductor's CPU code (torch 2.13) reads wrong values in the dequantization's pattern, a product
#   broadcast over blocks and then cut to a shape the blocks do not divide (`from_blocks`): a
#   compiled layer whose in_features no block divides gave garbage. As an op it runs eager code.
# - nvfp4's stochastic rounding draws eager's noise (inductor's own random numbers differ).
# Off the CPU the quantization stays traced, for inductor to fuse. ``CPU_QUANTIZE_OP = False``
# traces it on the CPU too (the tests compare both).
CPU_QUANTIZE_OP = True


def _quantizes_as_op(device: torch.device) -> bool:
    return CPU_QUANTIZE_OP and device.type == "cpu" and torch.compiler.is_compiling()


def _opaque_quantize(
    x: torch.Tensor, recipe: Recipe, role: str, block: Block, tensor_amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    rule = _QuantizeRule.of(recipe, role)
    op = _quantize_blocks_stochastic if rule.stochastic else _quantize_blocks
    payload, d, tensor_scale = op(
        x, rule.granularity, rule.dtype, rule.scale_rule, rule.nvfp4_scale_rule, block[0], block[1], tensor_amax
    )
    return payload, d, (tensor_scale if rule.granularity == "nvfp4" else None)


def _quantize_op(name: str, stochastic: bool, tags: tuple = ()):
    """The op ``name`` of `_quantize_as`, its fake implementation the same code on fake tensors
    (dynamo traces it where the op is not used): the outputs' strides are the eager ones for any
    input layout."""

    def quantize_blocks(
        x: torch.Tensor,
        granularity: str,
        dtype: torch.dtype,
        scale_rule: str,
        nvfp4_scale_rule: str,
        rows: int,
        cols: int,
        tensor_amax: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rule = _QuantizeRule(granularity, dtype, scale_rule, nvfp4_scale_rule, stochastic)
        payload, d, tensor_scale = _quantize_as(x, rule, (rows, cols), None, tensor_amax)
        return payload, d, (d.new_ones(()) if tensor_scale is None else tensor_scale)

    op = torch.library.custom_op(name, quantize_blocks, mutates_args=(), device_types="cpu", tags=tags)
    op.register_fake(quantize_blocks)
    return op


_quantize_blocks = _quantize_op("fp8lm::quantize_blocks", stochastic=False)
_quantize_blocks_stochastic = _quantize_op(
    "fp8lm::quantize_blocks_stochastic", stochastic=True, tags=(torch.Tag.nondeterministic_seeded,)
)


@torch.library.custom_op("fp8lm::dequantize_blocks", mutates_args=(), device_types="cpu")
def _dequantize_blocks(payload: torch.Tensor, d: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return _dequantize(payload, d, (rows, cols))


@_dequantize_blocks.register_fake
def _(payload: torch.Tensor, d: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    # the eager result's strides (`upcast`'s kernel, which `_dequantize` takes on the CPU, reads
    # real memory; `to` keeps the strides as it does)
    return _scaled_values(payload.to(torch.float32), d, (rows, cols))
