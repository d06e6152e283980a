"""`fp8lm train --activations fp8 --activation-checkpointing ...`: the options, their refusals, what
`compare` passes on, and the summary's activation and peak-memory figures."""

import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fp8lm.policy
from fp8lm.train.compare import _level_config, compare
from fp8lm.train.config import RunError, TrainConfig
from fp8lm.train.hf_model import build_model
from fp8lm.train.loop import train
from fp8lm.train.report import read_metrics

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
TINY = dict(model="tiny", batch_size=4, seq_len=32, eval_every=3, eval_batches=2, progress=False, lr=1e-2, data=EMAIL)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


def test_options_reach_initialize_and_are_refused_where_they_do_not_apply():
    cfg = TrainConfig(opt_level="O2", activations="fp8", activation_checkpointing="selective")
    cfg.validate()
    assert cfg.initialize_options() == {"activations": "fp8"}
    assert TrainConfig(opt_level="O2").initialize_options() == {}
    TrainConfig(opt_level="bf16", activation_checkpointing="full").validate()  # any level checkpoints
    for bad, message in [
        (TrainConfig(opt_level="bf16", activations="fp8"), "--activations fp8 sets how the FP8 levels"),
        (TrainConfig(opt_level="O2", activations="fp4"), "unknown --activations 'fp4'"),
        (TrainConfig(opt_level="O2", activation_checkpointing="half"), "unknown --activation-checkpointing 'half'"),
        (
            TrainConfig(opt_level="O1", activations="fp8", amp_options={"activations": "fp8"}),
            "pass one of them",
        ),
    ]:
        with pytest.raises(RunError, match=message):
            bad.validate()


def test_compare_gives_fp8_activations_to_the_fp8_levels_alone(tmp_path):
    cfg = TrainConfig(activations="fp8", activation_checkpointing="full")
    runs = {level: _level_config(cfg, level, tmp_path) for level in ("fp32", "bf16", "O1", "O2")}
    assert {level: r.activations for level, r in runs.items()} == {
        "fp32": None,
        "bf16": None,
        "O1": "fp8",
        "O2": "fp8",
    }
    assert {level: r.resolved_activations() for level, r in runs.items()} == {
        "fp32": "bf16",
        "bf16": "bf16",
        "O1": "fp8",
        "O2": "fp8",
    }
    assert all(r.activation_checkpointing == "full" for r in runs.values())
    for run in runs.values():
        run.validate()


def test_fp8_activations_and_checkpointing_in_a_run(tmp_path, cache):
    base = TrainConfig(
        **TINY, opt_level="O2", steps=3, cache_dir=cache, out=str(tmp_path / "plain"), activations="bf16"
    )
    plain = train(base)
    fp8 = train(replace(base, activations="fp8", out=str(tmp_path / "fp8")))
    full = train(replace(base, activations="fp8", activation_checkpointing="full", out=str(tmp_path / "full")))
    assert fp8["act_bytes_per_token"] < 0.85 * plain["act_bytes_per_token"]
    assert full["act_bytes_per_token"] < 0.6 * fp8["act_bytes_per_token"]
    # checkpointing recomputes bit for bit: the same training
    assert read_metrics(tmp_path / "fp8" / "metrics.jsonl") == read_metrics(tmp_path / "full" / "metrics.jsonl")
    for s in (plain, fp8, full):
        assert s["peak_step_bytes"] > s["memory"]["total"] - s["memory"]["gradients"]
    assert full["peak_step_bytes"] < fp8["peak_step_bytes"] < plain["peak_step_bytes"]
    assert full["config"]["activations"] == "fp8" and full["config"]["activation_checkpointing"] == "full"


def test_fp8_activations_are_o2s_default_and_recorded_resolved():
    defaults = {level: TrainConfig(opt_level=level) for level in ("fp32", "bf16", "O1", "O2", "O3")}
    assert {level: c.resolved_activations() for level, c in defaults.items()} == {
        "fp32": "bf16",
        "bf16": "bf16",
        "O1": "bf16",
        "O2": "fp8",
        "O3": "bf16",
    }
    assert defaults["O2"].options()["activations"] == "fp8"  # what --resume keeps
    assert "activations" not in defaults["O2"].initialize_options()  # the preset decides
    assert TrainConfig(opt_level="O2", activations="bf16").initialize_options()["activations"] == "bf16"
    assert fp8lm.policy.preset("O2").activations == "fp8"
    assert fp8lm.policy.preset("O1").activations == fp8lm.policy.preset("O3").activations == "bf16"


def test_policy_option_reaches_initialize_merged_with_exp_avg_sq_and_is_checked_first():
    norms = '{"*ln_*": {"activations": "bf16"}}'
    cfg = TrainConfig(opt_level="O2", policy=norms)
    cfg.validate()
    assert cfg.initialize_options() == {"policy": {"*ln_*": {"activations": "bf16"}}}
    both = TrainConfig(opt_level="O2", policy='{"*": {"exp_avg": "FP16"}}', exp_avg_sq="e5m2")
    assert both.initialize_options()["policy"] == {"*": {"exp_avg": "FP16", "exp_avg_sq": "E5M2"}}
    assert TrainConfig(opt_level="O2", policy=norms).options()["policy"] == norms  # what --resume keeps
    for bad, message in [
        (TrainConfig(opt_level="bf16", policy=norms), "--policy sets the precision policy of the FP8 levels"),
        (TrainConfig(opt_level="O2", policy="{'*ln_*': 1}"), "--policy is not JSON"),
        (TrainConfig(opt_level="O2", policy='["*ln_*"]'), "--policy takes a JSON object"),
        (
            TrainConfig(opt_level="O2", policy='{"*ln_*": {"activations": "fp4"}}'),
            "rule '\\*ln_\\*': unknown activations",
        ),
        (TrainConfig(opt_level="O2", policy='{"*": {"colour": "E4M3"}}'), "rule '\\*'"),
        (TrainConfig(opt_level="O2", policy=norms, amp_options={"policy": {}}), "pass one of them"),
    ]:
        with pytest.raises(RunError, match=message):
            bad.validate()
    runs = {level: _level_config(cfg, level, Path("unused")) for level in ("fp32", "bf16", "O1", "O2")}
    assert {level: r.policy for level, r in runs.items()} == {"fp32": None, "bf16": None, "O1": norms, "O2": norms}


def test_policy_option_saves_the_matching_modules_inputs_as_computed(tmp_path, cache):
    base = TrainConfig(**TINY, opt_level="O2", steps=2, cache_dir=cache, out=str(tmp_path / "fp8"))
    fp8 = train(base)
    norms = train(replace(base, policy='{"*ln_*": {"activations": "bf16"}}', out=str(tmp_path / "norms")))
    plain = train(replace(base, activations="bf16", out=str(tmp_path / "plain")))
    # the norms' inputs kept as computed: more saved bytes than all in FP8, fewer than none in FP8
    assert fp8["act_bytes_per_token"] < norms["act_bytes_per_token"] < plain["act_bytes_per_token"]
    assert norms["config"]["policy"] == '{"*ln_*": {"activations": "bf16"}}'
    with pytest.raises(RunError, match=r"--policy rule '\*norm\*' matches no module or parameter .* 'blocks.0.ln_1'"):
        train(replace(base, policy='{"*norm*": {"activations": "bf16"}}', out=str(tmp_path / "typo")))
    assert not (tmp_path / "typo" / "checkpoints").exists()


def test_compare_refuses_a_policy_pattern_that_matches_nothing_before_any_level_trains(tmp_path, cache):
    cfg = TrainConfig(**TINY, steps=2, cache_dir=cache, out=str(tmp_path), policy='{"*.ln1": {"activations": "bf16"}}')
    with pytest.raises(RunError, match=r"--policy rule '\*.ln1' matches no module"):
        compare(cfg, ["bf16", "O2"])
    assert not (tmp_path / "bf16" / "metrics.jsonl").exists()
    with torch.device("meta"):  # the check's model: GPT's names, whatever the arch
        names = {n for n, _ in build_model(replace(cfg, arch="llama").model_config()).named_modules()}
    assert "blocks.0.ln_1" in names
