"""Resharding resume through the CLI: `fp8lm train` at ``--tp 2 --pp 2`` on 4 ranks, saved halfway;
the same run resumed from there at ``--fsdp`` on 2 ranks and in one process; the final validation
loss of each against the uninterrupted run's.

    python benchmarks/reshard.py --steps 100 [--preset tiny] [--level O2]

Prints one JSON object: the uninterrupted run's validation loss, and per resumed layout its
validation loss, the gap to the uninterrupted one and the line the resumed run printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SAVED = ("--tp", "2", "--pp", "2", "--pp-microbatches", "2")
RESUMED = {"fsdp_2_ranks": (2, ["--fsdp"]), "one_process": (1, [])}


def train(ranks: int, out: Path, args: argparse.Namespace, *flags: str) -> str:
    data = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    cmd = [
        sys.executable, *launch, "-m", "fp8lm.cli", "train", "--opt-level", args.level, "--model", args.preset,
        "--steps", str(args.steps), "--save-every", str(args.steps // 2), "--keep-checkpoints", "4",
        "--eval-every", str(args.steps // 2), "--data", data, "--cache-dir", str(out.parent / "cache"),
        "--out", str(out), "--no-progress", *flags,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1]}")
    return proc.stdout


def val_loss(run: Path) -> float:
    return json.loads((run / "summary.json").read_text())["val_loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--level", default="O2")
    args = ap.parse_args()
    result: dict = {"benchmark": "reshard", "steps": args.steps, "preset": args.preset, "level": args.level}
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole"
        train(4, whole, args, *SAVED)
        result["uninterrupted"] = {"layout": "--tp 2 --pp 2 (4 ranks)", "val_loss": val_loss(whole)}
        for name, (ranks, flags) in RESUMED.items():
            run = Path(tmp) / name
            shutil.copytree(whole, run)
            last = f"step_{args.steps:08d}"
            (run / "checkpoints" / f"{last}.pt").unlink()
            shutil.rmtree(run / "checkpoints" / f"{last}.dcp")
            (run / "summary.json").unlink()
            out = train(ranks, run, args, *flags, "--resume")
            line = next((x for x in out.splitlines() if "resharded" in x), "")
            loss = val_loss(run)
            gap = loss / result["uninterrupted"]["val_loss"] - 1
            result[name] = {"val_loss": loss, "gap_to_uninterrupted": gap, "printed": line.strip()}
    result["machine"] = machine()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
