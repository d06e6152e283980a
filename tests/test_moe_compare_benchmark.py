"""benchmarks/moe.py --compare-only: per level the mean gap to bf16 over an `fp8lm compare --seeds`
run's seeds and, per seed, the router's load balance, read from the run's own files."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "moe.py"


@pytest.mark.slow  # two levels x two seeds of training, in subprocesses
def test_compare_only_summarizes_each_seeds_loss_and_load_balance(tmp_path, tiny_cli_args, email_corpus, token_cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "cmp"
    moe = ["--moe-experts", "4", "--moe-top-k", "2", "--levels", "bf16,O2", "--seeds", "0,1"]
    run = [*tiny_cli_args, "--steps", "3", "--eval-every", "3", "--data", email_corpus, "--cache-dir", token_cache]
    args = [sys.executable, "-m", "fp8lm.cli", "compare", *moe, *run, "--out", str(out), "--device", "cpu"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]

    results = tmp_path / "moe.json"
    args = [sys.executable, str(SCRIPT), "--compare-only", "--compare", str(out), "--results", str(results)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(results.read_text())
    assert set(result) == {"machine", "compare"}  # no timing
    summary = result["compare"]
    per_seed = summary["load_balance_per_seed"]
    assert set(per_seed) == {"bf16", "O2"} and all(set(seeds) == {"0", "1"} for seeds in per_seed.values())
    for level, seeds in per_seed.items():
        for seed, row in seeds.items():
            run_summary = json.loads((out / f"seed{seed}" / level / "summary.json").read_text())
            assert row["final_val_loss"] == run_summary["val_loss"]
            assert row["max_over_mean"] >= 1 and row["cv"] >= 0  # the busiest expert takes at least the mean
    gaps = [per_seed["O2"][s]["final_val_loss"] / per_seed["bf16"][s]["final_val_loss"] - 1 for s in ("0", "1")]
    assert summary["gap_vs_bf16"]["bf16"] == 0
    assert abs(summary["gap_vs_bf16"]["O2"] - statistics.fmean(gaps)) < 1e-12


def test_compare_only_needs_a_compare_folder():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--compare-only"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--compare-only needs --compare DIR" in proc.stderr
