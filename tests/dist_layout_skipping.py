"""Worker for tests/test_train_layouts.py: a non-finite gradient on one rank of a `--tp 2 --pp 2`
run (O2) skips the step on every rank, leaves every weight and optimizer byte as it was, and is
counted once.

Arguments: a scratch folder for the run."""

import sys
import sysconfig
from pathlib import Path

import torch

from dist_launch import worker_main

BAD_STEP, STEPS = 2, 4


def state_bytes(run) -> list[torch.Tensor]:
    """Every weight and optimizer state tensor of this rank, as bytes (payloads and scales)."""
    from torch.distributed.tensor import DTensor

    from fp8lm.tensor import ScalingTensor

    out = []

    def add(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        parts = [t.payload, t.scale] if isinstance(t, ScalingTensor) else [t]
        out.extend(p.detach().clone().reshape(-1).view(torch.uint8) for p in parts)

    for p in run.core.parameters():
        add(p)
        for value in run.optimizer.state[p].values():
            if isinstance(value, torch.Tensor):
                add(value)
    return out


def checks(rank, world, scratch):
    from fp8lm.train.config import TrainConfig
    from fp8lm.train.run import TrainingRun

    cfg = TrainConfig(
        model="tiny",
        opt_level="O2",
        steps=STEPS,
        batch_size=4,
        seq_len=32,
        eval_every=STEPS,
        eval_batches=1,
        data=str(Path(sysconfig.get_paths()["stdlib"]) / "email"),
        out=str(Path(scratch) / "run"),
        cache_dir=str(Path(scratch) / "cache"),
        progress=False,
        tp=2,
        pp=2,
        pp_microbatches=2,
        telemetry_every=0,
    )
    run = TrainingRun(cfg)
    plain = run.forward_backward

    def forward_backward():
        loss = plain()
        if run.step_index == BAD_STEP and rank == 3:  # one rank of the last stage: every rank must skip
            grad = next(p.grad for p in run.core.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")
        return loss

    run.forward_backward = forward_backward
    out = {"skipped": [], "unchanged": None}
    for step in range(STEPS):
        run.step_index = step
        before = state_bytes(run) if step == BAD_STEP else None
        run.step(step)
        if before is not None:
            out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, state_bytes(run)))
        out["skipped"].append(run.skipped_steps)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker_main(checks)
