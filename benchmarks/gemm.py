"""FP8 vs BF16 (and FP32) GEMM throughput in TFLOP/s, printed as JSON.

FP8 runs `torch._scaled_mm` with E4M3 operands and per-tensor scales, output in BF16; BF16 and
FP32 run `torch.matmul`. Shapes are (M, K, N) of ``A[M,K] @ B[K,N]``; the defaults are the
GEMMs of a GPT block (tokens x width x 4*width), sized for the device.

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
    return out


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
