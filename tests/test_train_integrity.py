"""Run integrity: a run killed before summary.json is finished by --resume; --resume refuses other
options than the run's; --init-from refuses a checkpoint of another depth."""

import json
import math
import shutil

import pytest

from fp8lm.train.checkpoint import CheckpointError
from fp8lm.train.config import RunError, TrainConfig
from fp8lm.train.loop import train
from fp8lm.train.run import TrainingRun


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_run, token_cache):
    """A finished 3-step run (checkpoints at steps 2 and 3) and its summary."""
    out = tmp_path_factory.mktemp("finished") / "run"
    summary = train(TrainConfig(**{**tiny_run, "steps": 3, "save_every": 2, "out": str(out), "cache_dir": token_cache}))
    return out, summary


def config(tiny_run, token_cache, out, **kw):
    return TrainConfig(**{**tiny_run, "steps": 3, "save_every": 2, "out": str(out), "cache_dir": token_cache, **kw})


def test_resume_finishes_a_run_killed_before_its_summary(finished, tmp_path, tiny_run, token_cache):
    out, whole = finished
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "summary.json").unlink()  # a kill after the final checkpoint, before the summary
    metrics = (run / "metrics.jsonl").read_bytes()
    summary = train(config(tiny_run, token_cache, run, resume=True))
    assert json.loads((run / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (run / "metrics.jsonl").read_bytes() == metrics
    for key in summary:
        if key != "config":  # which says resume=True
            assert summary[key] == whole[key], key
    with pytest.raises(RunError, match="already reached step 3; pass --steps larger"):
        train(config(tiny_run, token_cache, run, resume=True))


@pytest.mark.parametrize(
    "kw, line",
    [
        (dict(n_head=1), "trained with --n-head 2, this command has --n-head 1; pass --n-head 2 to continue it"),
        (dict(n_layer=1), "trained with --n-layer 2, this command has --n-layer 1; pass --n-layer 2"),
        (dict(seq_len=16), "trained with --seq-len 32, this command has --seq-len 16"),
        (dict(lr=2e-2), "trained with --lr 0.01, this command has --lr 0.02; pass --lr 0.01"),
        (dict(batch_size=2), "trained with --batch-size 4, this command has --batch-size 2"),
        (dict(seed=7), "trained with --seed 1337, this command has --seed 7"),
        (dict(data=None), "this command has no --data; pass --data "),
        (
            dict(warmup_steps=1),
            # recorded resolved (the default for 3 steps is 0), so extending --steps keeps it
            "trained with --warmup-steps 0, this command has --warmup-steps 1; pass --warmup-steps 0",
        ),
        (dict(weight_decay=0.0), "trained with --weight-decay 0.1, this command has --weight-decay 0.0"),
    ],
)
def test_resume_refuses_other_options_than_the_runs(finished, tmp_path, tiny_run, token_cache, kw, line):
    out, _ = finished
    run = tmp_path / "run"
    shutil.copytree(out, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(RunError, match="--resume: the run in .* was trained with") as e:
        train(config(tiny_run, token_cache, run, resume=True, steps=5, **kw))
    assert line in str(e.value) and "\n" not in str(e.value)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_init_from_a_deeper_checkpoint_is_refused(finished, tmp_path, tiny_run, token_cache):
    out, _ = finished
    with pytest.raises(CheckpointError, match="'blocks.1.* is not in this model; it was trained with n_layer=2"):
        train(config(tiny_run, token_cache, tmp_path / "ft", n_layer=1, init_from=str(out)))
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("level", ["bf16", pytest.param("O2", marks=pytest.mark.slow)])
def test_skipped_steps_are_counted_once_and_right_after_a_resume(tmp_path, tiny_run, token_cache, monkeypatch, level):
    """bf16 steps torch's AdamW (the run counts skips), O2 fp8lm's FP8AdamW (it counts its own)."""
    real_loss = TrainingRun.loss

    def loss_inf_at_steps_2_and_5(self, model, batch):
        loss = real_loss(self, model, batch)
        return loss * math.inf if self.core.training and self.sampler.batches_drawn in (2, 5) else loss

    monkeypatch.setattr(TrainingRun, "loss", loss_inf_at_steps_2_and_5)
    whole = train(config(tiny_run, token_cache, tmp_path / "whole", opt_level=level, steps=6, save_every=3))
    assert whole["skipped_steps"] == 2
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "whole", part)
    (part / "summary.json").unlink()
    (part / "checkpoints" / "step_00000006.pt").unlink()
    resumed = train(config(tiny_run, token_cache, part, opt_level=level, steps=6, save_every=3, resume=True))
    assert resumed["skipped_steps"] == 2
    assert (part / "metrics.jsonl").read_bytes() == (tmp_path / "whole" / "metrics.jsonl").read_bytes()
