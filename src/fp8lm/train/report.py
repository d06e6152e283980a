"""Reports of finished runs: loss curves overlaid in one PNG, and the comparison table."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["read_metrics", "plot_losses", "format_table", "rel_gap"]


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


def plot_losses(runs: dict[str, list[dict]], path: str | os.PathLike, title: str = "") -> Path:
    """Train (smoothed) and validation loss of each run against tokens, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (name, records) in enumerate(runs.items()):
        colour = f"C{i}"
        tokens = [r["tokens"] for r in records]
        window = max(1, len(records) // 50)
        ax_train.plot(tokens, _smooth([r["train_loss"] for r in records], window), color=colour, label=name)
        val = [(r["tokens"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax_val.plot(*zip(*val), color=colour, marker="o", label=name)
    ax_train.set_title("train loss (moving average)")
    ax_val.set_title("validation loss")
    for ax in (ax_train, ax_val):
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_train.set_ylabel("cross-entropy (nats / byte)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


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
