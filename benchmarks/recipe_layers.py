"""Each recipe's FP8Linear on the device, as JSON: one training step of a (tokens x width ->
width) layer, forward and backward under BF16 autocast, timed against BF16 ``nn.Linear``, and
checked against the same layer with the exact emulation (``backend="emulated"``) on the same
device and the same weights.

On a GPU this is where the fast paths meet real kernels: the compiled quantization
(`fp8lm.ops.finegrained.FUSED_QUANTIZE`), `torch._scaled_mm` with row-wise, block or MX scales,
cuBLAS's FP4 GEMM or the Triton one, and nvfp4's operands quantized straight into their layout.
Per recipe: ``step_ms`` and ``over_bf16`` (the median step against BF16's, the weight quantized
anew in each, as after an optimizer step), ``next_microbatch_ms`` (a step that reuses the weight
operands the layer kept: a further micro-batch of gradient accumulation), ``path`` (the forward
GEMM's: ``"scaled_mm"`` (tensorwise), ``"scaled_mm:rowwise"``, ``"scaled_mm:block"``,
``"scaled_mm:mx"``, ``"fp4:cublas"``, ``"fp4:triton"`` or ``"emulated"``), and the largest
difference from the emulated layer relative to the largest value, for the output and both
gradients (``max_rel_err``; the GEMMs accumulate in another order, and a rounding that moves
changes nvfp4's output-gradient scales, so expect up to a few 1e-2 there and 1e-3 elsewhere; a
wrong layout or scale gives O(1)). The stochastic rounding of nvfp4 draws the same noise in both
layers (the seed is reset, and both quantize through the same functions).

    python benchmarks/recipe_layers.py [--device cuda] [--tokens 8192] [--width 4096]
    python benchmarks/recipe_layers.py --device cpu --tokens 256 --width 128 --backend scaled_mm  # smoke
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from common import machine, median_time
from torch import nn

from fp8lm import Recipe
from fp8lm.nn import FP8Linear
from fp8lm.nn import finegrained as layer_gemms
from fp8lm.ops.gemm import choose_backend

RECIPES = ("tensorwise-delayed", "rowwise", "blockwise", "mxfp8", "nvfp4")


def step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and weight gradient (as float32 values) of one step."""
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = layer(x)
    y.backward(grad)
    weight_grad = layer.weight.grad
    values = weight_grad.dequantize() if hasattr(weight_grad, "dequantize") else weight_grad
    return y.detach().float(), x.grad.float(), values.float()


def path(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which GEMM the layer's forward runs (module doc), asked as `block_mm` asks."""
    from fp8lm.ops import finegrained as fg

    bf16 = torch.bfloat16
    if choose_backend(x.device, recipe.backend) != "scaled_mm":
        return "emulated"
    if not recipe.fine_grained:
        return "scaled_mm"
    x2 = x.reshape(-1, x.shape[-1])
    if recipe.granularity == "nvfp4":
        kernel = layer_gemms._fp4_kernel(x2, weight.shape, recipe, "scaled_mm", bf16)
        if kernel:
            return f"fp4:{kernel}"
    a, b = fg.quantize_operand(x2, recipe, "input"), fg.quantize_operand(weight, recipe, "weight").t()
    takes = {
        "scaled_mm:rowwise": fg.takes_rowwise_scaled_mm,
        "scaled_mm:block": fg.takes_block_scaled_mm,
        "scaled_mm:mx": lambda a, b, out: recipe.granularity == "mxfp8" and fg.takes_mx_scaled_mm(a, b, out),
        "fp4:cublas": fg.takes_nvfp4_scaled_mm,
        "fp4:triton": fg.takes_triton_nvfp4_mm,
    }
    return next((name for name, fits in takes.items() if fits(a, b, bf16)), "emulated")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def measure(name: str, x: torch.Tensor, grad: torch.Tensor, width: int, reps: int, backend: str) -> dict:
    recipe = Recipe.from_name(name).replace(backend=backend)
    torch.manual_seed(0)
    layer = FP8Linear(width, width, recipe=recipe).to(x.device)
    exact = copy.deepcopy(layer)
    exact.recipe = recipe.replace(backend="emulated")
    got, want = step(layer, x, grad), step(exact, x, grad)
    errors = {part: relative_error(g, w) for part, g, w in zip(("output", "input_grad", "weight_grad"), got, want)}

    def after_an_optimizer_step():
        layer._weight_operand.clear()  # what a change of the weight does: its operands are made anew
        return step(layer, x, grad)

    seconds = median_time(after_an_optimizer_step, reps)
    next_microbatch = median_time(lambda: step(layer, x, grad), reps)
    weight = layer.weight.dequantize() if hasattr(layer.weight, "dequantize") else layer.weight.detach()
    return {
        "path": path(recipe, x, weight.float()),
        "step_ms": seconds * 1e3,
        "next_microbatch_ms": next_microbatch * 1e3,
        "max_rel_err": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "scaled_mm"),
        help="the fast layer's GEMM backend (scaled_mm: also torch's CPU kernel for rowwise)",
    )
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.width, generator=gen).to(args.device, torch.bfloat16)
    grad = (torch.randn(args.tokens, args.width, generator=gen) * 1e-3).to(args.device, torch.bfloat16)
    torch.manual_seed(0)
    bf16 = nn.Linear(args.width, args.width).to(args.device)
    bf16_ms = median_time(lambda: step(bf16, x, grad), args.reps) * 1e3
    results = {}
    for name in args.recipes.split(","):
        try:
            results[name] = measure(name, x, grad, args.width, args.reps, args.backend)
            results[name]["over_bf16"] = results[name]["step_ms"] / bf16_ms
        except Exception as err:  # one recipe that fails on this device is reported, the others still run
            results[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    print(
        json.dumps(
            {
                "benchmark": "recipe_layers",
                "machine": machine(),
                "device": args.device,
                "tokens": args.tokens,
                "width": args.width,
                "bf16_step_ms": bf16_ms,
                "recipes": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
