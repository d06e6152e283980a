"""Cost of FP8 telemetry, as JSON: a sampled step against an unsampled one, and the overhead that
makes at an interval of N steps, on the default GPT preset under O2.

Sampled and unsampled steps alternate so machine load hits both alike; medians are reported.
Overhead at interval N = (sampled - unsampled) / (N * unsampled).

    python benchmarks/telemetry.py [--every 100] [--pairs 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from common import keep_freed_memory, machine

import fp8lm
from fp8lm.telemetry import Telemetry
from fp8lm.train.model import GPT, preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=100, help="telemetry interval to report the overhead for")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    keep_freed_memory()
    torch.manual_seed(0)
    cfg = preset("small")
    model = GPT(cfg)
    model, opt = fp8lm.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")
    telemetry = Telemetry(model, opt, every=2)  # even steps sampled, odd steps not
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size))

    def step(i: int) -> float:
        start = time.perf_counter()
        with telemetry.step(i):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
        telemetry.after_backward()
        opt.step()
        telemetry.after_optimizer_step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for i in range(4):
        step(i)
    sampled, plain = [], []
    for i in range(2 * args.pairs):
        (sampled if i % 2 == 0 else plain).append(step(i))
    s, p = statistics.median(sampled), statistics.median(plain)
    print(
        json.dumps(
            {
                "benchmark": "telemetry",
                "machine": machine(),
                "model": cfg.to_dict(),
                "tokens_per_step": x.numel(),
                "sampled_step_s": s,
                "unsampled_step_s": p,
                "every": args.every,
                "overhead_fraction": (s - p) / (args.every * p),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
