"""Worker for tests/test_skipping.py: FP8ZeroOptimizer's skip counter, its state_dict and sharded
checkpoint round trips, and `fp8lm.clip_grad_norm_` on it.

Argument: a checkpoint directory to write."""

import torch
from torch import nn

from dist_launch import worker_main


def model_and_optimizer():
    from fp8lm.distributed import wrap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    return wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O3", optimizer_options={"kernel": "eager"})


def backward(model, rank, step, bad=None):
    g = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(4, 16, generator=g)).square().mean().backward()
    if bad is not None and rank == 1:  # one rank's gradient: every rank must skip
        next(model.parameters()).grad.view(-1)[0] = bad


def checks(rank, world, save_dir):
    import fp8lm
    from fp8lm.distributed import load_checkpoint, save_checkpoint

    out = {"skipped": [], "last": []}
    model, opt = model_and_optimizer()
    for step, bad in enumerate([None, float("nan"), None, float("inf"), None]):
        backward(model, rank, step, bad)
        opt.step()
        opt.zero_grad()
        out["skipped"].append(opt.skipped_steps)
        out["last"].append(opt.last_step_skipped)
    saved = opt.state_dict()
    out["saved_count"] = int(saved["skipped_steps"])
    fresh_model, fresh = model_and_optimizer()
    fresh.load_state_dict(saved)
    out["loaded_count"] = fresh.skipped_steps
    save_checkpoint(save_dir, model, opt)
    restored_model, restored = model_and_optimizer()
    load_checkpoint(save_dir, restored_model, restored)
    out["checkpoint_count"] = restored.skipped_steps

    backward(model, rank, 9)
    out["global_norm"] = float(fp8lm.clip_grad_norm_(opt, 1e-3))  # dispatches to the global clip
    out["clipped_norm"] = float(opt.clip_grad_norm_(1e9))
    return out


if __name__ == "__main__":
    worker_main(checks)
