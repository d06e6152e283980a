"""`fp8lm inspect RUN_DIR`: a run's FP8 telemetry (``telemetry.jsonl``, see `fp8lm.telemetry`) as
a table of its worst tensors and a heatmap of one statistic, layers x steps."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from ..telemetry import KINDS, worst
from .report import save_figure

__all__ = ["InspectError", "read_telemetry", "worst_table", "heatmap_grid", "plot_heatmap", "STATS"]

STATS = ("underflow", "saturation")
_KEYS = {"step", "layer", "kind", "fmt", "amax", "scale", *STATS}  # what every telemetry record holds


class InspectError(ValueError):
    """The run folder has no telemetry to inspect."""


def read_telemetry(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``run_dir/telemetry.jsonl``."""
    run = Path(run_dir)
    if not run.is_dir():
        raise InspectError(f"run folder {str(run)!r} does not exist; pass the --out folder of an fp8lm train run")
    path = run / "telemetry.jsonl"
    records = _read_records(path) if path.exists() else []
    if not records and (run / "checkpoints" / "reference.pt").exists():
        raise InspectError(
            f"{str(run)!r} is an fp8lm dpo run: DPO records no FP8 telemetry; inspect the run it started from "
            f"({_started_from(run)}), trained with fp8lm train at an FP8 level"
        )
    if not records:
        raise InspectError(
            f"no telemetry recorded in {str(run)!r}: train at an FP8 level (O1/O2/O3) with --telemetry-every N "
            "(N >= 1, and at most the number of steps)"
        )
    return records


def _started_from(run: Path) -> str:
    """The ``--init-from`` of the DPO run in ``run`` as its ``summary.json`` records it (a run
    folder, or the run folder of a checkpoint file), or a phrase for it while there is none."""
    try:
        start = json.loads((run / "summary.json").read_text(encoding="utf-8"))["config"]["init_from"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its --init-from"
    if not isinstance(start, str):
        return "its --init-from"
    path = Path(start)
    if path.suffix == ".pt" and path.parent.name == "checkpoints":
        path = path.parent.parent
    return f"--init-from {start}: fp8lm inspect {shlex.quote(str(path))}"


def _read_records(path: Path) -> list[dict]:
    """The JSON objects of a JSON Lines file, each bad line one `InspectError` naming it."""
    if not path.is_file():  # a FIFO would block the read forever
        raise InspectError(f"{str(path)!r} is not a regular file; pass the --out folder of an fp8lm train run")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InspectError(
            f"{str(path)!r} is not UTF-8 text (byte {e.start}): fp8lm train did not write it; train again with "
            "--telemetry-every N"
        ) from None
    records = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict) or not _KEYS <= record.keys():
            raise InspectError(
                f"{path}:{n}: not a telemetry record (a JSON object with {', '.join(sorted(_KEYS))}): fp8lm train did "
                "not write it; train again with --telemetry-every N"
            )
        records.append(record)
    return records


def worst_table(records: list[dict], stat: str, top: int = 10) -> str:
    """The ``top`` records with the largest ``stat``, one line each."""
    header = f"{'step':>6} {'layer':<28} {'kind':<12} {'fmt':<5} {stat:>10} {'amax':>10} {'scale':>10}"
    lines = [header, "-" * len(header)]
    for r in worst(records, stat, top):
        lines.append(
            f"{r['step']:>6} {r['layer']:<28} {r['kind']:<12} {r['fmt']:<5} {r[stat]:>10.4%} "
            f"{r['amax']:>10.3g} {r['scale']:>10.3g}"
        )
    return "\n".join(lines)


def heatmap_grid(records: list[dict], kind: str, stat: str) -> tuple[list[str], list[int], list[list[float]]]:
    """(layers in model order, steps, grid[layer][step]) of ``stat`` of ``kind`` tensors: the worst
    value where a step has several records of a layer (micro-batches); NaN where it has none."""
    chosen = [r for r in records if r["kind"] == kind]
    present = {r["layer"] for r in chosen}
    # model order: the first records of a step are the forward pass's inputs, layer by layer
    layers = [n for n in dict.fromkeys(r["layer"] for r in records) if n in present]
    steps = sorted({r["step"] for r in chosen})
    row, col = {n: i for i, n in enumerate(layers)}, {s: j for j, s in enumerate(steps)}
    grid = [[float("nan")] * len(steps) for _ in layers]
    for r in chosen:
        i, j = row[r["layer"]], col[r["step"]]
        current = grid[i][j]
        grid[i][j] = r[stat] if current != current else max(current, r[stat])  # NaN: first record
    return layers, steps, grid


def plot_heatmap(
    records: list[dict], path: str | os.PathLike, kind: str = "grad_output", stat: str = "underflow"
) -> Path | None:
    """Write the heatmap of `heatmap_grid` as a PNG."""
    if kind not in KINDS:
        raise InspectError(f"unknown tensor kind {kind!r}: use one of {', '.join(KINDS)}")
    if stat not in STATS:
        raise InspectError(f"unknown statistic {stat!r}: use one of {', '.join(STATS)}")
    layers, steps, grid = heatmap_grid(records, kind, stat)
    if not layers:
        present = ", ".join(sorted({r["kind"] for r in records}))
        raise InspectError(f"the telemetry has no {kind} records (it has: {present}); pass --kind with one of those")
    from .progress import pyplot

    plt = pyplot()
    if plt is None:  # matplotlib is not installed (said once)
        return None

    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(steps) + 3), max(3.0, 0.28 * len(layers) + 1.5)))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma")
    fig.colorbar(image, ax=ax, label=f"{stat} fraction")
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ticks = range(0, len(steps), max(1, len(steps) // 12))
    ax.set_xticks(list(ticks), [str(steps[j]) for j in ticks])
    ax.set_xlabel("step")
    ax.set_title(f"{kind} {stat} per FP8 layer")
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


# (kind, statistic, FallbackPolicy field, what it is): what --fallback judges, and its limit
_JUDGED = (
    ("grad_output", "underflow", "underflow", "output-gradient underflow"),
    ("weight_grad", "underflow", "weight_grad_underflow", "weight-gradient underflow"),
    ("input", "saturation", "saturation", "input saturation"),
)


def telemetry_line(records: list[dict], step: int, out: str = "OUT") -> str:
    """One line about a telemetry sample that says whether it matters: the worst value of each
    statistic that `fp8lm.fallback.FallbackPolicy` judges, against its threshold, and what to do
    when one is over (``out``: the run folder `fp8lm inspect` is pointed at); the optimizer moments'
    underflow, reported as what it is (expected)."""
    from ..fallback import FallbackPolicy

    policy, worst_of, over = FallbackPolicy(), [], []
    for kind, stat, limit_name, what in _JUDGED:
        of_kind = [r for r in records if r["kind"] == kind]
        if not of_kind:
            continue
        w, limit = max(of_kind, key=lambda r: r[stat]), getattr(policy, limit_name)
        worst_of.append(f"{what} {w[stat]:.2%} ({w['layer']}; threshold {limit:.1%})")
        if w[stat] > limit:
            over.append(f"{what} of {w['layer']}")
    if over:
        verdict = (
            f"over a --fallback threshold: {', '.join(over)} (FP8 loses those values; train with --fallback to run "
            f"such layers in BF16 while it lasts; fp8lm inspect {shlex.quote(out)} shows them)"
        )
    else:
        verdict = "normal, within the --fallback thresholds"
    line = f"step {step}: FP8 telemetry {verdict}; worst " + ", ".join(worst_of)
    moments = [r for r in records if r["kind"] in ("exp_avg", "exp_avg_sq")]
    if moments:
        w = max(moments, key=lambda r: r["underflow"])
        line += (
            f"; optimizer-moment underflow {w['underflow']:.2%} ({w['layer']} {w['kind']}) is expected "
            "(docs/training.md, FP8 telemetry)"
        )
    return line
