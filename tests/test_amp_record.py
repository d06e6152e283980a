"""`TrainConfig.amp_options` (fp8lm.initialize options passed from code) recorded in checkpoints:
`Recipe` and `Policy` as plain data, the model `fp8lm export` / `generate` rebuild from them, and
``--resume`` refusing other options."""

import json
import shutil

import pytest

from fp8lm.nn import FP8Linear
from fp8lm.policy import Policy, preset, resolve_policy
from fp8lm.recipe import RECIPES, Recipe
from fp8lm.train.amp_record import amp_options_change, record_amp_options, recorded_model_options
from fp8lm.train.checkpoint import CheckpointError
from fp8lm.train.config import RunError
from fp8lm.train.export import read_run_checkpoint, run_initialize_options, run_model, run_recipe
from fp8lm.train.loop import train
from test_train import cache, cfg  # noqa: F401  (the fixture and the tiny run's config)

CUSTOM = Recipe.from_name("blockwise").replace(pow2_scales=True)  # in no RECIPES entry


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_named_recipe_survives_json(name):
    recipe = RECIPES[name]
    assert Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    assert Recipe.from_dict(json.loads(json.dumps(CUSTOM.to_dict()))) == CUSTOM


def test_a_recipe_dict_with_unknown_or_bad_fields_is_refused():
    with pytest.raises(ValueError, match=r"unknown Recipe field\(s\) \['blocks'\]"):
        Recipe.from_dict({"blocks": 16})
    with pytest.raises(ValueError, match="unknown granularity"):
        Recipe.from_dict({**CUSTOM.to_dict(), "granularity": "columnwise"})


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("head", [True, False])
def test_every_preset_with_overrides_survives_json(level, head):
    policy = preset(level, head).override("*.attn.*", fp8_gemm=False, grad="BF16").override("lm_head", master=None)
    policy = policy.override("*.mlp.*", activations="fp8")
    assert Policy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy


def test_a_policy_dict_with_bad_values_is_refused():
    values = preset("O2").to_dict()
    with pytest.raises(ValueError, match="unknown format 'E9M9'"):
        Policy.from_dict({**values, "linear": {**values["linear"], "grad": "E9M9"}})
    with pytest.raises(ValueError, match="not a policy as Policy.to_dict writes it"):
        Policy.from_dict({k: v for k, v in values.items() if k != "vector"})
    for broken in ({"overrides": 3}, {"overrides": ["*"]}, {"linear": 5}):
        with pytest.raises(ValueError, match="not a policy as Policy.to_dict writes it"):
            Policy.from_dict({**values, **broken})
    head = {**values["output_head"], "fp8_gemm": "yes"}
    with pytest.raises(ValueError, match="fp8_gemm must be True or False, got 'yes'"):
        Policy.from_dict({**values, "output_head": head})
    with pytest.raises(ValueError, match="unknown activations"):
        Policy.from_dict(
            {**values, "overrides": [{"pattern": "x", "fp8_gemm": None, "formats": {}, "activations": "fp4"}]}
        )


def test_the_record_is_plain_data_and_names_what_it_cannot_hold():
    rules = {"*.attn.c_proj": {"fp8_gemm": False}}
    record = record_amp_options(
        {"recipe": "rowwise", "policy": rules, "multiple_of": 32, "module_filter": lambda name, module: True}, "O2"
    )
    assert json.loads(json.dumps(record)) == record
    assert record["options"]["recipe"] == Recipe.from_name("rowwise").to_dict()
    assert record["options"]["policy"] == resolve_policy(rules, "O2").to_dict()
    assert record["unrecorded"] == ["module_filter"]
    with pytest.raises(CheckpointError, match="fp8lm.initialize option module_filter passed from code"):
        recorded_model_options({"amp_options": record, "path": "step_1.pt"})
    assert record_amp_options({"module_filter": None}, "O2") == {"options": {"module_filter": None}, "unrecorded": []}
    assert amp_options_change(None, record) == []  # a checkpoint written before the record
    assert amp_options_change(record, record_amp_options({}, "O2")) == [
        "module_filter",
        "multiple_of",
        "policy",
        "recipe",
    ]


@pytest.mark.parametrize(
    "record",
    [[], "recipe", {"options": [], "unrecorded": []}, {"options": {}}, {"options": {1: 2}, "unrecorded": []}],
)
def test_a_record_in_an_unknown_form_is_one_clear_error(record):
    state = {"amp_options": record, "path": "step_1.pt"}
    with pytest.raises(CheckpointError, match="'step_1.pt' records its fp8lm.initialize options in an unknown form"):
        recorded_model_options(state)
    with pytest.raises(CheckpointError, match="unknown form"):
        amp_options_change(record, record_amp_options({}, "O2"))
    bad_recipe = {"options": {"recipe": {"granularity": "columnwise"}}, "unrecorded": []}
    with pytest.raises(CheckpointError, match="records invalid fp8lm.initialize options: unknown granularity"):
        recorded_model_options({"amp_options": bad_recipe, "path": "step_1.pt"})


def test_export_and_generate_build_the_model_the_run_passed_from_code(tmp_path, cache):  # noqa: F811
    options = {"recipe": CUSTOM, "policy": {"*.attn.c_proj": {"fp8_gemm": False}}}
    train(cfg(tmp_path, cache, opt_level="O2", steps=2, amp_options=options))
    state = read_run_checkpoint(tmp_path / "run")
    assert run_recipe(state) == CUSTOM and run_initialize_options(state)["policy"] == resolve_policy(
        options["policy"], "O2"
    )
    layers = {n: m for n, m in run_model(state).named_modules() if isinstance(m, FP8Linear)}
    assert layers and all(m.recipe == CUSTOM for m in layers.values())
    assert sorted(n for n, m in layers.items() if not m.fp8_enabled) == [
        "blocks.0.attn.c_proj",
        "blocks.1.attn.c_proj",
        "lm_head",
    ]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["amp_options"]["options"]["recipe"] == CUSTOM.to_dict()


def test_a_run_with_an_unrecordable_layer_filter_is_not_exported_as_another_model(tmp_path, cache):  # noqa: F811
    train(cfg(tmp_path, cache, opt_level="O1", steps=1, amp_options={"module_filter": lambda n, m: "mlp" in n}))
    state = read_run_checkpoint(tmp_path / "run")
    with pytest.raises(
        CheckpointError, match="build the model in code and export it with fp8lm.export.save_pretrained"
    ):
        run_model(state)


def test_resume_refuses_other_options_than_the_run_passed_from_code(tmp_path, cache):  # noqa: F811
    run = dict(opt_level="O2", steps=4, save_every=2)
    whole = train(cfg(tmp_path, cache, **run, amp_options={"recipe": CUSTOM}))
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", out)
    (out / "summary.json").unlink()
    (out / "checkpoints" / "step_00000004.pt").unlink()
    resume = dict(run, out=str(out), resume=True)
    for options, changed in (
        ({}, "recipe"),
        ({"recipe": "blockwise"}, "recipe"),
        ({"recipe": CUSTOM, "multiple_of": 32}, "multiple_of"),
    ):
        with pytest.raises(
            RunError, match=f"other fp8lm.initialize options passed from code \\(TrainConfig.amp_options: {changed}\\)"
        ):
            train(cfg(tmp_path, cache, **resume, amp_options=options))
    resumed = train(cfg(tmp_path, cache, **resume, amp_options={"recipe": CUSTOM}))
    assert resumed["val_loss"] == whole["val_loss"]
