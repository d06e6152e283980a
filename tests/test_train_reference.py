"""Fixed-seed runs of `fp8lm train` write the committed ``metrics.jsonl`` byte for byte: the
training loop may be restructured, its numbers may not change.

Float sums depend on the CPU's vector width and on torch, so the references are kept per kind
of machine: ``tests/data/train_reference/<torch>-<cpu capability>/`` holds the ``metrics.jsonl``
of each run, written by this module's commands (``python tests/test_train_reference.py``
writes this machine's folder). On a kind of machine without a folder the comparison is skipped,
with the reason; so is a run whose numbers were meant to change since that kind of machine last
wrote its references (the stale file is removed, and the folder holds the others).
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

from dist_launch import forked_ranks

DATA = Path(__file__).resolve().parent / "data" / "train_reference"
CORPUS = DATA / "corpus.txt"
# One thread per process and no torch.compile: the same float sums in every run.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
COMMON = (
    "--model tiny --steps 12 --eval-every 5 --save-every 6 --batch-size 4 --seq-len 32 --eval-batches 2 "
    "--val-fraction 0.1 --no-progress"
).split()
# name: (ranks, options). O1 samples telemetry and runs the fallback policy; O2 accumulates
# micro-batches (telemetry at step 1 only); the 2-rank runs sync FP8 gradients (O2) and shard the optimizer (O3).
RUNS = {
    "O1": (1, ["--opt-level", "O1", "--telemetry-every", "4", "--fallback"]),
    "O2": (1, ["--opt-level", "O2", "--grad-accum", "2", "--telemetry-every", "100", "--activations", "bf16"]),
    "O2-2ranks": (2, ["--opt-level", "O2", "--grad-accum", "2", "--telemetry-every", "4", "--activations", "bf16"]),
    "O3-2ranks": (2, ["--opt-level", "O3", "--telemetry-every", "4"]),
}


def machine() -> str:
    """This kind of machine, as the name of its references' folder (e.g. ``2.13.0-AVX2``)."""
    return f"{torch.__version__.split('+')[0]}-{torch.backends.cpu.get_cpu_capability()}"


def reference_folders() -> list[Path]:
    return sorted(p for p in DATA.iterdir() if p.is_dir())


def command(name: str, out: Path) -> list[str]:
    ranks, options = RUNS[name]
    corpus = ["--data", str(CORPUS), "--out", str(out), "--cache-dir", str(out.parent / "cache")]
    args = ["-m", "fp8lm.cli", "train", *COMMON, *options, *corpus]
    return forked_ranks(ranks, *args) if ranks > 1 else [sys.executable, *args]


def run(name: str, work: Path) -> bytes:
    """The ``metrics.jsonl`` that run ``name`` writes (in a fresh folder under ``work``)."""
    out = work / name
    proc = subprocess.run(command(name, out), env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (out / "metrics.jsonl").read_bytes()


def this_machines_reference(name: str) -> Path:
    path = DATA / machine() / f"{name}.metrics.jsonl"
    if not path.is_file():
        kinds = [p.name for p in reference_folders() if (p / path.name).is_file()]
        pytest.skip(f"no reference of {name} for {machine()} (there are {kinds}): `python {__file__}` writes them")
    return path


def runs_in(folder: Path) -> set[str]:
    return {p.name.removesuffix(".metrics.jsonl") for p in folder.glob("*.metrics.jsonl")}


def test_references_are_runs_of_the_committed_commands():
    assert reference_folders(), "no reference folder"
    assert any(runs_in(folder) == set(RUNS) for folder in reference_folders()), "no folder holds every run"
    for folder in reference_folders():
        assert runs_in(folder) and runs_in(folder) <= set(RUNS), folder.name
        for name in runs_in(folder):
            lines = (folder / f"{name}.metrics.jsonl").read_text().splitlines()
            assert [json.loads(line)["step"] for line in lines] == list(range(1, 13))


def test_the_same_run_differs_only_in_float_sums_across_machines():
    """Every kind of machine's references log the same steps and fields, and losses that agree to
    float sums' drift (1e-3, several times the AVX2/AVX-512 difference): references written by
    different code would not."""
    for name in RUNS:
        folders = [f for f in reference_folders() if name in runs_in(f)]
        runs = [[json.loads(line) for line in (f / f"{name}.metrics.jsonl").read_text().splitlines()] for f in folders]
        for other in runs[1:]:
            assert [sorted(line) for line in other] == [sorted(line) for line in runs[0]]
            for a, b in zip(runs[0], other):
                assert abs(a["train_loss"] - b["train_loss"]) < 1e-3 * a["train_loss"], (name, a["step"])


@pytest.mark.slow  # multi-process runs among them
@pytest.mark.parametrize("name", list(RUNS))
def test_fixed_seed_run_writes_the_reference_metrics(tmp_path, name):
    reference = this_machines_reference(name)
    assert run(name, tmp_path) == reference.read_bytes()


if __name__ == "__main__":  # (re)write this machine's references (only when the numbers are meant to change)
    work = Path(tempfile.mkdtemp())
    (DATA / machine()).mkdir(exist_ok=True)
    for name in RUNS:
        (DATA / machine() / f"{name}.metrics.jsonl").write_bytes(run(name, work))
    shutil.rmtree(work)
