"""Reports of finished runs: loss curves overlaid in one PNG, and the comparison table."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["read_metrics", "plot_losses", "format_table", "format_seed_table", "rel_gap"]


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (per-batch training losses are noisy)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_losses(
    runs: dict[str, list[dict]], path: str | os.PathLike, title: str = "", baseline: str | None = None
) -> Path | None:
    """Train (smoothed) and validation loss of each run against tokens, one colour per level.
    Runs named ``"level@seed"`` are seeds of one level (same colour). With ``baseline`` among the
    levels, a third panel shows each level's gap to it over training, in percent: validation
    (markers) and smoothed train loss (line), averaged over the seeds, the band their range."""
    from .progress import pyplot

    plt = pyplot()
    if plt is None:  # matplotlib is not installed (said once)
        return None

    by_level = _group_by_level(runs)
    with_gap = baseline in by_level and len(by_level) > 1
    fig, axes = plt.subplots(1, 3 if with_gap else 2, figsize=(16 if with_gap else 11, 4))
    ax_train, ax_val = axes[0], axes[1]
    ax_val.sharey(ax_train)
    for i, (level, seeds) in enumerate(by_level.items()):
        for j, records in enumerate(seeds.values()):
            label = level if j == 0 else None
            tokens = [r["tokens"] for r in records]
            ax_train.plot(tokens, _smoothed_train(records), color=f"C{i}", label=label, alpha=0.8)
            val = [(r["tokens"], r["val_loss"]) for r in records if "val_loss" in r]
            if val:
                ax_val.plot(*zip(*val), color=f"C{i}", marker="o", label=label, alpha=0.8)
    if with_gap:
        _plot_gaps(axes[2], by_level, baseline)
    ax_train.set_title("train loss (moving average)")
    ax_val.set_title("validation loss")
    for ax in axes:
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_train.set_ylabel("cross-entropy (nats / byte)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def _group_by_level(runs: dict[str, list[dict]]) -> dict[str, dict[str, list[dict]]]:
    """``{"O2@0": ..., "O2@1": ...}`` -> ``{"O2": {"0": ..., "1": ...}}`` (a name without ``@`` is one seed)."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for name, records in runs.items():
        level, _, seed = name.partition("@")
        grouped.setdefault(level, {})[seed] = records
    return grouped


def _smoothed_train(records: list[dict]) -> list[float]:
    return _smooth([r["train_loss"] for r in records], max(1, len(records) // 50))


def _plot_gaps(ax, by_level: dict, baseline: str) -> None:
    """Percent gap of each level to ``baseline`` at the same seed and step, over the seeds."""
    base = by_level[baseline]
    for i, (level, seeds) in enumerate(by_level.items()):
        if level == baseline:
            continue
        common = [s for s in seeds if s in base]
        if not common:
            continue
        tokens = [r["tokens"] for r in seeds[common[0]]]
        train_gaps = [
            [100 * (a / b - 1) for a, b in zip(_smoothed_train(seeds[s]), _smoothed_train(base[s]))] for s in common
        ]
        n = min(len(g) for g in train_gaps)
        ax.plot(
            tokens[:n],
            [sum(g[k] for g in train_gaps) / len(common) for k in range(n)],
            color=f"C{i}",
            label=f"{level} train",
            alpha=0.7,
        )
        val_gaps = [_val_gaps(seeds[s], base[s]) for s in common]
        points = sorted(set.intersection(*(set(g) for g in val_gaps)))
        if points:
            values = [[g[t] for g in val_gaps] for t in points]
            ax.plot(
                points,
                [sum(v) / len(v) for v in values],
                color=f"C{i}",
                marker="o",
                linestyle="none",
                label=f"{level} validation",
            )
            if len(common) > 1:
                ax.fill_between(points, [min(v) for v in values], [max(v) for v in values], color=f"C{i}", alpha=0.15)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_title(f"gap to {baseline} (%, same seed and step)")


def _val_gaps(records: list[dict], base: list[dict]) -> dict[int, float]:
    base_val = {r["tokens"]: r["val_loss"] for r in base if "val_loss" in r}
    return {
        r["tokens"]: 100 * (r["val_loss"] / base_val[r["tokens"]] - 1)
        for r in records
        if "val_loss" in r and r["tokens"] in base_val
    }


def save_figure(fig, path: str | os.PathLike, dpi: int) -> Path:
    """Write ``fig`` to ``path`` atomically (temp file, then rename) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def rel_gap(value: float, baseline: float) -> float:
    """Relative difference of ``value`` from ``baseline``: (value - baseline) / baseline."""
    return (value - baseline) / baseline


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: dict[str, dict]) -> str:
    """The comparison table, one row per level."""
    header = f"{'level':<6} {'val_loss':>9} {'vs bf16':>8} {'train_loss':>10} {'bytes/param':>11} {'act B/token':>11} {'tokens/s':>9}"
    lines = [header, "-" * len(header)]
    for level, r in rows.items():
        gap = r.get("rel_gap_vs_bf16")
        lines.append(
            f"{level:<6} {_fmt(r['val_loss'], '.4f'):>9} {('-' if gap is None else f'{gap:+.2%}'):>8} "
            f"{_fmt(r['train_loss'], '.4f'):>10} {_fmt(r['bytes_per_param'], '.2f'):>11} "
            f"{_fmt(r['act_bytes_per_token'], ',.0f'):>11} {_fmt(r['tokens_per_s'], ',.0f'):>9}"
        )
    return "\n".join(lines)


def format_seed_table(rows: dict[str, dict], seeds: list[int]) -> str:
    """The table of a comparison over seeds: each level's gap to bf16 per seed, mean and spread;
    with fp32 among the levels, each gap minus fp32's paired by seed, +- its standard error."""
    seed_cols = "".join(f" {'seed ' + str(s):>8}" for s in seeds)
    paired = all("minus_fp32" in r for r in rows.values())
    fp32_col = f" {'- fp32 (+- se)':>17}" if paired else ""
    header = (
        f"{'level':<6}{seed_cols} {'mean':>8} {'std':>7}{fp32_col} {'val_loss':>9} {'bytes/param':>11} {'tokens/s':>9}"
    )
    lines = [header, "-" * len(header)]
    for level, r in rows.items():
        gaps = "".join(f" {_pct(r['gaps_vs_bf16'].get(str(s))):>8}" for s in seeds)
        std = "-" if r["gap_std"] is None else f"{r['gap_std']:.2%}"
        minus = f" {_paired(r['minus_fp32']):>17}" if paired else ""
        lines.append(
            f"{level:<6}{gaps} {_pct(r['rel_gap_vs_bf16']):>8} {std:>7}{minus} {_fmt(r['val_loss'], '.4f'):>9} "
            f"{_fmt(r['bytes_per_param'], '.2f'):>11} {_fmt(r['tokens_per_s'], ',.0f'):>9}"
        )
    return "\n".join(lines)


def _paired(diff: dict) -> str:
    """A paired difference (`fp8lm.train.compare.paired_difference`) as ``mean +- stderr``."""
    if diff["mean"] is None:
        return "-"
    return _pct(diff["mean"]) + ("" if diff["stderr"] is None else f" +- {diff['stderr']:.2%}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2%}"
