"""Fine-grained quantization compiled on the device against the eager ops, as JSON: on the CPU,
inductor's C++ code (torch 2.13) computed wrong values for the quantization and dequantization of
shapes the blocks do not divide when compiled for static shapes (docs/recipes.md, "Where it
runs"); this asks the same of the device's code.

Per recipe and shape (some that the blocks divide, some that they do not):
- ``fused``: each operand quantized by the compiled function off the CPU
  (`fp8lm.ops.finegrained.FUSED_QUANTIZE`, compiled with dynamic shapes) against the eager ops
  (``FP8LM_FUSED_CAST=0``'s path): whether the payloads, scales and dequantized values are equal
  bit for bit (nvfp4's stochastic output gradient left out: the compiled function draws its own
  noise);
- ``layer``: an FP8Linear of that input width compiled whole with inductor (static shapes) against
  the same layer eager, one forward and backward: the largest difference relative to the largest
  value of the output and both gradients (0 where both run the same code; nvfp4's gradients
  differ where the compiled code draws its own noise for the output gradient's stochastic
  rounding: 0.16 and 0.18 measured on the CPU, traced; the CPU's wrong reads gave 1e17 to 4e33,
  inf or NaN under blockwise and mxfp8, under nvfp4 0.02 to 6e5 or NaN, changing from run to run:
  ``--cpu-traced`` on the CPU).

    python benchmarks/compiled_quantize_check.py [--device cuda] [--recipes rowwise,blockwise,mxfp8,nvfp4]
    python benchmarks/compiled_quantize_check.py --device cpu --cpu-traced  # the CPU fault, shown
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from common import machine

from fp8lm import Recipe
from fp8lm.nn import FP8Linear
from fp8lm.ops import finegrained

SHAPES = ((256, 256), (300, 200), (37, 150))  # (rows, in_features): 128 x 128 blocks divide the first only
OPERANDS = (("input", 1), ("weight", 1), ("input", 0), ("grad_output", 1))


def _quantized(x: torch.Tensor, recipe: Recipe, role: str, dim: int, fused: bool):
    finegrained.COMPILED_CASTS.on = fused
    try:
        op = finegrained.quantize_operand(x, recipe, role, dim)
        return op, op.dequantize()
    finally:
        finegrained.COMPILED_CASTS.on = True


def fused_against_eager(recipe: Recipe, shape: tuple[int, int], device: str) -> dict:
    x = torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(0))
    equal = {}
    for role, dim in OPERANDS:
        if recipe.granularity == "nvfp4" and role == "grad_output":
            continue  # stochastic: the two paths draw different noise
        (fused, fused_values), (eager, eager_values) = (_quantized(x, recipe, role, dim, f) for f in (True, False))
        equal[f"{role}_dim{dim}"] = bool(
            torch.equal(fused.payload.view(torch.uint8), eager.payload.view(torch.uint8))
            and torch.equal(fused.d, eager.d)
            and torch.equal(fused_values, eager_values)
        )
    return equal


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def layer_compiled_against_eager(recipe: Recipe, shape: tuple[int, int], device: str) -> dict:
    rows, width = shape
    torch.manual_seed(0)
    layer = FP8Linear(width, 64, recipe=recipe).to(device)
    x = torch.randn(rows, width, device=device, requires_grad=True)

    def step(module):
        torch.manual_seed(1)
        y = module(x)
        y.square().sum().backward()
        grads = x.grad.clone(), layer.weight.grad.clone()
        x.grad = layer.weight.grad = None
        return y.detach(), *grads

    torch._dynamo.reset()
    eager = step(layer)
    try:
        compiled = step(torch.compile(layer, fullgraph=True, backend="inductor"))
    except Exception as err:  # reported, not hidden: the other shapes still run
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}
    return {name: _relative(c, e) for name, c, e in zip(("out", "grad_x", "grad_w"), compiled, eager)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--recipes", default="rowwise,blockwise,mxfp8,nvfp4")
    parser.add_argument(
        "--cpu-traced",
        action="store_true",
        help="on the CPU, trace the quantization as on CUDA (CPU_QUANTIZE_OP = False): shows the CPU fault",
    )
    args = parser.parse_args()
    finegrained.CPU_QUANTIZE_OP = not args.cpu_traced
    rows = []
    for name in args.recipes.split(","):
        recipe = Recipe.from_name(name)
        for shape in SHAPES:
            rows.append(
                {
                    "recipe": name,
                    "shape": list(shape),
                    "fused": fused_against_eager(recipe, shape, args.device),
                    "layer": layer_compiled_against_eager(recipe, shape, args.device),
                }
            )
            print(json.dumps(rows[-1]), flush=True, file=sys.stderr)
    print(
        json.dumps(
            {
                "benchmark": "compiled_quantize_check",
                "machine": machine(),
                "device": args.device,
                "cpu_traced": args.cpu_traced,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
