"""A Triton kernel for the 1 x ``block`` quantization of the blockwise and mxfp8 recipes, as the
custom op ``torch.ops.fp8lm.triton_block_quantize`` (optional: needs ``triton``, the
``fp8lm[triton]`` extra).

`triton_block_quantize(x, recipe)` gives the payload and scales of
`fp8lm.ops.finegrained.quantize_operand(x, recipe, "input")` (a 2-D ``x`` in 1 x ``block`` tiles
along its rows) bit for bit, in one kernel: each program takes one tile, its amax, its scale
(`fp8lm.ops.block_scales`: ``amax / 448``, the OCP MX ``floor`` or the ``rceil`` power of two, from
the float32 bits, never ``log2``) and the elements' E4M3 bits, rounded to nearest even with integer
operations (Triton's own FP8 conversion rounds wrongly near powers of two in its interpreter).
The payload is returned as ``torch.float8_e4m3fn``. It runs wherever Triton does: on a GPU, and on
CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run it).

Not used by the layers: off the CPU `quantize_operand` runs as one compiled torch function
(which inductor turns into a Triton kernel of its own); this op is the hand-written one to
compare against and to build fused kernels on.
"""

from __future__ import annotations

import importlib.util

import torch

from ..recipe import Recipe

__all__ = ["AVAILABLE", "RULES", "triton_block_quantize"]

AVAILABLE = importlib.util.find_spec("triton") is not None
# The scale rule of each (granularity, option), as the kernel's RULE constant.
RULES = {"amax_over_max": 0, "pow2_floor": 1, "pow2_ceil": 2}


def _rule(recipe: Recipe) -> int:
    if recipe.granularity == "blockwise":
        return RULES["pow2_ceil" if recipe.pow2_scales else "amax_over_max"]
    if recipe.granularity == "mxfp8":
        return RULES["pow2_floor" if recipe.mx_rounding == "floor" else "pow2_ceil"]
    raise ValueError(
        f"triton_block_quantize takes the blockwise and mxfp8 recipes, got granularity {recipe.granularity!r}"
    )


if AVAILABLE:
    import triton  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,import-untyped,unused-ignore]

    @triton.jit
    def _pow2(e):
        """``2**e`` as float32 for an int32 ``e`` in [-127, 127], from its bits."""
        bits = tl.where(e >= -126, (e + 127) << 23, 1 << 22)  # 2**-127 is subnormal
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _scale(amax, RULE: tl.constexpr):
        """The block scale ``d`` of `fp8lm.ops.block_scales` (E4M3: max 448 = 0.875 * 2**9)."""
        if RULE == 0:
            # float32 operands spelled out: Triton 3.8's interpreter takes Python floats as float64
            d = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            d = tl.maximum(d, tl.full(amax.shape, 1.401298464324817e-45, tl.float32))
        else:
            bits = amax.to(tl.int32, bitcast=True)
            biased = (bits >> 23) & 0xFF
            mant = bits & 0x7FFFFF
            # frexp: amax = m * 2**exp, m in [0.5, 1); a subnormal amax from its leading bit.
            lead = _leading_bit(mant)
            exp = tl.where(biased > 0, biased - 126, lead - 148)
            frac = tl.where(biased > 0, mant, (mant << (23 - lead)) & 0x7FFFFF)
            e = exp - 9
            if RULE == 2:
                e = e + (frac > 0x600000).to(tl.int32)  # mantissa above 0.875: round up
            d = _pow2(tl.minimum(tl.maximum(e, -127), 127))
        d = tl.where(amax == 0.0, 1.0, d)
        return tl.where((amax == amax) & (amax != float("inf")), d, float("nan")).to(tl.float32)

    @triton.jit
    def _leading_bit(v):
        """Index of the highest set bit of a positive int32 below 2**23 (0 for 0)."""
        n = tl.zeros_like(v)
        for shift in tl.static_range(4, -1, -1):
            step = 1 << shift
            big = (v >> (n + step)) > 0
            n = tl.where(big, n + step, n)
        return n

    @triton.jit
    def _e4m3_bits(v):
        """E4M3 (``float8_e4m3fn``) bits of float32 ``v`` with ``|v| <= 448`` or NaN, rounded to
        nearest even."""
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = tl.abs(v)
        # subnormals (below 2**-6): the nearest multiple of 2**-9, ties to even (8 is 2**-6)
        t = a * 512.0
        n = tl.floor(t)
        r = t - n
        ni = n.to(tl.int32)
        sub = ni + ((r > 0.5) | ((r == 0.5) & ((ni & 1) == 1))).to(tl.int32)
        # normals: 3 mantissa bits kept, the rest rounded to nearest even; a carry moves the exponent
        abits = a.to(tl.int32, bitcast=True)
        low = abits & 0xFFFFF
        m3 = (abits >> 20) & 0x7
        up = (low > 0x80000) | ((low == 0x80000) & ((m3 & 1) == 1))
        normal = ((((abits >> 23) & 0xFF) - 120) << 3) + m3 + up.to(tl.int32)
        code = tl.where(a < 0.015625, sub, normal)
        code = tl.where(a == a, code, 0x7F)
        return (sign | code).to(tl.uint8)

    @triton.jit
    def _block_quantize_kernel(x_ptr, q_ptr, d_ptr, rows, cols, grid_cols, BLOCK: tl.constexpr, RULE: tl.constexpr):
        row = tl.program_id(0)
        tile = tl.program_id(1)
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        inside = offs < cols
        x = tl.load(x_ptr + row * cols + offs, mask=inside, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        amax = tl.where(tl.sum((x != x).to(tl.int32), axis=0) > 0, float("nan"), amax)
        d = _scale(amax, RULE)
        q = tl.math.div_rn(x, d)  # rounded as torch divides
        v = tl.where(q == q, tl.minimum(tl.maximum(q, -448.0), 448.0), q)  # the clamp keeps NaN
        tl.store(q_ptr + row * cols + offs, _e4m3_bits(v), mask=inside)
        tl.store(d_ptr + row * grid_cols + tile, d)

    @torch.library.triton_op("fp8lm::triton_block_quantize", mutates_args=())
    def _block_quantize_op(x: torch.Tensor, block: int, rule: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        grid_cols = -(-cols // block)
        q = torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
        d = torch.empty((rows, grid_cols), dtype=torch.float32, device=x.device)
        if rows and cols:
            kernel = torch.library.wrap_triton(_block_quantize_kernel)
            kernel[(rows, grid_cols)](x, q, d, rows, cols, grid_cols, BLOCK=block, RULE=rule)
        return q.view(torch.float8_e4m3fn), d


def triton_block_quantize(x: torch.Tensor, recipe: Recipe | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, d)`` of ``x`` (2-D, float32 or BF16) in the recipe's 1 x ``block`` tiles along
    its rows, as `fp8lm.ops.finegrained.quantize_operand(x, recipe, "input")` gives them (module
    doc). The recipe is blockwise or mxfp8 with E4M3 inputs; needs ``triton``."""
    from ..recipe import recipe_from

    recipe = recipe_from(recipe, "triton_block_quantize")
    rule = _rule(recipe)
    if recipe.input_format.dtype != torch.float8_e4m3fn:
        raise ValueError("triton_block_quantize writes E4M3 elements: keep the recipe's input_format E4M3")
    if not AVAILABLE:
        raise RuntimeError("triton_block_quantize needs Triton: pip install 'fp8lm[triton]'")
    if x.dim() != 2:
        raise ValueError(f"triton_block_quantize takes a 2-D tensor, got shape {tuple(x.shape)}")
    assert recipe.block is not None  # blockwise and mxfp8 have one
    if recipe.block & (recipe.block - 1):
        raise ValueError(f"triton_block_quantize takes a power-of-two block, got {recipe.block}")
    return torch.ops.fp8lm.triton_block_quantize(x.detach().contiguous(), recipe.block, rule)
