"""Fixed-seed runs of `fp8lm train` write the committed ``metrics.jsonl`` byte for byte: the
training loop may be restructured, its numbers may not change.

The references in ``tests/data/train_reference/`` were written by this module's commands
(``python tests/test_train_reference.py`` rewrites them) on the machine that ``machine.json``
describes. Float sums depend on the CPU's vector width and on torch, so on another kind of
machine the comparison is skipped, with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parent / "data" / "train_reference"
# One thread per process and no torch.compile: the same float sums in every run.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
COMMON = (
    "--model tiny --steps 12 --eval-every 5 --save-every 6 --batch-size 4 --seq-len 32 --eval-batches 2 "
    "--val-fraction 0.1 --no-progress"
).split()
# name: (ranks, options). O1 samples telemetry and runs the fallback policy; O2 accumulates
# micro-batches; the 2-rank runs sync FP8 gradients (O2) and shard the optimizer (O3).
RUNS = {
    "O1": (1, ["--opt-level", "O1", "--telemetry-every", "4", "--fallback"]),
    "O2": (1, ["--opt-level", "O2", "--grad-accum", "2"]),
    "O2-2ranks": (2, ["--opt-level", "O2", "--grad-accum", "2", "--telemetry-every", "4"]),
    "O3-2ranks": (2, ["--opt-level", "O3", "--telemetry-every", "4"]),
}


def machine() -> dict:
    return {"torch": torch.__version__.split("+")[0], "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def command(name: str, out: Path) -> list[str]:
    ranks, options = RUNS[name]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    corpus = ["--data", str(DATA / "corpus.txt"), "--out", str(out), "--cache-dir", str(out.parent / "cache")]
    return [sys.executable, *launcher, "-m", "fp8lm.cli", "train", *COMMON, *options, *corpus]


def run(name: str, work: Path) -> bytes:
    """The ``metrics.jsonl`` that run ``name`` writes (in a fresh folder under ``work``)."""
    out = work / name
    proc = subprocess.run(command(name, out), env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (out / "metrics.jsonl").read_bytes()


def skip_on_another_machine() -> None:
    written_on = json.loads((DATA / "machine.json").read_text())
    if machine() != written_on:
        pytest.skip(f"references written on {written_on}, this machine is {machine()}")


def test_references_are_runs_of_the_committed_commands():
    assert set(RUNS) == {p.name.removesuffix(".metrics.jsonl") for p in DATA.glob("*.metrics.jsonl")}
    for name in RUNS:
        lines = (DATA / f"{name}.metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(1, 13))


@pytest.mark.slow  # multi-process runs among them
@pytest.mark.parametrize("name", list(RUNS))
def test_fixed_seed_run_writes_the_reference_metrics(tmp_path, name):
    skip_on_another_machine()
    assert run(name, tmp_path) == (DATA / f"{name}.metrics.jsonl").read_bytes()


if __name__ == "__main__":  # rewrite the references (only when the numbers are meant to change)
    work = Path(tempfile.mkdtemp())
    for name in RUNS:
        (DATA / f"{name}.metrics.jsonl").write_bytes(run(name, work))
    (DATA / "machine.json").write_text(json.dumps(machine()) + "\n")
    shutil.rmtree(work)
