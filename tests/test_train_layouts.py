"""Every distributed layout checkpoints and resumes: `fp8lm train` under `--tp 2`, `--pp 2`,
`--pp 2 --fsdp`, `--pp 2` at O3 (FP8 ZeRO per stage) and `--tp 2 --pp 2` (4 ranks) and 3-D (`--tp 2 --pp 2 --fsdp`, 8 ranks), with its
last checkpoint deleted and resumed from the one before,
writes the uninterrupted run's metrics byte for byte; and each layout is one clear line away from
a checkpoint of another."""

import json
import shutil
import subprocess

import pytest

from test_train_distributed import EMAIL, ENV, TIMEOUT_S, check
from test_train_level3 import torchrun

pytestmark = pytest.mark.slow  # multi-rank training processes

STEPS, SAVE_EVERY = 6, 3


def options(out, cache, *extra: str) -> list[str]:
    return [
        "train",
        "--opt-level",
        "O2",
        "--model",
        "tiny",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--steps",
        str(STEPS),
        "--eval-every",
        "3",
        "--eval-batches",
        "2",
        "--save-every",
        str(SAVE_EVERY),
        "--telemetry-every",
        "2",
        "--data",
        EMAIL,
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def train(ranks: int, out, cache, *flags: str) -> subprocess.CompletedProcess:
    args = torchrun(ranks, "-m", "fp8lm.cli", *options(out, cache, *flags))
    return subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=3 * TIMEOUT_S)


def drop_last_checkpoint(run) -> None:
    """The run as a kill right before its final checkpoint would leave it."""
    last = f"step_{STEPS:08d}"
    (run / "checkpoints" / f"{last}.pt").unlink()
    shutil.rmtree(run / "checkpoints" / f"{last}.dcp")
    (run / "summary.json").unlink()


@pytest.mark.parametrize(
    ("ranks", "flags"),
    [
        (2, ("--tp", "2")),
        (2, ("--pp", "2", "--pp-microbatches", "2")),
        (4, ("--pp", "2", "--fsdp")),
        (4, ("--tp", "2", "--pp", "2", "--pp-microbatches", "2")),
        (8, ("--tp", "2", "--pp", "2", "--fsdp", "--pp-microbatches", "2")),
        (4, ("--pp", "2", "--opt-level", "O3", "--pp-microbatches", "2")),
    ],
    ids=["tp2", "pp2", "pp2_fsdp", "tp2_pp2", "3d", "pp2_o3"],
)
def test_a_resumed_run_continues_byte_for_byte(tmp_path, ranks, flags):
    whole, cache = tmp_path / "whole", tmp_path / "cache"
    check(train(ranks, whole, cache, *flags))
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["world_size"] == ranks and summary["skipped_steps"] == 0
    assert (whole / "checkpoints" / f"step_{SAVE_EVERY:08d}.dcp").is_dir()
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    drop_last_checkpoint(resumed)
    check(train(ranks, resumed, cache, *flags, "--resume"))
    assert (resumed / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    assert (resumed / "telemetry.jsonl").read_bytes() == (whole / "telemetry.jsonl").read_bytes()
    if "O3" in flags:  # --tp with O3 is refused before any checkpoint is read
        return
    # another layout cannot read these shards: one line saying which options wrote them
    other = ("--pp", "2", "--pp-microbatches", "2") if "--tp" in flags else ("--tp", "2")
    proc = train(2, resumed, cache, *other, "--resume", "--steps", str(STEPS + 3))
    assert proc.returncode != 0
    assert "resume with the same options" in proc.stdout + proc.stderr
