"""Training-step time of a GPT under BF16 autocast, fp8lm O1 / O2, and torchao float8, as JSON.

Every level runs the same model, batch and BF16 autocast; the baseline uses torch's fused AdamW
(its fastest), fp8lm levels go through `fp8lm.initialize` (O2: FP8AdamW), torchao converts the
same linear layers with `convert_to_float8_training` (eager, tensorwise scaling). Levels are
timed in interleaved rounds so machine load affects them alike; the minimum over rounds of the
mean step time is reported, with its ratio to BF16.

    python benchmarks/train_step.py [--levels bf16,O1,O2,torchao] [--n-layer 4 --n-embd 384]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import keep_freed_memory, machine

import fp8lm
from fp8lm.train.model import GPT, GPTConfig

LEVELS = ("bf16", "O1", "O2", "torchao")


def build(level: str, cfg: GPTConfig):
    torch.manual_seed(0)
    model = GPT(cfg)
    if level in ("O1", "O2"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return fp8lm.initialize(model, opt, level)
    if level == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    fused = {"fused": True} if level in ("bf16", "torchao") else {}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round")
    args = parser.parse_args()
    levels = args.levels.split(",")
    unknown = sorted(set(levels) - set(LEVELS))
    if unknown or "bf16" not in levels:
        raise SystemExit(f"--levels: choose from {', '.join(LEVELS)}, bf16 included (the baseline); got {args.levels}")
    heap_reuse = keep_freed_memory()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    runs = {}
    for level in levels:
        model, opt = build(level, cfg)
        runs[level] = (model.to(device), opt)

    def step(model, opt):
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for run in runs.values():
        for _ in range(3):  # warm-up, compilation included
            step(*run)
    times = {level: [] for level in levels}
    for _ in range(args.rounds):
        for level, run in runs.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(*run)
            sync()
            times[level].append((time.perf_counter() - start) / args.steps)
    best = {level: min(t) * 1e3 for level, t in times.items()}
    print(json.dumps({
        "benchmark": "train_step", "machine": machine(), "device": device, "heap_reuse": heap_reuse,
        "model": cfg.to_dict(), "tokens_per_step": args.batch * args.seq,
        "step_ms": best, "ratio_to_bf16": {level: ms / best["bf16"] for level, ms in best.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
