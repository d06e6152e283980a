"""FP8 vs BF16 (and FP32) GEMM throughput in TFLOP/s, printed as JSON.

FP8 runs `torch._scaled_mm` with E4M3 operands and per-tensor scales, output in BF16; BF16 and
FP32 run `torch.matmul`; nvfp4 runs fp8lm's GEMM of two operands quantized in the ``nvfp4``
recipe, as a layer runs it (`fp8lm.ops.finegrained.block_mm`: the operands packed and their scales
laid out, then cuBLAS's FP4 GEMM on compute capability 10.0+, the Triton kernel on 8.9 / 9.0
with Triton, else the emulation; ``nvfp4_path`` says which) and checks it against the emulation
(``nvfp4_max_rel_err``, relative to the largest output). Shapes are (M, K, N) of
``A[M,K] @ B[K,N]``; the defaults are the GEMMs of a GPT block (tokens x width x 4*width), sized
for the device.

    python benchmarks/gemm.py [--device cuda] [--shapes 8192x4096x16384,...]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import machine, median_time

CPU_SHAPES = [(4096, 384, 1536), (4096, 768, 3072), (2048, 1024, 4096)]
GPU_SHAPES = [(8192, 2048, 8192), (8192, 4096, 16384), (16384, 8192, 8192)]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    try:
        return [tuple(int(d) for d in s.split("x")) for s in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise SystemExit(f"--shapes: expected MxKxN[,MxKxN...], got {text!r}") from None


def gemm_tflops(m: int, k: int, n: int, device: str, reps: int) -> dict:
    a = torch.randn(m, k, device=device)
    b = torch.randn(n, k, device=device)  # B is used transposed: column-major, as _scaled_mm wants
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    ab, bb = a.bfloat16(), b.bfloat16()
    flops = 2 * m * k * n
    runs = {
        "fp8": lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16),
        "bf16": lambda: ab @ bb.t(),
        "fp32": lambda: a @ b.t(),
    }
    out = {}
    for name, fn in runs.items():
        try:
            out[name] = flops / median_time(fn, reps) / 1e12
        except RuntimeError as err:  # e.g. _scaled_mm on a GPU older than compute capability 8.9
            out[name] = None
            out[f"{name}_error"] = str(err).splitlines()[0]
    if out.get("fp8") and out.get("bf16"):
        out["fp8_over_bf16"] = out["fp8"] / out["bf16"]
    out.update(nvfp4_gemm(a, b, reps))
    if out.get("nvfp4") and out.get("bf16"):
        out["nvfp4_over_bf16"] = out["nvfp4"] / out["bf16"]
    return out


def nvfp4_gemm(a: torch.Tensor, b: torch.Tensor, reps: int) -> dict:
    """TFLOP/s of fp8lm's nvfp4 GEMM of ``a @ b.t()`` (module doc), which path ran, and its
    largest error against the emulation relative to the largest output."""
    from fp8lm import Recipe
    from fp8lm.ops import finegrained as fg

    recipe = Recipe.from_name("nvfp4")
    x, w = fg.quantize_operand(a, recipe, "input"), fg.quantize_operand(b, recipe, "weight").t()
    bf16 = torch.bfloat16
    path = (
        "cuBLAS FP4"
        if fg.takes_nvfp4_scaled_mm(x, w, bf16)
        else "Triton"
        if fg.takes_triton_nvfp4_mm(x, w, bf16)
        else "emulated"
    )
    try:
        got = fg.block_mm(x, w, bf16, backend="scaled_mm").float()
        exact = fg.block_mm(x, w, bf16, backend="emulated").float()
        seconds = median_time(lambda: fg.block_mm(x, w, bf16, backend="scaled_mm"), reps)
    except RuntimeError as err:
        return {"nvfp4": None, "nvfp4_path": path, "nvfp4_error": str(err).splitlines()[0]}
    err = float((got - exact).abs().max() / exact.abs().max())
    return {
        "nvfp4": 2 * a.shape[0] * a.shape[1] * b.shape[0] / seconds / 1e12,
        "nvfp4_path": path,
        "nvfp4_max_rel_err": err,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", type=parse_shapes, default=None)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    shapes = args.shapes or (GPU_SHAPES if args.device.startswith("cuda") else CPU_SHAPES)
    results = [{"m": m, "k": k, "n": n, "tflops": gemm_tflops(m, k, n, args.device, args.reps)} for m, k, n in shapes]
    print(json.dumps({"benchmark": "gemm", "machine": machine(), "device": args.device, "results": results}, indent=2))


if __name__ == "__main__":
    main()
