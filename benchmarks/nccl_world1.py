"""The distributed code path of `fp8lm train` on one GPU with NCCL: ``torchrun --nproc_per_node 1``
for each data-parallel layout (FP8DataParallel at O2, FP8 ZeRO at O3, FSDP2 at O2, with the
tensorwise and the rowwise recipe, torch's DDP at bf16), a few steps each. A world of one rank still builds the mesh and issues every collective,
on the process group ``cuda:nccl,cpu:gloo``: a CPU tensor handed to NCCL fails here.

    python benchmarks/nccl_world1.py [--device cuda] [--steps 20]

Prints one JSON object: per layout the exit status, the process group's backend, the final
validation loss, skipped steps and the last error line of a failed run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

LAYOUTS = {
    "dp_O2": ("O2", []),
    "zero_O3": ("O3", []),
    "fsdp_O2": ("O2", ["--fsdp"]),
    "fsdp_O2_rowwise": ("O2", ["--fsdp", "--recipe", "rowwise"]),  # one rank: the weights stay as stored
    "ddp_bf16": ("bf16", []),
}


def run(name: str, level: str, flags: list[str], args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / name
    data = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        "-m", "fp8lm.cli", "train", "--opt-level", level, "--model", "tiny", "--steps", str(args.steps),
        "--batch-size", "8", "--seq-len", "64", "--eval-every", str(args.steps), "--eval-batches", "2",
        "--save-every", str(args.steps // 2), "--device", args.device, "--data", data,
        "--cache-dir", str(tmp / "cache"), "--out", str(out), "--no-progress", *flags,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result: dict = {"returncode": proc.returncode}
    if proc.returncode == 0:
        summary = json.loads((out / "summary.json").read_text())
        result.update({k: summary.get(k) for k in ("backend", "val_loss", "skipped_steps", "world_size")})
    else:
        lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()] or proc.stderr.splitlines()
        result["error"] = lines[-1] if lines else ""
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(name, level, flags, args, Path(tmp)) for name, (level, flags) in LAYOUTS.items()}
    print(json.dumps({"benchmark": "nccl_world1", "layouts": runs, "machine": machine()}, indent=1))
    sys.exit(0 if all(r["returncode"] == 0 for r in runs.values()) else 1)


if __name__ == "__main__":
    main()
