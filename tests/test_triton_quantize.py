"""The Triton kernel of the blockwise and mxfp8 quantization (`fp8lm.ops.triton_quantize`), run on
CPU tensors by Triton's interpreter: bit for bit the payload and scales of `quantize_operand`,
over ties, zeros, subnormals, saturation, NaN and inf, and rows that end in a partial block.
Skipped where Triton is not installed (``pip install 'fp8lm[triton]'``)."""

import os

import pytest
import torch

# On a GPU the kernel runs there; elsewhere Triton's interpreter runs it on CPU tensors (set
# before Triton compiles anything; not on a GPU, where it would slow every Triton kernel down).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import fp8lm  # noqa: E402
from fp8lm.ops.finegrained import quantize_operand  # noqa: E402
from fp8lm.ops.triton_quantize import triton_block_quantize  # noqa: E402

RECIPES = {
    "blockwise": fp8lm.Recipe.from_name("blockwise"),
    "blockwise-pow2": fp8lm.Recipe.from_name("blockwise").replace(pow2_scales=True),
    "mxfp8": fp8lm.Recipe.from_name("mxfp8"),
    "mxfp8-rceil": fp8lm.Recipe.from_name("mxfp8").replace(mx_rounding="rceil"),
    "blockwise-32": fp8lm.Recipe.from_name("blockwise").replace(block=32),
}


def _hard_rows() -> torch.Tensor:
    """Rows of 200 values (a partial last block): normal values over many binades, ties of E4M3
    under a power-of-two scale, zeros, float32 subnormals, saturation, NaN and inf."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 200, generator=g) * torch.logspace(-30, 30, 12, base=2.0)[:, None]
    x[1, :64] = 0.0  # whole zero blocks
    x[2] = torch.tensor([1.0625, 1.1875, -1.3125, 448.0, 464.0, 2.0**-9 * 1.5, 2.0**-10] * 28 + [0.0] * 4)  # ties
    x[3] = torch.randn(200, generator=g) * 2.0**-140  # float32 subnormals: subnormal amaxes
    x[4, 5] = float("nan")
    x[5, 150] = float("inf")
    x[6, 33] = -float("inf")
    x[7] = torch.full((200,), 448.0 * 1.75)  # saturating under a floor scale
    return x


@pytest.mark.parametrize("name", RECIPES)
def test_triton_kernel_gives_the_emulations_bits(name):
    recipe = RECIPES[name]
    for x in (_hard_rows(), torch.randn(5, 64), torch.randn(3, 1), _hard_rows().to(torch.bfloat16)):
        payload, d = (t.cpu() for t in triton_block_quantize(x.to(DEVICE), recipe))
        ref = quantize_operand(x, recipe, "input")
        assert payload.dtype == torch.float8_e4m3fn and d.shape == ref.d.shape
        assert torch.equal(d.isnan(), ref.d.isnan())
        assert torch.equal(d.nan_to_num(), ref.d.nan_to_num())
        assert torch.equal(payload.view(torch.uint8), ref.payload.view(torch.uint8)), name


def test_it_is_a_torch_library_op_and_refuses_what_it_does_not_do():
    payload, d = torch.ops.fp8lm.triton_block_quantize(torch.ones(2, 64, device=DEVICE), 32, 1)
    assert payload.shape == (2, 64) and d.shape == (2, 2)
    with pytest.raises(ValueError, match="blockwise and mxfp8"):
        triton_block_quantize(torch.ones(2, 64), "rowwise")
    with pytest.raises(ValueError, match="2-D"):
        triton_block_quantize(torch.ones(64), "mxfp8")
