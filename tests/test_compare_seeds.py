"""`fp8lm compare --seeds`: every level at each seed, gaps to bf16 per seed, mean and spread."""

import json
import statistics
import sysconfig
from pathlib import Path

import pytest

from cli_helpers import run_main
from fp8lm.train.compare import aggregate_seeds, paired_difference, parse_seeds
from fp8lm.train.config import RunError
from fp8lm.train.report import format_seed_table

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--no-progress"]


def _row(val_loss, gap):
    return {
        "val_loss": val_loss,
        "rel_gap_vs_bf16": gap,
        "train_loss": val_loss,
        "bytes_per_param": 6.0,
        "act_bytes_per_token": 100.0,
        "tokens_per_s": 10.0,
        "skipped_steps": 1,
    }


def test_aggregate_seeds_means_and_spreads_the_gaps():
    per_seed = {
        0: {"bf16": _row(2.0, 0.0), "O2": _row(2.02, 0.01)},
        1: {"bf16": _row(2.1, 0.0), "O2": _row(2.079, -0.01)},
        2: {"bf16": _row(1.9, 0.0), "O2": _row(1.957, 0.03)},
    }
    rows = aggregate_seeds(per_seed)
    o2 = rows["O2"]
    assert o2["gaps_vs_bf16"] == {"0": 0.01, "1": -0.01, "2": 0.03}
    assert o2["rel_gap_vs_bf16"] == pytest.approx(0.01)
    assert o2["gap_std"] == pytest.approx(statistics.stdev([0.01, -0.01, 0.03]))
    assert (o2["gap_min"], o2["gap_max"]) == (-0.01, 0.03)
    assert o2["val_loss"] == pytest.approx((2.02 + 2.079 + 1.957) / 3)
    assert o2["skipped_steps"] == 3
    assert rows["bf16"]["gap_std"] == 0.0


def test_aggregate_seeds_pairs_each_level_with_fp32_seed_by_seed():
    per_seed = {
        0: {"fp32": _row(1.99, -0.005), "bf16": _row(2.0, 0.0), "O2": _row(2.02, 0.01)},
        1: {"fp32": _row(2.1, 0.0), "bf16": _row(2.1, 0.0), "O2": _row(2.079, -0.01)},
        2: {"fp32": _row(1.938, 0.02), "bf16": _row(1.9, 0.0), "O2": _row(1.957, 0.03)},
    }
    rows = aggregate_seeds(per_seed)
    diffs = [0.015, -0.01, 0.01]  # O2's gap minus fp32's, per seed
    o2 = rows["O2"]["minus_fp32"]
    assert o2["seeds"] == 3
    assert o2["mean"] == pytest.approx(statistics.fmean(diffs))
    assert o2["std"] == pytest.approx(statistics.stdev(diffs))
    assert o2["stderr"] == pytest.approx(statistics.stdev(diffs) / 3**0.5)
    assert rows["fp32"]["minus_fp32"]["mean"] == 0.0
    assert rows["bf16"]["minus_fp32"]["mean"] == pytest.approx(-statistics.fmean([-0.005, 0.0, 0.02]))
    table = format_seed_table(rows, [0, 1, 2])
    o2_line = next(line for line in table.splitlines() if line.startswith("O2"))
    assert "- fp32 (+- se)" in table and f"+{statistics.fmean(diffs):.2%} +- " in o2_line
    # without fp32 there is nothing to pair with: no column
    assert "minus_fp32" not in aggregate_seeds({0: {"bf16": _row(2.0, 0.0)}})["bf16"]
    assert "- fp32" not in format_seed_table(aggregate_seeds({0: {"bf16": _row(2.0, 0.0)}}), [0])


def test_paired_difference_skips_seeds_missing_on_either_side():
    d = paired_difference({"0": 0.02, "1": None, "2": 0.01}, {"0": 0.01, "1": 0.0})
    assert d == {"mean": pytest.approx(0.01), "std": None, "stderr": None, "seeds": 1}
    assert paired_difference({}, {})["mean"] is None


@pytest.mark.parametrize("spec", ["", "a,b", "1,1", "-1", "0,,x"])
def test_parse_seeds_refuses_bad_lists(spec):
    with pytest.raises(RunError, match="--seeds"):
        parse_seeds(spec)


def test_parse_seeds():
    assert parse_seeds("0, 1,2") == [0, 1, 2]


@pytest.mark.slow
def test_compare_over_seeds_reports_each_gap_mean_and_spread(tmp_path, capsys):
    out_dir = tmp_path / "cmp"
    argv = [
        "compare",
        *TINY,
        "--data",
        EMAIL,
        "--levels",
        "bf16,fp32",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--seeds",
        "3,5",
        "--out",
        str(out_dir),
    ]
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    result = json.loads((out_dir / "compare.json").read_text())
    assert result["seeds"] == [3, 5]
    fp32 = result["levels"]["fp32"]
    per_seed = {}
    for seed in (3, 5):
        one = json.loads((out_dir / f"seed{seed}" / "compare.json").read_text())["levels"]
        per_seed[str(seed)] = one["fp32"]["rel_gap_vs_bf16"]
        assert json.loads((out_dir / f"seed{seed}" / "fp32" / "summary.json").read_text())["config"]["seed"] == seed
    assert fp32["gaps_vs_bf16"] == per_seed
    assert fp32["rel_gap_vs_bf16"] == pytest.approx(statistics.fmean(per_seed.values()))
    assert fp32["gap_std"] == pytest.approx(statistics.stdev(per_seed.values()))
    assert per_seed["3"] != per_seed["5"]  # different seeds train different runs
    assert (out_dir / "loss.png").stat().st_size > 10_000
    assert "seed 3" in out and "seed 5" in out and "mean" in out and "std" in out
    # --resume keeps finished seeds and levels
    before = (out_dir / "seed3" / "bf16" / "summary.json").read_bytes()
    rc, _, err = run_main([*argv, "--resume"], capsys)
    assert rc == 0, err
    assert (out_dir / "seed3" / "bf16" / "summary.json").read_bytes() == before
