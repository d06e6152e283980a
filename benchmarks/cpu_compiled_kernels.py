"""Kernels of one linear layer's training step under ``torch.compile`` on this CPU, printed as JSON.

The CPU counterpart of `cuda_trace.py`'s launch counts: a model of one linear layer (``nn.Linear``
under BF16 autocast, and fp8lm O1's FP8Linear) is compiled whole with Inductor
(``fullgraph=True``), and the kernels its generated code calls are listed for the forward and the
backward graph: Inductor's fused C++ kernels (``cpp_fused_*``), extern GEMMs and fp8lm's custom ops
(``torch.ops.fp8lm.*``: the C kernels of the casts and amaxes). On a CPU the FP8 GEMM is emulated,
so the backward also upcasts its two saved FP8 operands (two ops a GPU does not run).

``fp8lm-traced-casts`` is fp8lm O1 without its C kernels (``FP8LM_NATIVE=0``, in a child process):
the graph then holds the plain cast expressions that a CUDA graph holds, and Inductor fuses them
as it schedules them for this CPU (its CUDA backend, Triton, may split a reduction from the
pointwise work that reads its result, where the C++ backend here fuses them).

    python benchmarks/cpu_compiled_kernels.py [--features 512] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

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
        model.zero_grad(set_to_none=True)  # as training does: no accumulation into the last step's
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


def traced_casts_kernels(features: int, tokens: int) -> dict:
    """`compiled_kernels` of fp8lm in a child process without the C kernels."""
    argv = [sys.executable, __file__, "--features", str(features), "--tokens", str(tokens), "--only", "fp8lm"]
    child = subprocess.run(argv, env={**os.environ, "FP8LM_NATIVE": "0"}, capture_output=True, text=True, check=True)
    return json.loads(child.stdout)["variants"]["fp8lm"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--only", choices=("bf16", "fp8lm"), help="measure this variant only")
    args = parser.parse_args()
    variants = {v: compiled_kernels(v, args.features, args.tokens) for v in ("bf16", "fp8lm") if args.only in (None, v)}
    if args.only is None:
        variants["fp8lm-traced-casts"] = traced_casts_kernels(args.features, args.tokens)
    result = {
        "benchmark": "cpu_compiled_kernels",
        "machine": machine(),
        "features": args.features,
        "tokens": args.tokens,
        "variants": variants,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
