"""The command line's options are generated from the config dataclasses (`fp8lm.train.config`),
which import no torch: `fp8lm --help` answers without it."""

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, fields

import pytest

import fp8lm
from fp8lm.cli import add_config_options, build_parser, config_from_args, main
from fp8lm.train import config


def test_the_names_spelled_in_config_are_those_of_the_modules_that_own_them():
    from fp8lm.cli import TELEMETRY_KINDS, TELEMETRY_STATS
    from fp8lm.distributed import SCALINGS
    from fp8lm.policy import ACTIVATIONS, FP8_LEVELS
    from fp8lm.recipe import DEFAULT_RECIPE, RECIPES
    from fp8lm.telemetry import KINDS
    from fp8lm.train.model import ARCHS, CHECKPOINTING, MLP_KINDS, PRESETS, ROUTERS
    from fp8lm.train.telemetry_report import STATS

    assert config.FP8_LEVELS == FP8_LEVELS and config.GRAD_SYNC_SCALINGS == SCALINGS
    assert config.RECIPE_NAMES == tuple(RECIPES) and config.DEFAULT_RECIPE == DEFAULT_RECIPE
    assert config.MODEL_PRESETS == tuple(PRESETS) and config.MLP_KINDS == MLP_KINDS
    assert config.ARCHS == ARCHS and config.MOE_ROUTERS == ROUTERS
    assert config.ACTIVATIONS == ACTIVATIONS and config.CHECKPOINTING == CHECKPOINTING
    assert TELEMETRY_KINDS == KINDS and TELEMETRY_STATS == STATS


def _imports_after(code: str) -> set:
    script = f"import sys\n{code}\nimport json; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["compare", "--help"], ["dpo", "--help"]])
def test_help_imports_no_torch(argv):
    code = f"from fp8lm.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    loaded = _imports_after(code)
    assert "fp8lm.cli" in loaded and "torch" not in loaded and "numpy" not in loaded


def test_import_fp8lm_imports_no_torch_until_a_name_is_used():
    assert "torch" not in _imports_after("import fp8lm")
    assert "torch" in _imports_after("import fp8lm\nfp8lm.E4M3")


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"fp8lm {fp8lm.__version__}"


def test_every_option_field_is_a_flag_with_its_default():
    parser = build_parser()
    args = parser.parse_args(["train"])
    cfg = config_from_args(config.TrainConfig, args)
    assert cfg == config.TrainConfig()  # the command line's defaults are the dataclass's
    dpo = config_from_args(config.DPOConfig, parser.parse_args(["dpo"]))
    assert dpo == config.DPOConfig()
    flags = {f.name: config.option_flag(f) for f in config.option_fields(config.TrainConfig)}
    assert flags["progress"] == "--no-progress" and flags["exp_avg_sq"] == "--exp-avg-sq"
    assert {"beta1", "beta2", "amp_options"}.isdisjoint(flags)  # no help text: no option


def test_a_new_field_is_a_new_option():
    @dataclass
    class Extended(config.TrainConfig):
        label_smoothing: float = config.option(0.0, "label smoothing of the loss", group="optimization")
        compile_model: bool = config.option(False, "torch.compile the model", group="optimization")

    parser = argparse.ArgumentParser()
    add_config_options(parser, Extended)
    args = parser.parse_args(["--label-smoothing", "0.1", "--compile-model", "--no-progress", "--exp-avg-sq", "e4m3"])
    cfg = config_from_args(Extended, args)
    assert cfg.label_smoothing == 0.1 and cfg.compile_model and not cfg.progress and cfg.exp_avg_sq == "E4M3"
    assert "label smoothing of the loss (default: 0.0)" in " ".join(parser.format_help().split())
    assert len(fields(Extended)) == len(fields(config.TrainConfig)) + 2


def test_a_subclass_that_redefines_an_option_keeps_what_resume_does_with_it():
    train = {f.name: f.metadata["resume"] for f in config.option_fields(config.TrainConfig)}
    for f in config.option_fields(config.DPOConfig):
        if f.name in train:
            assert f.metadata["resume"] == train[f.name], f.name


@pytest.mark.parametrize("command", ["train", "compare", "dpo"])
def test_help_names_only_flags_the_command_has(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no flag broken over two lines
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    own = {flag for action in sub._actions for flag in action.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", sub.format_help()))
    assert named <= own, f"fp8lm {command} --help names flags it does not have: {sorted(named - own)}"
