"""The Triton GEMM of nvfp4 operands (`fp8lm.ops.triton_nvfp4`, for GPUs without FP4 tensor
cores), run on CPU tensors by Triton's interpreter: the emulation's product for the three GEMMs
of a layer, partial tiles, a bias, BF16 and FP32 results, NaN; and a layer trained through it.
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
from fp8lm.ops import finegrained  # noqa: E402
from fp8lm.ops.finegrained import block_mm, nvfp4_scales_fit, quantize_operand  # noqa: E402
from fp8lm.ops.triton_nvfp4 import triton_nvfp4_mm  # noqa: E402

NVFP4 = fp8lm.Recipe.from_name("nvfp4")


def layer_gemms(m: int, k: int, n: int, recipe, seed: int = 0) -> dict:
    """The forward, input-gradient and weight-gradient operand pairs of a (k -> n) layer on m tokens."""
    gen = torch.Generator().manual_seed(seed)
    x, w, g = (torch.randn(*shape, generator=gen).to(DEVICE) for shape in ((m, k), (n, k), (m, n)))
    x[3] *= 1e3  # an outlier row
    w_op = quantize_operand(w, recipe, "weight")
    return {
        "forward": (quantize_operand(x, recipe, "input"), w_op.t()),
        "input_grad": (quantize_operand(g, recipe, "grad_output"), w_op),
        "weight_grad": (
            quantize_operand(g, recipe, "grad_output", dim=0).t(),
            quantize_operand(x, recipe, "input", dim=0),
        ),
    }


@pytest.mark.parametrize("scale_rule", ["max6", "4over6"])
@pytest.mark.parametrize("m, k, n", [(96, 128, 96), (160, 32, 64)])  # partial 64 x 64 tiles; K of one 32-step
def test_the_kernel_computes_the_emulations_product(scale_rule, m, k, n):
    recipe = NVFP4.replace(nvfp4_scale_rule=scale_rule)
    bias = torch.randn(max(m, k, n), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for name, (a, b) in layer_gemms(m, k, n, recipe).items():
        assert nvfp4_scales_fit(a, b, torch.bfloat16), name
        cols = b.payload.shape[1]
        for out_dtype, add in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, bias[:cols])):
            got = triton_nvfp4_mm(a, b, out_dtype, add)
            exact = block_mm(a, b, out_dtype, add)
            assert got.dtype == out_dtype and got.shape == exact.shape
            rtol = 2**-7 if out_dtype == torch.bfloat16 else 1e-5  # one BF16 ulp; FP32 sums in another order
            torch.testing.assert_close(got, exact, rtol=rtol, atol=1e-5 * float(exact.abs().max()))


def test_nan_in_an_operand_reaches_the_output_and_bad_operands_are_refused():
    a, b = layer_gemms(64, 64, 64, NVFP4)["forward"]
    x = torch.randn(64, 64)
    x[5, 7] = float("nan")
    nan_a = quantize_operand(x.to(DEVICE), NVFP4, "input")
    assert bool(triton_nvfp4_mm(nan_a, b, torch.float32).isnan().all())  # its tensor scale is NaN
    odd_a, odd_b = layer_gemms(64, 48, 64, NVFP4)["forward"]  # K = 48: not a multiple of 32
    with pytest.raises(ValueError, match="multiple of 32"):
        triton_nvfp4_mm(odd_a, odd_b, torch.bfloat16)


def test_a_layer_runs_its_three_gemms_through_the_kernel(monkeypatch):
    """`block_mm` routes nvfp4's GEMMs to the kernel where `takes_triton_nvfp4_mm` says so (on CPU
    here): an FP8Linear's forward, input-gradient and weight-gradient GEMMs (the operands saved
    for the backward keep their tensor scales), each the emulation's product of its operands.
    (Whole-layer outputs are not compared: a one-ulp change in the forward moves nvfp4's output
    gradient scales, and its coarse rounding then moves whole elements.)"""
    from fp8lm.ops import triton_nvfp4

    products = []

    def checked(a, b, out_dtype, bias=None):
        got = triton_nvfp4_mm(a, b, out_dtype, bias)
        products.append((got, block_mm(a, b, out_dtype, bias, backend="emulated")))
        return got

    monkeypatch.setattr(finegrained, "takes_triton_nvfp4_mm", nvfp4_scales_fit)
    monkeypatch.setattr(triton_nvfp4, "triton_nvfp4_mm", checked)
    torch.manual_seed(0)
    layer = fp8lm.nn.FP8Linear(64, 32, recipe=NVFP4.replace(backend="scaled_mm")).to(DEVICE)
    x = torch.randn(2, 32, 64, device=DEVICE, requires_grad=True)  # 64 tokens: the weight gradient's K
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).sum().backward()
    assert len(products) == 3  # forward, input gradient, weight gradient
    for got, exact in products:
        torch.testing.assert_close(got, exact, rtol=2**-7, atol=1e-5 * float(exact.abs().max()))
    assert x.grad is not None and bool(x.grad.isfinite().all()) and layer.weight.grad is not None
