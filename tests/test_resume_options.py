"""`--resume` takes the run's options from its checkpoint; a given option that differs is refused;
an extended run keeps its learning-rate schedule unless --decay-steps asks for another."""

import json

import pytest

from cli_helpers import run_main
from fp8lm.train.run import lr_at


def _lrs(out):
    return [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r]


@pytest.fixture
def finished(tmp_path, token_cache, email_corpus, tiny_cli_args, capsys):
    out = tmp_path / "run"
    first = ["train", *tiny_cli_args, "--data", email_corpus, "--cache-dir", token_cache, "--lr", "1e-3"]
    rc, _, err = run_main([*first, "--steps", "6", "--eval-every", "3", "--out", str(out)], capsys)
    assert rc == 0, err
    return out


def test_resume_needs_no_options_and_keeps_the_schedule_of_an_extended_run(finished, capsys):
    rc, printed, err = run_main(["train", "--resume", "--out", str(finished), "--steps", "9", "--no-progress"], capsys)
    assert rc == 0, err
    assert "extending the run from 6 to 9 steps; its learning-rate schedule keeps its length" in printed
    lrs = _lrs(finished)
    assert len(lrs) == 9 and lrs[5:] == [pytest.approx(1e-4)] * 4  # 1e-3 x min_lr_ratio 0.1, no jump back up
    summary = json.loads((finished / "summary.json").read_text())
    assert summary["config"]["lr"] == 1e-3 and summary["config"]["model"] == "tiny"


def test_resume_with_decay_steps_decays_again_over_the_new_length(finished, capsys):
    argv = ["train", "--resume", "--out", str(finished), "--steps", "12", "--decay-steps", "12", "--no-progress"]
    rc, printed, err = run_main(argv, capsys)
    assert rc == 0, err
    assert "with a new learning-rate schedule (--decay-steps 12" in printed
    lrs = _lrs(finished)
    assert lrs[6] > lrs[5] and lrs[-1] == pytest.approx(1e-4)


def test_a_run_started_with_a_longer_schedule_goes_on_with_it(
    tmp_path, token_cache, email_corpus, tiny_cli_args, capsys
):
    out = tmp_path / "long"
    first = ["train", *tiny_cli_args, "--data", email_corpus, "--cache-dir", token_cache, "--lr", "1e-3"]
    rc, _, err = run_main([*first, "--steps", "4", "--decay-steps", "8", "--out", str(out)], capsys)
    assert rc == 0, err
    rc, printed, err = run_main(["train", "--resume", "--out", str(out), "--steps", "8", "--no-progress"], capsys)
    assert rc == 0, err
    assert "extending the run from 4 to 8 steps within its learning-rate schedule (--decay-steps 8)" in printed
    assert "pass --decay-steps" not in printed  # nothing to change: the schedule already has this length
    # the schedule of 8 steps (warmup a tenth: none) from the first step to the last
    assert _lrs(out) == [pytest.approx(lr_at(step, 1e-3, 0, 8, 0.1)) for step in range(8)]


def test_a_given_option_that_differs_is_refused_in_one_line(finished, capsys):
    before = sorted(p.name for p in (finished / "checkpoints").iterdir())
    rc, _, err = run_main(["train", "--resume", "--out", str(finished), "--steps", "9", "--lr", "3e-3"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "was trained with --lr 0.001, this command has --lr 0.003; drop --lr" in err
    assert sorted(p.name for p in (finished / "checkpoints").iterdir()) == before
    # the same value given again is no difference
    rc, _, err = run_main(["train", "--resume", "--out", str(finished), "--steps", "7", "--lr", "0.001"], capsys)
    assert rc == 0, err


def test_resume_of_a_finished_run_without_more_steps_says_so(finished, capsys):
    rc, _, err = run_main(["train", "--resume", "--out", str(finished)], capsys)
    assert rc == 2 and "already reached step 6; pass --steps larger than that" in err
