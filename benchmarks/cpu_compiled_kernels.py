"""Kernels of one linear layer's training step under ``torch.compile`` on this CPU, printed as JSON.

The CPU counterpart of `cuda_trace.py`'s launch counts: a model of one linear layer (``nn.Linear``
under BF16 autocast, and fp8lm O1's FP8Linear) is compiled whole with Inductor
(``fullgraph=True``), and the kernels its generated code calls are listed for the forward and the
backward graph: Inductor's fused C++ kernels (``cpp_fused_*``), extern GEMMs and fp8lm's custom ops
(``torch.ops.fp8lm.*``: the C kernels of the casts and amaxes). On a CPU the FP8 GEMM is emulated,
so the backward also upcasts its two saved FP8 operands (two ops a GPU does not run).

    python benchmarks/cpu_compiled_kernels.py [--features 512] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from common import machine
from torch import nn
from torch._inductor.utils import run_and_get_code

import fp8lm
from fp8lm.policy import preset

# A kernel call in Inductor's generated wrapper: its fused kernels, extern GEMMs and custom ops.
_CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.M)


def layer(variant: str, features: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(features, features))
    if variant == "fp8lm":
        model = fp8lm.initialize(model, opt_level="O1", policy=preset("O1", output_head=False))[0]
    return model


def compiled_kernels(variant: str, features: int, tokens: int) -> dict:
    """The kernels of the compiled forward and backward graphs (after two eager steps, so that
    delayed scaling has a history)."""
    torch.manual_seed(0)
    model = layer(variant, features)
    x = torch.randn(tokens, features, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)

    def step(forward) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = forward(x)
        y.float().sum().backward()

    for _ in range(2):
        step(model)
    _, codes = run_and_get_code(lambda: step(compiled))
    if len(codes) != 2:
        raise RuntimeError(f"expected a forward and a backward graph, got {len(codes)}")
    forward, backward = (_CALL.findall(code) for code in codes)
    return {"launches": len(forward) + len(backward), "forward": forward, "backward": backward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    result = {
        "benchmark": "cpu_compiled_kernels",
        "machine": machine(),
        "features": args.features,
        "tokens": args.tokens,
        "variants": {v: compiled_kernels(v, args.features, args.tokens) for v in ("bf16", "fp8lm")},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
