"""Whether a run may start or continue: the output folder's state, and a checkpoint's fit to the
run (model shape, level, format, gradient sync scaling, rank count). Each refusal is one line
saying what to pass instead, raised before anything is written."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .checkpoint import CheckpointError, list_checkpoints
from .config import RunError, TrainConfig
from .parallel import Ranks, restarts_allowed

__all__ = ["CHECKPOINT_FORMAT", "check_output", "check_state_fits", "check_resume"]

CHECKPOINT_FORMAT = "fp8lm.train/2"


def check_output(cfg: TrainConfig) -> bool:
    """Refuse to start over a finished or checkpointed run (unless resuming), or to resume nothing.
    Returns whether the run resumes: under ``torchrun --max-restarts N`` the same command line
    serves the first attempt and the restarts, so there ``--resume`` starts a run that has no
    checkpoint yet."""
    out = Path(cfg.out)
    has_checkpoint = bool(list_checkpoints(out / "checkpoints"))
    if not cfg.resume and ((out / "summary.json").exists() or has_checkpoint):
        raise RunError(
            f"{str(out)!r} already holds a training run; pass --resume to continue it or choose another --out"
        )
    if cfg.resume and not has_checkpoint and not restarts_allowed():
        raise RunError(
            f"--resume: no checkpoint in {str(out / 'checkpoints')!r}; run without --resume to start training"
        )
    return cfg.resume and has_checkpoint


def check_state_fits(model: nn.Module, state: dict, where: str) -> None:
    """Raise one clear line when a checkpoint's weights do not fit ``model`` (a plain GPT)."""
    own, theirs = model.state_dict(), state["model"]
    wrong = [k for k in own if k in theirs and tuple(theirs[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in theirs]
    if not (wrong or missing):
        return
    first = (wrong or missing)[0]
    detail = (
        f"has shape {tuple(theirs[first].shape)}, this model needs {tuple(own[first].shape)}" if wrong else "is missing"
    )
    saved = state.get("model_config") or {}
    diff = ", ".join(
        f"{k}={v} (here {getattr(model.config, k)})"
        for k, v in saved.items()
        if hasattr(model.config, k) and getattr(model.config, k) != v
    )
    raise CheckpointError(
        f"checkpoint {where} does not fit this model: {first!r} {detail}"
        + (f"; it was trained with {diff}" if diff else "")
        + "; pass --model/--n-layer/--n-head/--n-embd/--mlp/--seq-len to match it"
    )


def check_resume(cfg: TrainConfig, state: dict, model: nn.Module, ranks: Ranks) -> None:
    """Refuse a checkpoint this run cannot continue exactly."""
    check_state_fits(model, state, repr(state["path"]))
    if int(state["step"]) >= cfg.steps:
        raise RunError(
            f"the run in {cfg.out!r} already reached step {state['step']}; pass --steps larger than that to continue it"
        )
    if state.get("opt_level") != cfg.opt_level:
        raise CheckpointError(
            f"checkpoint {state['path']!r} was trained at opt level {state.get('opt_level')}, "
            f"not {cfg.opt_level}; resume with --opt-level {state.get('opt_level')}"
        )
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {state['path']!r} has format {state.get('format')!r}, this version reads {CHECKPOINT_FORMAT!r}"
        )
    saved_scaling = (state.get("data_parallel") or {}).get("scaling")
    if saved_scaling is not None and saved_scaling != cfg.grad_sync_scaling:
        raise CheckpointError(
            f"checkpoint {state['path']!r} was trained with --grad-sync-scaling {saved_scaling}, not "
            f"{cfg.grad_sync_scaling}; resume with --grad-sync-scaling {saved_scaling}"
        )
    saved_world = len(state["ranks"])
    if saved_world != ranks.world:
        launch = f"torchrun --nproc_per_node {saved_world}" if saved_world > 1 else "one process (no torchrun)"
        raise CheckpointError(
            f"checkpoint {state['path']!r} was written by {saved_world} rank(s), this run has {ranks.world}: "
            f"each rank's batches and FP8 scaling histories continue exactly only at the same count; resume with {launch}"
        )
