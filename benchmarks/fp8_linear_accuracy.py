"""Accuracy of FP8Linear against an FP32 nn.Linear, as SQNR in dB, printed as JSON.

1024 x 1024 layer, 4096 Gaussian tokens (the issue's must-show setting): output, input gradient
and stored (E4M3) weight gradient, without autocast and under BF16 / FP16 autocast; and the
weight gradient accumulated over 4 micro-batches (delayed scaling carried across them).

    python benchmarks/fp8_linear_accuracy.py [--device cpu]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import machine
from torch import nn

from fp8lm.nn import FP8Linear


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


def one_pass(ref: nn.Linear, layer: FP8Linear, x: torch.Tensor, g: torch.Tensor, autocast) -> dict:
    ref.zero_grad(set_to_none=True)
    xr, x8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        yr, y8 = ref(xr), layer(x8)
    yr.float().backward(g)
    y8.float().backward(g)
    return {
        "output": sqnr_db(yr, y8),
        "input_grad": sqnr_db(xr.grad, x8.grad),
        "weight_grad": sqnr_db(ref.weight.grad, layer.weight.grad.dequantize()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    ref = nn.Linear(1024, 1024, device=args.device)
    x = torch.randn(4096, 1024, device=args.device)
    g = torch.randn(4096, 1024, device=args.device)
    results = {}
    for name, autocast in (("fp32", None), ("bf16_autocast", torch.bfloat16), ("fp16_autocast", torch.float16)):
        results[name] = one_pass(ref, FP8Linear.from_linear(ref), x, g, autocast)

    ref.zero_grad(set_to_none=True)
    ref(x).backward(g)
    micro = FP8Linear.from_linear(ref)
    for xs, gs in zip(x.chunk(4), g.chunk(4)):
        micro(xs).backward(gs)
    results["weight_grad_4_microbatches"] = sqnr_db(ref.weight.grad, micro.weight.grad.dequantize())
    print(
        json.dumps(
            {"benchmark": "fp8_linear_accuracy", "machine": machine(), "device": args.device, "sqnr_db": results},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
