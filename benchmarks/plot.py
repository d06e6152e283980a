"""Plot the train_step benchmark: step time relative to BF16 and training-state bytes per
parameter, per level and model size.

    python benchmarks/plot.py results/train_step_cpu.json [--out results/train_step_cpu.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="JSON written by train_step.py")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: beside the JSON)")
    args = parser.parse_args()
    data = json.loads(args.result.read_text())
    sizes = data["sizes"]
    levels = [lv for lv in data["levels"] if all(lv in s["step_ms"] for s in sizes)]
    fig, (ax_time, ax_mem, ax_act) = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(levels)
    labels = [f"{s['size']}\n{s['num_params'] / 1e6:.1f}M" for s in sizes]
    for i, level in enumerate(levels):
        xs = [j + i * width for j in range(len(sizes))]
        ax_time.bar(xs, [s["ratio_to_bf16"][level] for s in sizes], width, label=level)
        ax_mem.bar(xs, [s["bytes_per_param"][level] for s in sizes], width, label=level)
        ax_act.bar(xs, [s["act_bytes_per_token"][level] / 1024 for s in sizes], width, label=level)
    for ax, title in (
        (ax_time, "step time / BF16 autocast"),
        (ax_mem, "training state, bytes per parameter"),
        (ax_act, "activations saved for backward, KiB per token"),
    ):
        ax.set_xticks([j + width * (len(levels) - 1) / 2 for j in range(len(sizes))], labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    ax_time.axhline(1.0, color="black", linewidth=0.8)
    ax_mem.legend(loc="lower left", fontsize=8)
    device = data.get("device", "")
    fig.suptitle(
        f"fp8lm vs baselines on {device} ({data['machine'].get('processor', '')}, {data['machine'].get('cpu_count')} cores)"
    )
    fig.tight_layout()
    out = args.out or args.result.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
