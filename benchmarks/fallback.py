"""Automatic precision fallback on a case built to underflow, as JSON.

A two-layer MLP regresses a fixed random teacher; the loss weights output channel c by w_c,
spread log-uniformly over 1e-14 .. 1, so the output gradient of the last layer spans ~47 binary
orders of magnitude, beyond E5M2's ~32: FP8 flushes the small channels' gradients to zero and
those channels never learn (Adam would otherwise update them at full speed, whatever their
gradient's size). Three runs on the same data: high precision (reference), fp8lm O1, and fp8lm O1
with telemetry every 10 steps feeding `PrecisionFallback`. Reported: the weighted training loss,
the unweighted error of the small-weight half of the channels (what the flushed gradients cost),
and the fallback's switch events.

    python benchmarks/fallback.py [--steps 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from common import machine

import fp8lm
from fp8lm.fallback import FallbackPolicy, PrecisionFallback
from fp8lm.telemetry import Telemetry

WIDTH, HIDDEN = 64, 256


def mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, WIDTH))


def run(mode: str, steps: int, batches, teacher, channel_weight) -> dict:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    telemetry = fallback = None
    if mode != "high_precision":
        model, opt = fp8lm.initialize(model, opt, opt_level="O1")
    if mode == "O1+fallback":
        telemetry = Telemetry(model, every=10)
        fallback = PrecisionFallback(telemetry.layers, FallbackPolicy(underflow=0.05, patience=2))
    small = channel_weight < channel_weight.median()
    for step in range(steps):
        x = batches[step % len(batches)]
        with torch.no_grad():
            target = teacher(x)
        window = telemetry.step(step) if telemetry else contextlib.nullcontext()
        with window:
            loss = ((model(x) - target) ** 2 * channel_weight).sum(-1).mean()
            loss.backward()
        if telemetry:
            fallback.update(telemetry.after_backward())
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        x = torch.randn(1024, WIDTH, generator=torch.Generator().manual_seed(1))
        err = (model(x) - teacher(x)) ** 2
        return {
            "weighted_loss": float((err * channel_weight).sum(-1).mean()),
            "small_channels_mse": float(err[:, small].mean()),
            "large_channels_mse": float(err[:, ~small].mean()),
            "events": fallback.events if fallback else [],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(123)
    teacher = mlp().requires_grad_(False)
    channel_weight = torch.logspace(-14, 0, WIDTH)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randn(64, WIDTH, generator=gen) for _ in range(50)]
    results = {
        mode: run(mode, args.steps, batches, teacher, channel_weight)
        for mode in ("high_precision", "O1", "O1+fallback")
    }
    ref = results["high_precision"]["small_channels_mse"]
    print(
        json.dumps(
            {
                "benchmark": "fallback",
                "machine": machine(),
                "steps": args.steps,
                "results": results,
                "small_channels_mse_vs_high_precision": {m: r["small_channels_mse"] / ref for m, r in results.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
