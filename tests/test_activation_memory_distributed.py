"""FP8-saved activations and activation checkpointing on 2 ranks: under FSDP2 (`--fsdp`) and under
tensor + sequence parallelism (`--tp 2`, where the norms see sequence-sharded DTensors), a run with
`--activation-checkpointing full` trains as the run without, bit for bit (the recomputation gives
the forward's tensors: the same losses and gradient norms), and saves fewer activation bytes.
Under tensor parallelism the recomputation runs its collectives again: more bytes on the wire."""

import json
import os
import subprocess
import sysconfig
from pathlib import Path

import pytest

from dist_launch import forked_ranks

pytestmark = pytest.mark.slow  # multi-rank training processes

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}


def train(out: Path, cache: Path, *flags: str) -> dict:
    args = forked_ranks(2)
    args += ["-m", "fp8lm.cli", "train", "--opt-level", "O2", "--model", "tiny", "--batch-size", "8"]
    args += ["--seq-len", "32", "--steps", "4", "--eval-every", "2", "--eval-batches", "2", "--data", EMAIL]
    args += ["--cache-dir", str(cache), "--out", str(out), "--no-progress", "--activations", "fp8", *flags]
    proc = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def drop(record: dict, keys: list[str]) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


@pytest.mark.parametrize(("layout", "arch"), [("--fsdp", "gpt"), ("--tp", "llama")])
def test_checkpointed_fp8_activations_train_as_without_checkpointing(tmp_path, layout, arch):
    flags = (layout, "2") if layout == "--tp" else (layout,)
    flags += ("--arch", arch)
    cache = tmp_path / "cache"
    plain = train(tmp_path / "none", cache, *flags)
    full = train(tmp_path / "full", cache, *flags, "--activation-checkpointing", "full")
    none_records, full_records = (metrics(tmp_path / run) for run in ("none", "full"))
    comm = [key for key in none_records[0] if key.startswith("comm_")]
    assert [drop(r, comm) for r in none_records] == [drop(r, comm) for r in full_records]
    assert all(f["comm_bytes"] >= n["comm_bytes"] for n, f in zip(none_records, full_records))
    if layout == "--tp":
        assert full_records[0]["comm_bytes"] > none_records[0]["comm_bytes"]
    assert full["act_bytes_per_token"] < 0.7 * plain["act_bytes_per_token"]
    assert plain["layout"] == full["layout"] and plain["world_size"] == 2
