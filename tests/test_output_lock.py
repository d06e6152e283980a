"""The run folder's lock is taken before any check or write of ``--out``: a second run on the same
folder is refused in one line whatever the folder holds, and leaves the first run's files as
they were; a run that fails before training leaves no folder it created."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8lm.train.config import RunError, TrainConfig
from fp8lm.train.data import DataError
from fp8lm.train.loop import train
from fp8lm.train.resume import lock_output


def _hashes(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture
def finished(tmp_path, tiny_run, token_cache):
    out = tmp_path / "run"
    train(TrainConfig(**{**tiny_run, "steps": 1, "out": str(out), "cache_dir": token_cache}))
    return out


@pytest.mark.parametrize("resume", [False, True])
def test_a_held_lock_refuses_before_the_folder_is_looked_at(finished, tiny_run, token_cache, resume):
    before = _hashes(finished)
    held = lock_output(finished)  # a first run still writing its summary
    try:
        cfg = {**tiny_run, "steps": 2, "out": str(finished), "cache_dir": token_cache, "resume": resume}
        # without the lock first, this run would be judged by the folder's state (a finished run)
        with pytest.raises(RunError, match=f"is in use by another run \\(pid {os.getpid()}\\)"):
            train(TrainConfig(**cfg))
    finally:
        held.close()
    assert _hashes(finished) == before


def test_a_run_refused_before_training_leaves_no_folder(tmp_path, tiny_run, token_cache):
    out = tmp_path / "new"
    with pytest.raises(DataError):
        train(TrainConfig(**{**tiny_run, "out": str(out), "data": str(tmp_path / "missing.txt")}))
    assert not out.exists()
    train(TrainConfig(**{**tiny_run, "steps": 1, "out": str(out), "cache_dir": token_cache}))  # lock released


def test_two_runs_started_together_one_runs_one_is_refused(tmp_path, email_corpus, token_cache):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fp8lm.cli", "train", "--model", "tiny", "--batch-size", "2", "--seq-len", "16"]
    argv += ["--steps", "2", "--eval-batches", "1", "--data", email_corpus, "--cache-dir", token_cache]
    argv += ["--out", str(out), "--no-progress", "--telemetry-every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    refused = next(err for rc, _, err in results if rc == 2)
    assert refused.count("\n") == 1 and refused.startswith("fp8lm train: error: "), refused
    records = (out / "metrics.jsonl").read_text().splitlines()
    assert [r.split(",")[0] for r in records] == ['{"step": 1', '{"step": 2']
