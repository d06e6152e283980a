"""`fp8lm compare`: the same model, seed and data trained at several precision levels."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .checkpoint import atomic_write_bytes, list_checkpoints
from .config import FP8_DATA_PARALLEL_LEVELS, FP8_OPTIMIZER_LEVELS, OPT_LEVELS, RunError, TrainConfig
from .loop import check_output, train
from .parallel import join
from .report import format_table, plot_losses, read_metrics, rel_gap

__all__ = ["compare", "parse_levels", "BASELINE"]

BASELINE = "bf16"


def parse_levels(spec: str) -> list[str]:
    """``"bf16,O1,O2"`` -> ``["bf16", "O1", "O2"]``, checked against `OPT_LEVELS`."""
    levels = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in levels if s not in OPT_LEVELS]
    if bad or not levels:
        raise RunError(f"unknown opt level(s) {', '.join(bad) or '(none given)'} in --levels: use a comma-separated list of {', '.join(OPT_LEVELS)}")
    if len(set(levels)) != len(levels):
        raise RunError(f"--levels lists a level twice: {spec}")
    return levels


def _level_config(cfg: TrainConfig, level: str, out: Path) -> TrainConfig:
    run = replace(cfg, opt_level=level, out=str(out / level), cache_dir=cfg.cache_dir or str(out / "cache"),
                  # FP8-optimizer options (the second moment's format) go to the O2/O3 runs alone
                  exp_avg_sq=cfg.exp_avg_sq if level in FP8_OPTIMIZER_LEVELS else None,
                  # the FP8 gradient all-reduce's scaling goes to the O1/O2 runs alone
                  grad_sync_scaling=cfg.grad_sync_scaling if level in FP8_DATA_PARALLEL_LEVELS else "local")
    if cfg.resume:  # a level that had not started yet when the comparison stopped starts now
        run.resume = bool(list_checkpoints(Path(run.out) / "checkpoints"))
    return run


def _finished(run: TrainConfig) -> dict | None:
    """Under --resume, the summary of a level that already completed its steps (it is not rerun)."""
    path = Path(run.out) / "summary.json"
    if not run.resume or not path.exists():
        return None
    summary = json.loads(path.read_text())
    return summary if summary["steps"] == run.steps else None


def compare(cfg: TrainConfig, levels: list[str]) -> dict | None:
    """Train ``cfg`` once per level into ``<out>/<level>/`` (sharing one token cache), then write
    ``<out>/compare.json`` and ``<out>/loss.png``. Returns the comparison (with ``table`` and
    ``plot`` entries). With ``cfg.resume``, an interrupted comparison continues: finished levels
    are kept, interrupted ones resume from their checkpoints, the others start. Under ``torchrun``
    every level trains data-parallel; rank 0 writes and returns the comparison, the others None."""
    ranks = join()
    out = Path(cfg.out)
    runs = {level: _level_config(cfg, level, out) for level in levels}
    finished = {level: _finished(run) for level, run in runs.items()}  # decided once, alike on every rank
    for level, run in runs.items():  # all levels checked before the first one trains
        run.validate()
        if finished[level] is None:
            check_output(run)
    if ranks.main:
        (out / "compare.json").unlink(missing_ok=True)
    summaries = {level: finished[level] or train(run) for level, run in runs.items()}
    if not ranks.main:
        return None

    base = summaries.get(BASELINE)
    rows = {}
    for level, s in summaries.items():
        rows[level] = {
            "val_loss": s["val_loss"],
            "rel_gap_vs_bf16": rel_gap(s["val_loss"], base["val_loss"]) if base else None,
            "train_loss": s["train_loss"],
            "bytes_per_param": s["bytes_per_param"],
            "act_bytes_per_token": s["act_bytes_per_token"],
            "tokens_per_s": s["tokens_per_s"],
            "skipped_steps": s["skipped_steps"],
        }
    first = next(iter(summaries.values()))
    title = f"GPT {first['num_params'] / 1e6:.2f}M params, {first['steps']} steps, {first['tokens']:,} tokens"
    plot = plot_losses({level: read_metrics(Path(r.out) / "metrics.jsonl") for level, r in runs.items()},
                       out / "loss.png", title)
    result = {
        "levels": rows,
        "steps": first["steps"],
        "tokens": first["tokens"],
        "num_params": first["num_params"],
        "model_config": first["model_config"],
        "data": first["data"],
        "device": first["device"],
        "plot": str(plot),
    }
    atomic_write_bytes(out / "compare.json", json.dumps(result, indent=1).encode())
    result["table"] = format_table(rows)
    return result
