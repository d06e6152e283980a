"""nvfp4's forward and input-gradient GEMMs with a Hadamard transform along the forward's
reduction dimension (in_features), against nvfp4 as it is, as JSON: the output SQNR of each GEMM.

NVFP4's recipe (arXiv 2509.25149) applies its random Hadamard transform to the weight-gradient
GEMM only. This measures what the same transform would do for the other two GEMMs. With ``M`` the
block-diagonal transform of size ``n`` (orthogonal), ``Y = X W^T = (X M^T)(W M^T)^T``; the
quantized forward is ``Q(X M^T) Q(W M^T)^T``, and its input gradient, through the same quantized
weight, ``(Q(dY) Q(W M^T)) M``. ``n = 0`` is nvfp4 as it is (``Q(X) Q(W)^T`` and ``Q(dY) Q(W)``).
SQNR = 10 log10(sum y^2 / sum (y - y_q)^2) of each GEMM's output against the float32 product of
the unquantized operands.

Tensors: as `benchmarks/recipes.py` (a GPT trained ``--steps`` in BF16 autocast, then every linear
layer's input, weight and output gradient on one more batch; layers whose in_features ``n`` does
not divide are left out of that size's mean), and a synthetic 1024 x 1024 normal input whose
columns 0, 64, ..., 960 (16 features) are 100 times larger, with a normal weight: the outlier
*features* that large models grow, which fill a 1 x 16 block's scale and flush its other values.
``exact_rel_error``: the largest relative error of the transformed product without quantization
(float32 rounding only), a check of the transform pair.

    python benchmarks/nvfp4_forward_hadamard.py --results benchmarks/results/nvfp4_forward_hadamard_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from common import emit, machine
from recipes import capture, sqnr_db, train_bf16, training_arguments

import fp8lm
from fp8lm.ops.finegrained import quantize_operand
from fp8lm.ops.hadamard import hadamard_matrix

SIZES = (0, 16, 32, 64, 128)
SEED = 7


def q(x: torch.Tensor, recipe: fp8lm.Recipe, role: str) -> torch.Tensor:
    """``x`` as nvfp4's forward or input-gradient GEMM reads it (blocks along dim 1)."""
    return quantize_operand(x, recipe, role, 1, torch.Generator().manual_seed(0)).dequantize()


def along_features(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x`` (R, C) times the block-diagonal ``M^T`` (``M`` n x n, n dividing C)."""
    n = m.shape[0]
    return (x.reshape(x.shape[0], -1, n) @ m.t()).reshape(x.shape)


def back_along_features(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x`` (R, C) times the block-diagonal ``M``: the inverse of `along_features`."""
    n = m.shape[0]
    return (x.reshape(x.shape[0], -1, n) @ m).reshape(x.shape)


def gemm_outputs(x, w, g, recipe: fp8lm.Recipe, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each GEMM's exact output and its quantized one, with a size-``n`` transform (0: none)."""
    y, dx = x @ w.t(), g @ w
    if n == 0:
        wq = q(w, recipe, "weight")
        return {"fprop": (y, q(x, recipe, "input") @ wq.t()), "dgrad": (dx, q(g, recipe, "grad_output") @ wq)}
    m = hadamard_matrix(SEED, n)
    wq = q(along_features(w, m), recipe, "weight")
    yq = q(along_features(x, m), recipe, "input") @ wq.t()
    dxq = back_along_features(q(g, recipe, "grad_output") @ wq, m)
    return {"fprop": (y, yq), "dgrad": (dx, dxq)}


def exact_rel_error(x, w, g, n: int) -> float:
    """The transformed products without quantization against the plain ones (module doc)."""
    m = hadamard_matrix(SEED, n)
    y = along_features(x, m) @ along_features(w, m).t()
    dx = back_along_features(g @ along_features(w, m), m)
    return max(
        ((y - x @ w.t()).abs().max() / (x @ w.t()).abs().max()).item(),
        ((dx - g @ w).abs().max() / (g @ w).abs().max()).item(),
    )


def outlier_features() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024, generator=gen)
    x[:, ::64] *= 100.0
    return x, torch.randn(1024, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)


def main(argv=None) -> dict:
    parser = training_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, sampler = train_bf16(args)
    tensors = capture(model, sampler.next())
    recipes = {"nvfp4": fp8lm.Recipe.from_name("nvfp4")}
    recipes["nvfp4-4over6"] = recipes["nvfp4"].replace(nvfp4_scale_rule="4over6")
    outliers = outlier_features()
    layers: dict = {}
    synthetic: dict = {}
    for name, recipe in recipes.items():
        for n in SIZES:
            per_gemm: dict[str, list[float]] = {"fprop": [], "dgrad": []}
            for kept in tensors.values():
                x, w, g = kept["input"], kept["weight"], kept["grad_output"]
                if n and x.shape[1] % n:
                    continue
                for gemm, (ref, out) in gemm_outputs(x, w, g, recipe, n).items():
                    per_gemm[gemm].append(sqnr_db(ref, out))
            layers.setdefault(name, {})[str(n)] = {
                gemm: {"mean_db": round(statistics.fmean(v), 2), "worst_db": round(min(v), 2), "layers": len(v)}
                for gemm, v in per_gemm.items()
            }
            outs = gemm_outputs(*outliers, recipe, n)
            synthetic.setdefault(name, {})[str(n)] = {gemm: round(sqnr_db(*pair), 2) for gemm, pair in outs.items()}
    first = next(iter(tensors.values()))
    result = {
        "benchmark": "nvfp4_forward_hadamard",
        "command": "python benchmarks/nvfp4_forward_hadamard.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset,
        "bf16_steps": args.steps,
        "layers": len(tensors),
        "machine": machine(),
        "gemm_output_sqnr_db": layers,
        "outlier_features_sqnr_db": synthetic,
        "exact_rel_error": max(
            exact_rel_error(first["input"], first["weight"], first["grad_output"], n)
            for n in SIZES[1:]
            if first["input"].shape[1] % n == 0
        ),
    }
    emit(result, args.results)
    return result


if __name__ == "__main__":
    main()
