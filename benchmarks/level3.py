"""FP8-LM's Level 3 through the CLI: `fp8lm compare` in every parallel layout (``--fsdp``,
``--tp``, ``--pp`` and their combinations, 3-D on 8 ranks) under torchrun, against the same
comparison in one process.

Each layout trains the GPT at bf16 (the baseline: BF16 activations and gradients on the
tensor- and pipeline-parallel wires, FP32 gradient averaging over the data-parallel ranks as DDP
sends it, or FSDP2's BF16 collectives) and at O1 (FP8 on every wire) with `fp8lm train`'s
defaults (global batch 16, AdamW 3e-3, warmup and cosine decay, clip 1.0). Both levels' bytes are
measured the same way: `comm_stats`, every collective and point-to-point byte rank 0 sends,
torch's own functional collectives (DTensor, ``loss_parallel``, FSDP2) included. Prints one JSON
object: per layout and level the validation loss after the last step, its gap to one process at
the same level, and the bytes per step (total, handed to the process group, by kind); per layout
each FP8 level's bytes over bf16's (``o1_over_bf16_bytes``; ``--levels bf16,O1,O2`` adds O2: FSDP2
gathers both levels' FP8 GEMM weights in E4M3, and O2's embeddings and output head in their
scaled FP16 where O1's travel in FP32)::

    python benchmarks/level3.py --layout single --steps 200
    python benchmarks/level3.py --layout tp --steps 200        # torchrun, 4 ranks: dp 2 x tp 2
    python benchmarks/level3.py --layout pp --steps 200        # dp 2 x pp 2
    python benchmarks/level3.py --layout tp-fsdp --steps 200 --levels bf16  # FSDP2 on dp 2 x TP on tp 2
    python benchmarks/level3.py --layout all --levels bf16,fp32,O1,O2 --steps 200 --results FILE

Per layout and level it also reports the step time against one process (``time_vs_one_process``:
tokens per second of one process over the layout's, all ranks sharing this machine's cores).

A layout's result is kept in ``OUT/<layout>/``; a later run with other ``--levels`` and the same
``OUT`` adds its levels to the layouts (the results name both commands); with ``--results FILE`` the layouts found in
``OUT`` are gathered into one JSON file (the single-process one is the reference of the gaps);
``--merge`` keeps the layouts and levels FILE already holds that ``OUT`` lacks (its one-process
reference too), each with the gap and step time to one process it was saved with, so one layout,
or one level of a layout, can be added to or retrained in a table::

    python benchmarks/level3.py --layout tp-o3 --levels O3 --results FILE --merge
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, machine  # noqa: E402

LEVELS = ("bf16", "fp32", "O1", "O2", "O3")
FP8_LEVELS = ("O1", "O2", "O3")
# layout -> the flags of fp8lm compare and its rank count
LAYOUTS = {
    "single": ([], 1),
    "fsdp": (["--fsdp"], 4),
    "tp": (["--tp", "2"], 4),
    "pp": (["--pp", "2"], 4),
    "tp-fsdp": (["--tp", "2", "--fsdp"], 4),
    "pp-fsdp": (["--pp", "2", "--fsdp"], 4),
    "tp-pp": (["--tp", "2", "--pp", "2"], 4),
    "3d": (["--tp", "2", "--pp", "2", "--fsdp"], 8),
    "dp-o3": ([], 4),  # FP8 ZeRO over 4 ranks (O3 only)
    "pp-o3": (["--pp", "2"], 4),  # FP8 ZeRO per stage (O3 only)
    "tp-o3": (["--tp", "2"], 4),  # FP8 ZeRO over each tensor-parallel part, dp 2 x tp 2 (O3 only)
    "tp-pp-o3": (["--tp", "2", "--pp", "2"], 4),  # O3 in 3-D: tp 2 x pp 2 (O3 only)
}


def command(layout: str, args: argparse.Namespace) -> list[str]:
    """The command that trains ``layout``'s comparison."""
    cli = [
        "-m",
        "fp8lm.cli",
        "compare",
        "--levels",
        args.levels,
        "--model",
        args.preset,
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--cache-dir",
        str(Path(args.out) / "cache"),
        "--out",
        str(Path(args.out) / layout),
        "--no-progress",
        *LAYOUTS[layout][0],
    ]
    if layout == "single":
        return [sys.executable, *cli]
    ranks = str(LAYOUTS[layout][1])
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", ranks, *cli]


def commands_of(folder: Path) -> list[list[str]]:
    """The commands that trained ``folder``'s levels (``command.json``: one per ``--levels`` set, a
    later set of levels added to the same folder; a folder of one command holds that command)."""
    path = folder / "command.json"
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    return saved if saved and isinstance(saved[0], list) else [saved]


def level_result(summary: dict) -> dict:
    return {
        "val_loss": summary["val_loss"],
        "train_loss": summary["train_loss"],
        "world_size": summary["world_size"],
        "comm_bytes_per_step": summary["comm_bytes_per_step"],
        "comm_handed_bytes_per_step": summary.get("comm_handed_bytes_per_step", 0.0),
        "comm_bytes_by_kind_per_step": summary.get("comm_bytes_by_kind_per_step", {}),
        "tokens_per_s": summary["tokens_per_s"],
        "skipped_steps": summary["skipped_steps"],
    }


def gather(out: Path, known: dict | None = None) -> dict:
    """Every trained layout in ``out`` (and in ``known``, those ``out`` lacks): levels, gaps to one
    process, byte ratios."""
    layouts = {layout: {**result, "levels": dict(result["levels"])} for layout, result in (known or {}).items()}
    for layout in LAYOUTS:
        folder = out / layout
        done = [level for level in LEVELS if (folder / level / "summary.json").exists()]
        if not done:
            continue
        levels = {level: level_result(json.loads((folder / level / "summary.json").read_text())) for level in done}
        commands = ["python " + " ".join(c) for c in commands_of(folder)]
        if layout in layouts:  # levels out lacks stay as known has them, with the command that trained them
            levels = {**layouts[layout]["levels"], **levels}
            kept = layouts[layout]["command"].split(" && ")
            commands = kept + [c for c in commands if c not in kept]  # a folder merged again is named once
        layouts[layout] = {"command": " && ".join(commands), "levels": levels}
    single = layouts.get("single")
    for layout, result in layouts.items():
        levels = result["levels"]
        if single is not None and layout != "single":
            for level, r in levels.items():
                one = single["levels"].get(level)
                # a level kept from the table keeps its gap to the one-process run of its own time
                if one is not None and "val_loss_vs_one_process" not in r:
                    r["val_loss_vs_one_process"] = r["val_loss"] / one["val_loss"] - 1
                    r["time_vs_one_process"] = one["tokens_per_s"] / r["tokens_per_s"]
        base = levels.get("bf16", {}).get("comm_bytes_per_step")
        for level in (lv for lv in FP8_LEVELS if lv in levels and base):
            result[f"{level.lower()}_over_bf16_bytes"] = levels[level]["comm_bytes_per_step"] / base
    return layouts


def train(layout: str, args: argparse.Namespace, out: Path) -> None:
    """Train ``layout``'s comparison at the asked levels it runs (O3 only in the ZeRO layouts)."""
    zero = layout.endswith("o3")
    levels = [lv for lv in args.levels.split(",") if (lv == "O3") == zero or (layout == "single" and lv == "O3")]
    if not levels:
        return
    cmd = command(layout, argparse.Namespace(**{**vars(args), "levels": ",".join(levels)}))
    (out / layout).mkdir(parents=True, exist_ok=True)
    commands = [c for c in commands_of(out / layout) if c != cmd[1:]] + [cmd[1:]]
    (out / layout / "command.json").write_text(json.dumps(commands))
    print(f"== {layout}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--layout", choices=[*LAYOUTS, "all"], help="train this layout's comparison first (all: every layout)"
    )
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument(
        "--levels", default="bf16,O1", help=f"the levels to train, of {','.join(LEVELS)} (default: %(default)s)"
    )
    ap.add_argument("--out", default="runs/level3")
    ap.add_argument("--results", help="write the gathered layouts to this JSON file too")
    ap.add_argument(
        "--merge", action="store_true", help="keep the layouts and levels --results already holds that OUT lacks"
    )
    args = ap.parse_args()
    out = Path(args.out)
    for layout in LAYOUTS if args.layout == "all" else [args.layout] if args.layout else []:
        train(layout, args, out)
    known = None
    if args.merge and args.results and Path(args.results).exists():
        saved = json.loads(Path(args.results).read_text())
        if (saved["preset"], saved["steps"]) != (args.preset, args.steps):
            raise SystemExit(
                f"--merge: {args.results} holds {saved['preset']} x {saved['steps']} steps, not this run's"
            )
        known = saved["layouts"]
    result = {"benchmark": "level3", "preset": args.preset, "steps": args.steps, "layouts": gather(out, known)}
    result["machine"] = machine()
    emit(result, args.results)


if __name__ == "__main__":
    main()
