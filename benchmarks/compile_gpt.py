"""fp8lm GPT under ``torch.compile(model, fullgraph=True)``: graph breaks, recompiles and the loss
of every training step against the same model run eagerly, as JSON.

For each level (fp8lm O1 / O2 via `fp8lm.initialize`), two copies of one model (same seed) train on
the same batches: one compiled with ``fullgraph=True`` (a graph break is then an error, reported
as such), one eager. A step is forward (under BF16 autocast unless ``--no-autocast``, as ``fp8lm
train`` runs O1 and O2), backward, optimizer step. Reported per level:
``graph_breaks`` (dynamo's counter), ``graphs`` (graphs compiled over all steps; 1 is one compile),
``recompiles`` (graphs compiled after the first step), both losses of every step and their largest
difference in float32 ulps of the eager loss (0 or 1 is "equal within float32 rounding"), the
time of the first (compiling) step and the mean compiled and eager times of the others.
``--cpu-quantization op,traced`` measures each level twice: a fine-grained recipe's CPU
quantization as one op per operand (the default) and traced op by op (as on CUDA).

    python benchmarks/compile_gpt.py [--preset gpt2] [--levels O1,O2] [--steps 4] [--batch 2] [--seq 64] [--backend inductor]
        [--layers N] [--no-autocast] [--arch llama] [--n-kv-head N]
        [--activations fp8] [--activation-checkpointing none|selective|full] [--recipe NAME]
        [--cpu-quantization op,traced]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch
from common import machine
from torch._dynamo.utils import counters

import fp8lm
from fp8lm.ops import finegrained
from fp8lm.policy import ACTIVATIONS
from fp8lm.train.model import ARCHS, CHECKPOINTING, GPT, PRESETS, preset


def build(cfg, level: str, activations: str = "bf16", checkpointing: str = "none", recipe: str | None = None):
    torch.manual_seed(0)
    model = GPT(cfg)
    model.checkpoint_blocks(checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return fp8lm.initialize(model, opt, level, activations=activations, recipe=recipe)


def train_step(forward, opt, x, y, autocast: bool) -> tuple[float, float]:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, loss = forward(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), time.perf_counter() - start


def ulps(a: float, b: float) -> float:
    """``|a - b|`` in float32 spacings at ``b``."""
    spacing = math.ulp(b) * 2.0**29  # float64 ulp -> float32 ulp at the same magnitude (52 - 23 bits)
    return abs(a - b) / spacing


def measure_level(cfg, level: str, args) -> dict:
    torch._dynamo.reset()
    counters.clear()
    eager_model, eager_opt = build(cfg, level, args.activations, args.activation_checkpointing, args.recipe)
    model, opt = build(cfg, level, args.activations, args.activation_checkpointing, args.recipe)
    compiled = torch.compile(model, fullgraph=True, backend=args.backend)
    gen = torch.Generator().manual_seed(1)
    losses, times, graphs_after_first = [], [], None
    try:
        for step in range(args.steps):
            x, y = (torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen) for _ in range(2))
            compiled_loss, compiled_s = train_step(compiled, opt, x, y, args.autocast)
            eager_loss, eager_s = train_step(eager_model, eager_opt, x, y, args.autocast)
            losses.append((compiled_loss, eager_loss))
            times.append((compiled_s, eager_s))
            if step == 0:
                graphs_after_first = counters["stats"]["unique_graphs"]
    except Exception as err:  # fullgraph=True turns a graph break into an error: report it
        return {"level": level, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    graphs = counters["stats"]["unique_graphs"]
    later = times[1:] or times
    return {
        "level": level,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": graphs,
        "recompiles": graphs - graphs_after_first,
        "loss_compiled": [c for c, _ in losses],
        "loss_eager": [e for _, e in losses],
        "max_diff_ulps": max(ulps(c, e) for c, e in losses),
        "first_step_s": round(times[0][0], 2),
        "step_ms_compiled": round(1e3 * sum(c for c, _ in later) / len(later), 1),
        "step_ms_eager": round(1e3 * sum(e for _, e in later) / len(later), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2", choices=sorted(PRESETS))
    parser.add_argument("--levels", default="O1,O2")
    parser.add_argument("--steps", type=int, default=4, help="training steps (the first one compiles)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    parser.add_argument("--arch", default="gpt", choices=ARCHS, help="model architecture")
    parser.add_argument("--n-kv-head", type=int, default=None, help="--arch llama: key/value heads (default: all)")
    parser.add_argument("--layers", type=int, default=None, help="keep only this many of the preset's blocks")
    parser.add_argument("--activations", default="bf16", choices=ACTIVATIONS, help="saved activations (fp8lm.nn.saved)")
    parser.add_argument("--activation-checkpointing", default="none", choices=CHECKPOINTING, help="of the blocks")
    parser.add_argument(
        "--recipe", default=None, help="a named fp8lm.Recipe of the FP8 layers (default: tensorwise-delayed)"
    )
    parser.add_argument(
        "--cpu-quantization",
        default="op",
        help="comma-separated, each measured in turn: how a fine-grained recipe quantizes on the CPU under "
        "compile: op (one torch.library op per operand, the default) or traced (its ATen ops, as on CUDA)",
    )
    parser.add_argument(
        "--no-autocast",
        dest="autocast",
        action="store_false",
        help="forward in FP32 (default: under BF16 autocast, as fp8lm train runs O1/O2)",
    )
    args = parser.parse_args()
    try:
        cfg = preset(args.preset, arch=args.arch, n_kv_head=args.n_kv_head)
    except ValueError as err:
        raise SystemExit(f"compile_gpt.py: {err}") from None
    if args.layers is not None:
        if not 1 <= args.layers <= cfg.n_layer:
            raise SystemExit(f"--layers must be in [1, {cfg.n_layer}] for the {args.preset} preset")
        cfg = dataclasses.replace(cfg, n_layer=args.layers)
    if not 1 <= args.seq <= cfg.block_size or args.steps < 2:
        raise SystemExit(f"--seq must be in [1, {cfg.block_size}] and --steps >= 2")
    modes = args.cpu_quantization.split(",")
    if not set(modes) <= {"op", "traced"}:
        raise SystemExit(f"--cpu-quantization takes op and/or traced, got {args.cpu_quantization!r}")
    levels = []
    for mode in modes:
        finegrained.CPU_QUANTIZE_OP = mode == "op"
        levels += [{**measure_level(cfg, level, args), "cpu_quantization": mode} for level in args.levels.split(",")]
    print(
        json.dumps(
            {
                "benchmark": "compile_gpt",
                "machine": machine(),
                "torch": torch.__version__,
                "preset": args.preset,
                "arch": cfg.arch,
                "n_kv_head": cfg.n_kv_head,
                "num_layers": cfg.n_layer,
                "backend": args.backend,
                "autocast": "bf16" if args.autocast else None,
                "activations": args.activations,
                "activation_checkpointing": args.activation_checkpointing,
                "recipe": args.recipe or "tensorwise-delayed",
                "tokens_per_step": args.batch * args.seq,
                "steps": args.steps,
                "levels": levels,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
