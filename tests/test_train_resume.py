"""kill -9 in the middle of `fp8lm train`, then --resume: the metrics (every step's loss, every
validation loss) equal the uninterrupted run's bit for bit."""

import os
import signal
import subprocess
import sys
import time

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same thread count in every process: same float sums


def fp8lm_train(out, cache, level, *extra):
    return [
        sys.executable,
        "-m",
        "fp8lm.cli",
        "train",
        "--model",
        "tiny",
        "--opt-level",
        level,
        "--steps",
        "60",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--eval-every",
        "20",
        "--eval-batches",
        "2",
        "--save-every",
        "10",
        "--keep-checkpoints",
        "2",
        "--out",
        str(out),
        "--cache-dir",
        str(cache),
        "--no-progress",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O2"])  # the level with the most state; in-process tests cover the others
def test_kill_9_then_resume_matches_the_uninterrupted_run(tmp_path, level):
    cache = tmp_path / "cache"
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # The uninterrupted run goes alongside the one to be killed (its own cache: no shared files).
    whole_log = open(tmp_path / "whole.log", "wb")
    uninterrupted = subprocess.Popen(
        fp8lm_train(whole, tmp_path / "cache-whole", level), env=ENV, stdout=whole_log, stderr=subprocess.STDOUT
    )
    proc = subprocess.Popen(
        fp8lm_train(killed, cache, level), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    first_checkpoint = killed / "checkpoints" / "step_00000010.pt"
    deadline = time.monotonic() + 120
    while not first_checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "summary.json").exists()

    subprocess.run(fp8lm_train(killed, cache, level, "--resume"), env=ENV, check=True, capture_output=True)
    assert uninterrupted.wait() == 0, (tmp_path / "whole.log").read_text()
    whole_log.close()
    assert (killed / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    assert (killed / "summary.json").exists()
