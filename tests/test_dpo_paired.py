"""benchmarks/dpo_paired.py and `fp8lm.train.dpo.finished_run`: the paired statistics against
hand-computed float64 values, and a finished run reopened that scores its held-out pairs as the run
itself did."""

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from fp8lm.cli import main
from fp8lm.train.config import RunError
from fp8lm.train.data import DataError
from fp8lm.train.dpo import finished_run
from fp8lm.train.model import GPT, preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dpo_paired  # noqa: E402


def test_mcnemar_exact_p():
    assert dpo_paired.mcnemar_exact_p(0, 0) == 1.0
    assert dpo_paired.mcnemar_exact_p(1, 9) == pytest.approx(2 * (1 + 10) / 2**10)  # C(10,0) + C(10,1)
    assert dpo_paired.mcnemar_exact_p(9, 1) == dpo_paired.mcnemar_exact_p(1, 9)
    assert dpo_paired.mcnemar_exact_p(5, 5) == 1.0  # an even split: capped at 1
    assert dpo_paired.mcnemar_exact_p(0, 3) == pytest.approx(2 / 8)


def test_one_seed_counts_difference_and_paired_error():
    # 10 pairs: both right on 5, both wrong on 1, baseline only on 1, candidate only on 3
    base = torch.tensor([1.0, 2.0, 0.5, 0.1, 3.0, -1.0, 0.2, -0.3, -0.1, -2.0])
    cand = torch.tensor([0.5, 2.5, 0.4, 0.3, 2.0, -0.5, -0.4, 0.3, 0.2, 1.0])
    r = dpo_paired.paired_difference(base, cand, target=0.02)
    assert r["pairs"] == 10 and r["seeds"] == 1
    assert r["discordant"] == {"baseline_only": 1, "candidate_only": 3}
    assert r["baseline_accuracy"] == pytest.approx(0.6) and r["candidate_accuracy"] == pytest.approx(0.8)
    assert r["accuracy_difference"] == pytest.approx(0.2)
    se = math.sqrt(1 + 3 - (3 - 1) ** 2 / 10) / 10  # the classical paired (McNemar) standard error
    assert r["paired_standard_error"] == pytest.approx(se, rel=1e-12)
    assert r["interval_95"] == pytest.approx([0.2 - 1.959964 * se, 0.2 + 1.959964 * se], rel=1e-12)
    assert r["unpaired_standard_error"] == pytest.approx(math.sqrt((0.6 * 0.4 + 0.8 * 0.2) / 10), rel=1e-12)
    diffs = cand.double() - base.double()
    assert r["margin_difference"]["mean"] == pytest.approx(float(diffs.mean()), rel=1e-12)
    assert r["margin_difference"]["std"] == pytest.approx(float(diffs.std()), rel=1e-12)
    assert r["interval_within_target"] is False


def test_a_zero_margin_is_wrong_and_identical_policies_match_exactly():
    base = torch.tensor([0.0, 1.0, -1.0, 2.0])
    r = dpo_paired.paired_difference(base, base.clone(), target=0.02)
    assert r["baseline_accuracy"] == 0.5  # a tie counts as wrong, as DPOTerms.accuracy counts it
    assert r["accuracy_difference"] == 0 and r["paired_standard_error"] == 0
    assert r["interval_within_target"] is True


def test_seeds_pool_per_pair_differences():
    base = torch.tensor([[1.0, 1.0, -1.0, 1.0], [1.0, -1.0, -1.0, 1.0]])
    cand = torch.tensor([[1.0, -1.0, 1.0, 1.0], [-1.0, -1.0, 1.0, 1.0]])
    r = dpo_paired.paired_difference(base, cand, target=0.5)
    # candidate minus baseline correctness per pair: seed 0 (0, -1, 1, 0), seed 1 (-1, 0, 1, 0)
    per_pair = [-0.5, -0.5, 1.0, 0.0]  # their mean over the seeds
    assert r["seeds"] == 2 and r["pairs"] == 4
    assert r["accuracy_difference"] == 0.0
    assert r["paired_standard_error"] == pytest.approx(math.sqrt(sum(d * d for d in per_pair) / 4 / 4), rel=1e-12)
    assert r["discordant"] == {"baseline_only": 2, "candidate_only": 2}
    assert r["baseline_accuracy"] == 0.625 and r["candidate_accuracy"] == 0.625


def test_script_refuses_a_folder_without_a_finished_run(tmp_path, monkeypatch, capsys):
    for argv, message in (
        (["--baseline", str(tmp_path), "--candidate", str(tmp_path)], "no finished fp8lm dpo run (no summary.json)"),
        (["--baseline", str(tmp_path), str(tmp_path), "--candidate", str(tmp_path)], "one of each per seed"),
    ):
        monkeypatch.setattr(sys, "argv", ["dpo_paired.py", *argv])
        with pytest.raises(SystemExit) as exit_:
            dpo_paired.main()
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, err
    (tmp_path / "summary.json").write_text(json.dumps({"config": {"opt_level": "O2"}}))  # fp8lm train's
    with pytest.raises(RunError, match="not the summary of an fp8lm dpo run"):
        finished_run(tmp_path)


def test_margins_of_other_pairs_are_refused():
    with pytest.raises(ValueError, match="the same held-out pairs"):
        dpo_paired.paired_difference(torch.ones(5), torch.ones(6), 0.02)
    with pytest.raises(ValueError, match="non-empty"):
        dpo_paired.paired_difference(torch.ones(0), torch.ones(0), 0.02)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished 2-step ``fp8lm dpo`` runs (bf16, O2) of a tiny GPT on 60 arithmetic pairs
    (12 held out), and a third on other pairs."""
    root = tmp_path_factory.mktemp("paired")
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    torch.save({"model": model.state_dict(), "model_config": model.config.to_dict()}, root / "init.pt")
    rng = random.Random(0)
    for name in ("pairs", "other"):
        lines = []
        for _ in range(60):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            wrong = a + b + rng.randint(1, 9)
            lines.append(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)}))
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    for out, level, data in (("bf16", "bf16", "pairs"), ("O2", "O2", "pairs"), ("other", "bf16", "other")):
        argv = ["dpo", "--init-from", str(root / "init.pt"), "--data", str(root / f"{data}.jsonl")]
        argv += ["--out", str(root / out), "--opt-level", level, "--steps", "2", "--batch-size", "4"]
        argv += ["--lr", "1e-2", "--val-fraction", "0.2", "--no-progress"]
        assert main(argv) == 0, out
    return root


@pytest.mark.slow
def test_reopened_runs_score_their_pairs_as_the_runs_did(runs):
    result = dpo_paired.compare([str(runs / "bf16")], [str(runs / "O2")], target=0.02)
    for info in result["runs"]:
        assert info["reward_accuracy"] == info["summary_reward_accuracy"], info["run"]
        assert info["dpo_loss"] == pytest.approx(info["summary_dpo_loss"], rel=1e-6), info["run"]
    (seed,) = result["per_seed"]
    assert seed["pairs"] == 12
    assert seed["baseline_accuracy"] == result["runs"][0]["reward_accuracy"]
    assert seed["candidate_accuracy"] == result["runs"][1]["reward_accuracy"]
    counts = seed["discordant"]
    assert seed["accuracy_difference"] == pytest.approx((counts["candidate_only"] - counts["baseline_only"]) / 12)
    assert result["pooled"]["accuracy_difference"] == seed["accuracy_difference"]


@pytest.mark.slow
def test_runs_on_other_pairs_are_refused(runs):
    with pytest.raises(DataError, match="held-out pairs differ"):
        dpo_paired.compare([str(runs / "bf16")], [str(runs / "other")], target=0.02)
