"""FP8 GEMM backends and FP8Linear vs BF16 nn.Linear: milliseconds, printed as JSON.

Per shape (M, K, N) of ``A[M,K] @ B[K,N]``: `fp8lm.ops.gemm.fp8_mm` with each backend and output
dtype (the operands' upcast included, as FP8Linear pays it), plain BF16 matmul, and a full
forward + backward of `fp8lm.nn.FP8Linear` (K -> N, M tokens) against ``nn.Linear`` under BF16
autocast. This is the measurement behind the ``"auto"`` backend choice.

    python benchmarks/fp8_linear.py [--device cpu] [--shapes 4096x384x1536,...] [--reps 5]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import keep_freed_memory, machine, median_time
from gemm import parse_shapes
from torch import nn

from fp8lm.nn import FP8Linear
from fp8lm.ops.gemm import FP8Operand, choose_backend, fp8_mm, scaled_mm_supported

CPU_SHAPES = [(4096, 384, 1536), (4096, 1536, 384), (4096, 384, 384), (2048, 768, 3072)]
GPU_SHAPES = [(8192, 4096, 4096), (8192, 4096, 16384)]


def gemm_ms(m: int, k: int, n: int, device: str, reps: int) -> dict:
    a8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    ab, bb = a8.bfloat16(), b8.bfloat16()
    out = {"bf16_matmul": median_time(lambda: ab @ bb.t(), reps) * 1e3}
    backends = ["emulated"] + (["scaled_mm"] if scaled_mm_supported(device) else [])
    for backend in backends:
        for dtype in (torch.float32, torch.bfloat16):
            # fresh operands each call: the upcast is part of the cost
            run = lambda dtype=dtype, backend=backend: fp8_mm(  # noqa: E731
                FP8Operand(a8, one, True), FP8Operand(b8, one, True).t(), dtype, backend=backend
            )
            out[f"{backend}_{str(dtype)[6:]}"] = median_time(run, reps) * 1e3
    return out


def linear_ms(m: int, k: int, n: int, device: str, reps: int) -> dict:
    ref = nn.Linear(k, n, device=device)
    fp8 = FP8Linear.from_linear(ref)
    x = torch.randn(m, k, device=device, requires_grad=True)

    def step(layer):
        if isinstance(layer, FP8Linear):  # as after an optimizer step: the weight's FP8 copy made anew
            layer._weight_operand.clear()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(torch.ones_like(y))
        layer.zero_grad(set_to_none=True)  # a training step: no accumulation into old gradients
        x.grad = None

    out = {
        "bf16_linear": median_time(lambda: step(ref), reps) * 1e3,
        "fp8_linear": median_time(lambda: step(fp8), reps) * 1e3,
    }
    out["fp8_over_bf16"] = out["fp8_linear"] / out["bf16_linear"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", type=parse_shapes, default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--fresh-pages", action="store_true", help="let malloc return freed memory to the OS")
    args = parser.parse_args()
    heap_reuse = False if args.fresh_pages else keep_freed_memory()
    shapes = args.shapes or (GPU_SHAPES if args.device.startswith("cuda") else CPU_SHAPES)
    results = [
        {
            "m": m,
            "k": k,
            "n": n,
            "gemm_ms": gemm_ms(m, k, n, args.device, args.reps),
            "fwd_bwd_ms": linear_ms(m, k, n, args.device, args.reps),
        }
        for m, k, n in shapes
    ]
    print(
        json.dumps(
            {
                "benchmark": "fp8_linear",
                "machine": machine(),
                "device": args.device,
                "auto_backend": choose_backend(args.device),
                "heap_reuse": heap_reuse,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
