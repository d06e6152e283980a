"""GPT training step side by side: time, training-state bytes and activation bytes, as JSON.

For each model size and level (fp32, BF16 autocast, torchao float8, fp8lm O1 / O2), on the same
model, batch and data:
- ``step_ms``: time of forward + backward + optimizer step. Levels are timed in interleaved
  rounds so machine load affects them alike; the minimum over rounds of the mean step time is
  reported, and its ratio to BF16.
- ``bytes_per_param``: `fp8lm.memory_report` of model and optimizer after a step, gradients alive.
- ``act_bytes_per_token``: storage autograd saves for backward, per token.
BF16, torchao and fp8lm levels run under BF16 autocast; the baseline optimizer is torch's fused
AdamW (its fastest); fp8lm O2 uses FP8AdamW via `fp8lm.initialize`; torchao converts the same
linear layers with `convert_to_float8_training` (tensorwise scaling), when installed. On CPUs
without BF16 instructions the BF16 GEMMs run as `fp8lm.ops.gemm.CPUBF16Linear` computes them.
``--compile both`` times every level eager and ``torch.compile``-d (``LEVEL+compiled``) in the
same rounds; a compiled level's ratio is to compiled BF16.

    python benchmarks/train_step.py [--sizes 4x128,4x384,8x512] [--levels fp32,bf16,torchao,O1,O2] [--compile [both]]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time

import torch
from common import keep_freed_memory, machine

import fp8lm
from fp8lm.ops.gemm import CPUBF16Linear
from fp8lm.train.measure import saved_tensor_bytes
from fp8lm.train.model import GPT, GPTConfig

LEVELS = ("fp32", "bf16", "torchao", "O1", "O2")


def parse_size(text: str) -> tuple[int, int]:
    """``LxD``: L layers of width D (heads of 64, at least 2)."""
    layers, _, width = text.partition("x")
    try:
        return int(layers), int(width)
    except ValueError:
        raise SystemExit(f"--sizes: expected LAYERSxWIDTH[,...] such as 4x384, got {text!r}") from None


def torchao_available() -> bool:
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception:
        return False
    return True


COMPILED = "+compiled"


def run_name(level: str, compiled: bool) -> str:
    return level + COMPILED if compiled else level


def build(level: str, cfg: GPTConfig, device: str, compile_model: bool):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if level in ("O1", "O2"):
        model, opt = fp8lm.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level)
    else:
        if level == "torchao":
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(
                model, module_filter_fn=lambda m, fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0
            )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    forward = torch.compile(model) if compile_model else model
    return model, forward, opt


def measure_size(layers: int, width: int, levels: list[str], args) -> dict:
    cfg = GPTConfig(n_layer=layers, n_embd=width, n_head=max(2, width // 64), block_size=args.seq)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    variants = {"all": [True], "both": [False, True]}.get(args.compile, [False])
    runs = {
        run_name(level, compiled): build(level, cfg, args.device, compiled) for compiled in variants for level in levels
    }

    def loss_of(level, forward):
        if level.startswith("fp32"):
            return forward(x, y)[1]
        # CPUBF16Linear: BF16 GEMMs as FP32 GEMMs of BF16-rounded operands where the CPU has no BF16
        # instructions (torch's BF16 GEMM is ~40x slower there), as the training app runs them.
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16), CPUBF16Linear():
            return forward(x, y)[1]

    def step(level, run, zero=True):
        _, forward, opt = run
        loss_of(level, forward).backward()
        opt.step()
        if zero:
            opt.zero_grad(set_to_none=True)

    state, acts, errors = {}, {}, {}
    for level, run in list(runs.items()):
        model, forward, opt = run
        try:
            for _ in range(args.warmup):  # compilation included
                step(level, run)
        except Exception as err:  # report a level that fails here (e.g. under torch.compile) and go on
            errors[level] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            del runs[level]
            continue
        step(level, run, zero=False)
        state[level] = fp8lm.memory_report(model, opt)["bytes_per_param"]
        opt.zero_grad(set_to_none=True)
        measured = functools.partial(loss_of, level, forward)
        acts[level] = saved_tensor_bytes(measured, exclude=list(model.parameters())) / x.numel()
    for compiled in variants:
        if run_name("bf16", compiled) not in runs:
            raise SystemExit(f"the bf16 baseline failed: {errors[run_name('bf16', compiled)]}")
    times = {level: [] for level in runs}
    order = list(runs.items())
    shuffle = random.Random(0).shuffle
    for _ in range(args.rounds):
        shuffle(order)  # a new order each round: no level always runs after the same neighbour
        for level, run in order:
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(level, run)
            sync()
            times[level].append((time.perf_counter() - start) / args.steps)
    best = {level: min(t) * 1e3 for level, t in times.items()}
    baseline = {level: best[run_name("bf16", level.endswith(COMPILED))] for level in best}
    return {
        "size": f"{layers}x{width}",
        "num_params": sum(p.numel() for p in next(iter(runs.values()))[0].parameters()),
        "model": cfg.to_dict(),
        "tokens_per_step": x.numel(),
        "step_ms": best,
        "ratio_to_bf16": {level: ms / baseline[level] for level, ms in best.items()},  # compiled: to compiled bf16
        "bytes_per_param": state,
        "act_bytes_per_token": acts,
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x128,4x384,8x512", help="LAYERSxWIDTH list (default: three CPU sizes)")
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--compile",
        nargs="?",
        const="all",
        choices=["all", "both"],
        help="torch.compile each model; 'both': each level eager and compiled (LEVEL+compiled), "
        "timed in the same rounds, compiled ratios against compiled bf16",
    )
    args = parser.parse_args()
    levels = args.levels.split(",")
    unknown = sorted(set(levels) - set(LEVELS))
    if unknown or "bf16" not in levels:
        raise SystemExit(f"--levels: choose from {', '.join(LEVELS)}, bf16 included (the baseline); got {args.levels}")
    skipped = []
    if "torchao" in levels and not torchao_available():
        levels.remove("torchao")
        skipped.append("torchao (not installed)")
    heap_reuse = keep_freed_memory()
    sizes = [measure_size(*parse_size(s), levels, args) for s in args.sizes.split(",")]
    print(
        json.dumps(
            {
                "benchmark": "train_step",
                "machine": machine(),
                "device": args.device,
                "heap_reuse": heap_reuse,
                "compile": args.compile,
                "levels": levels,
                "skipped": skipped,
                "sizes": sizes,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
