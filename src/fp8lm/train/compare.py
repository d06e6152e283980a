"""`fp8lm compare`: the same model, seed and data trained at several precision levels."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

from ..recipe import DEFAULT_RECIPE
from . import progress
from .checkpoint import atomic_write_bytes, list_checkpoints
from .config import FP8_DATA_PARALLEL_LEVELS, FP8_LEVELS, FP8_OPTIMIZER_LEVELS, OPT_LEVELS, RunError, TrainConfig
from .hf_model import build_model
from .loop import check_output, train
from .ranks import join
from .report import format_seed_table, format_table, plot_losses, read_metrics, rel_gap

__all__ = ["compare", "parse_levels", "parse_seeds", "aggregate_seeds", "BASELINE"]

BASELINE = "bf16"


def parse_levels(spec: str) -> list[str]:
    """``"bf16,O1,O2"`` -> ``["bf16", "O1", "O2"]``, checked against `OPT_LEVELS`."""
    levels = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in levels if s not in OPT_LEVELS]
    if bad or not levels:
        raise RunError(
            f"unknown opt level(s) {', '.join(bad) or '(none given)'} in --levels: use a comma-separated list of {', '.join(OPT_LEVELS)}"
        )
    if len(set(levels)) != len(levels):
        raise RunError(f"--levels lists a level twice: {spec}")
    return levels


def _level_config(cfg: TrainConfig, level: str, out: Path) -> TrainConfig:
    run = replace(
        cfg,
        opt_level=level,
        out=str(out / level),
        cache_dir=cfg.cache_dir or str(out / "cache"),
        # FP8-optimizer options (the second moment's format) go to the O2/O3 runs alone
        exp_avg_sq=cfg.exp_avg_sq if level in FP8_OPTIMIZER_LEVELS else None,
        # the FP8 gradient all-reduce's scaling goes to the O1/O2 runs alone
        grad_sync_scaling=cfg.grad_sync_scaling if level in FP8_DATA_PARALLEL_LEVELS else "local",
        # the FP8 recipe goes to the FP8 runs alone
        recipe=cfg.recipe if level in FP8_LEVELS else DEFAULT_RECIPE,
        # and so do FP8-saved activations
        activations=cfg.activations if level in FP8_LEVELS else None,
        policy=cfg.policy if level in FP8_LEVELS else None,
        # and what switches FP8 layers to BF16
        fallback=cfg.fallback and level in FP8_LEVELS,
        final_bf16_fraction=cfg.final_bf16_fraction if level in FP8_LEVELS else 0.0,
    )
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


def parse_seeds(spec: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``: distinct non-negative integers."""
    try:
        seeds = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise RunError(f"--seeds takes comma-separated integers, e.g. 0,1,2; got {spec!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise RunError(f"--seeds needs distinct non-negative integers, e.g. 0,1,2; got {spec!r}")
    return seeds


def _train_levels(cfg: TrainConfig, levels: list[str], out: Path, ranks, seed: int | None = None) -> tuple[dict, dict]:
    """Train every level of one comparison into ``<out>/<level>/``; returns (runs, summaries).
    Each run's lines are named by its level (and ``seed``, one of several)."""
    runs = {level: _level_config(cfg, level, out) for level in levels}
    finished = {level: _finished(run) for level, run in runs.items()}  # decided once, alike on every rank
    for level, run in runs.items():  # all levels checked before the first one trains
        run.validate()
        if finished[level] is None:
            check_output(run)
    if cfg.policy is not None:  # --policy's patterns against the model's names, on the meta device
        with torch.device("meta"):
            model = build_model(cfg.model_config())
        for run in runs.values():
            run.check_policy_names(model)
    if ranks.main:
        (out / "compare.json").unlink(missing_ok=True)
    summaries = {}
    for level, run in runs.items():
        summaries[level] = finished[level]
        if summaries[level] is not None:
            progress.skipped(run.steps)
            continue
        with progress.naming(level if seed is None else f"{level} seed {seed}"):
            summaries[level] = train(run)
    return runs, summaries


def _rows(summaries: dict) -> dict:
    base = summaries.get(BASELINE)
    return {
        level: {
            "val_loss": s["val_loss"],
            "rel_gap_vs_bf16": rel_gap(s["val_loss"], base["val_loss"]) if base else None,
            "val_bits_per_byte": s.get("val_bits_per_byte"),
            "train_loss": s["train_loss"],
            "bytes_per_param": s["bytes_per_param"],
            "act_bytes_per_token": s["act_bytes_per_token"],
            "peak_step_bytes": s.get("peak_step_bytes"),
            "tokens_per_s": s["tokens_per_s"],
            "skipped_steps": s["skipped_steps"],
            **_moe_row(s),
        }
        for level, s in summaries.items()
    }


def _moe_row(summary: dict) -> dict:
    """A mixture of experts' router load balance over the run (none for a dense model)."""
    moe = summary.get("moe")
    if not moe:
        return {}
    return {"moe_load_max_over_mean": moe["load_max_over_mean"], "moe_load_cv": moe["load_cv"]}


def compare(cfg: TrainConfig, levels: list[str], seeds: list[int] | None = None) -> dict | None:
    """Train ``cfg`` once per level into ``<out>/<level>/`` (sharing one token cache), then write
    ``<out>/compare.json`` and ``<out>/loss.png``. Returns the comparison (with ``table`` and
    ``plot`` entries). With ``seeds``, one such comparison per seed in ``<out>/seed<S>/``, and the
    top-level files aggregate them: each level's gap to bf16 per seed, its mean and spread (see
    `aggregate_seeds`). With ``cfg.resume``, an interrupted comparison continues: finished levels
    are kept, interrupted ones resume from their checkpoints, the others start. Under ``torchrun``
    every level trains distributed as ``cfg`` says (data-parallel, ``--fsdp``, ``--tp``, ``--pp``),
    one level after another; rank 0 writes and returns the comparison, the others None."""
    ranks = join(cfg.tp, cfg.pp)
    runs = len(levels) * len(seeds or [None])
    # one progress line (and its ETA) across every level and seed
    with progress.overall(runs * cfg.steps, 0, f"compare ({runs} runs)", cfg.progress and ranks.main):
        return _compare(cfg, levels, seeds, ranks)


def _compare(cfg: TrainConfig, levels: list[str], seeds: list[int] | None, ranks) -> dict | None:
    out = Path(cfg.out)
    if seeds is None:
        runs, summaries = _train_levels(cfg, levels, out, ranks)
        if not ranks.main:
            return None
        return _write(out, _rows(summaries), summaries, {level: Path(r.out) for level, r in runs.items()})
    cache = cfg.cache_dir or str(out / "cache")
    per_seed = {}
    for seed in seeds:
        seed_cfg = replace(cfg, seed=seed, out=str(out / f"seed{seed}"), cache_dir=cache)
        runs, summaries = _train_levels(seed_cfg, levels, Path(seed_cfg.out), ranks, seed)
        if ranks.main:
            seed_rows = _rows(summaries)
            per_seed[seed] = (runs, summaries, seed_rows)
            _write(Path(seed_cfg.out), seed_rows, summaries, {lv: Path(r.out) for lv, r in runs.items()})
    if not ranks.main:
        return None
    rows = aggregate_seeds({seed: seed_rows for seed, (_, _, seed_rows) in per_seed.items()})
    first_seed = per_seed[seeds[0]][1]
    dirs = {f"{level}@{seed}": Path(r.out) for seed, (runs, _, _) in per_seed.items() for level, r in runs.items()}
    result = _write(out, rows, first_seed, dirs, seeds=seeds)
    result["table"] = format_seed_table(rows, seeds)
    return result


def aggregate_seeds(per_seed: dict[int, dict]) -> dict:
    """Rows of several seeds' comparisons -> one row per level: ``rel_gap_vs_bf16`` and
    ``val_loss`` are means over the seeds, ``gaps_vs_bf16`` each seed's gap, ``gap_std`` their
    sample standard deviation (0 for one seed), ``gap_min``/``gap_max`` their range. Where fp32
    ran too, ``minus_fp32`` is the level's gap minus fp32's, paired seed by seed (`paired_difference`):
    how far the level trails full precision, with the standard error that says how well the
    seeds measure it."""
    levels = next(iter(per_seed.values())).keys()
    rows = {}
    for level in levels:
        seed_rows = {seed: rows_[level] for seed, rows_ in per_seed.items()}
        gaps = {seed: r["rel_gap_vs_bf16"] for seed, r in seed_rows.items()}
        known = [g for g in gaps.values() if g is not None]
        means = {
            key: statistics.fmean(r[key] for r in seed_rows.values())
            for key in ("val_loss", "train_loss", "bytes_per_param", "act_bytes_per_token", "tokens_per_s")
        }
        bits = [r.get("val_bits_per_byte") for r in seed_rows.values()]
        peaks = [r.get("peak_step_bytes") for r in seed_rows.values()]
        rows[level] = {
            "val_loss": means["val_loss"],
            "val_bits_per_byte": statistics.fmean(bits) if None not in bits else None,
            "rel_gap_vs_bf16": statistics.fmean(known) if known else None,
            "gaps_vs_bf16": {str(seed): g for seed, g in gaps.items()},
            "gap_std": statistics.stdev(known) if len(known) > 1 else (0.0 if known else None),
            "gap_min": min(known) if known else None,
            "gap_max": max(known) if known else None,
            "train_loss": means["train_loss"],
            "bytes_per_param": means["bytes_per_param"],
            "act_bytes_per_token": means["act_bytes_per_token"],
            "peak_step_bytes": statistics.fmean(peaks) if None not in peaks else None,  # type: ignore[type-var]
            "tokens_per_s": means["tokens_per_s"],
            "skipped_steps": sum(r["skipped_steps"] for r in seed_rows.values()),
        }
        for key in ("moe_load_max_over_mean", "moe_load_cv"):
            if all(key in r for r in seed_rows.values()):
                rows[level][key] = statistics.fmean(r[key] for r in seed_rows.values())
    if "fp32" in rows:
        for row in rows.values():
            row["minus_fp32"] = paired_difference(row["gaps_vs_bf16"], rows["fp32"]["gaps_vs_bf16"])
    return rows


def paired_difference(gaps: Mapping[str, float | None], reference: Mapping[str, float | None]) -> dict:
    """``gaps`` minus ``reference``'s at the same seeds (keys): ``mean``, sample ``std`` and
    standard error ``stderr`` of the per-seed differences (None below two seeds), and ``seeds``,
    how many both have. Pairing removes what a seed's data and initialization add to both."""
    diffs = [g - r for s, g in gaps.items() if g is not None and (r := reference.get(s)) is not None]
    std = statistics.stdev(diffs) if len(diffs) > 1 else None
    return {
        "mean": statistics.fmean(diffs) if diffs else None,
        "std": std,
        "stderr": None if std is None else std / math.sqrt(len(diffs)),
        "seeds": len(diffs),
    }


def _write(out: Path, rows: dict, summaries: dict, run_dirs: dict[str, Path], seeds: list[int] | None = None) -> dict:
    """Write ``compare.json`` and ``loss.png`` into ``out``; returns the comparison."""
    first = next(iter(summaries.values()))
    title = f"GPT {first['num_params'] / 1e6:.2f}M params, {first['steps']} steps, {first['tokens']:,} tokens"
    if seeds is not None:
        title += f", seeds {','.join(map(str, seeds))}"
    plot = plot_losses(
        {name: read_metrics(d / "metrics.jsonl") for name, d in run_dirs.items()},
        out / "loss.png",
        title,
        baseline=BASELINE,
    )
    result = {
        "levels": rows,
        **({"seeds": seeds} if seeds is not None else {}),
        "steps": first["steps"],
        "tokens": first["tokens"],
        "num_params": first["num_params"],
        "model_config": first["model_config"],
        "data": first["data"],
        "device": first["device"],
        "plot": str(plot) if plot is not None else None,
    }
    atomic_write_bytes(out / "compare.json", json.dumps(result, indent=1).encode())
    result["table"] = format_table(rows)
    return result
