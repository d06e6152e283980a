"""fp8lm.Recipe: named recipes, validation, and its use by FP8Linear, initialize and the CLI config."""

import warnings

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm.nn import FP8Linear
from fp8lm.train.config import RunError, TrainConfig


def test_named_recipes_are_frozen_hashable_values():
    delayed = fp8lm.Recipe.from_name("tensorwise-delayed")
    current = fp8lm.Recipe.from_name("tensorwise-current")
    assert delayed == fp8lm.Recipe() and delayed.name == "tensorwise-delayed"
    assert (delayed.input_format, delayed.weight_format, delayed.grad_output_format) == (
        fp8lm.E4M3,
        fp8lm.E4M3,
        fp8lm.E5M2,
    )
    assert (delayed.scaling, delayed.history_len, delayed.steps) == ("delayed", 16, 16)
    assert (current.scaling, current.steps) == ("current", 0)
    assert len({delayed, current, fp8lm.Recipe()}) == 2
    with pytest.raises(AttributeError):
        delayed.history_len = 4  # type: ignore[misc]
    custom = delayed.replace(history_len=4)
    assert custom.history_len == 4 and custom.name is None and delayed.history_len == 16


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"scaling": "lazy"}, "unknown scaling 'lazy'"),
        ({"backend": "cublas"}, "unknown FP8 GEMM backend"),
        ({"history_len": 0}, "history_len must be an int >= 1"),
        ({"margin": -1}, "margin must be an int >= 0"),
        ({"input_format": "FP16"}, "must be an FP8 format"),
    ],
)
def test_bad_recipes_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        fp8lm.Recipe(**changes)


def test_unknown_name_lists_the_names():
    names = "tensorwise-delayed, tensorwise-current, rowwise, rowwise-wgrad-bf16, blockwise, mxfp8, nvfp4"
    with pytest.raises(ValueError, match=f"unknown recipe 'colwise': use one of {names}"):
        fp8lm.Recipe.from_name("colwise")


def test_layer_takes_the_recipe_and_its_margin():
    layer = FP8Linear(32, 16, recipe=fp8lm.Recipe(history_len=4, margin=2))
    assert layer.input_meta.history_len == 4 and layer.grad_output_meta.margin == 2
    layer(torch.randn(8, 32)).sum().backward()
    amax = layer.input_meta.last_amax
    assert torch.equal(layer.input_meta.scale, fp8lm.compute_scale(amax, fp8lm.E4M3, margin=2))
    current = FP8Linear(32, 16, recipe="tensorwise-current")
    assert current.scaling == "current" and current.input_meta.history_len == 0


def test_the_old_keywords_are_gone_a_recipe_says_it():
    for old in ({"scaling": "current"}, {"history_len": 4}, {"backend": "emulated"}):
        with pytest.raises(TypeError, match="unexpected keyword"):
            FP8Linear(16, 16, **old)
        with pytest.raises(TypeError, match="unexpected keyword"):
            fp8lm.initialize(nn.Sequential(nn.Linear(16, 16)), opt_level="O1", **old)
    model, _ = fp8lm.initialize(nn.Sequential(nn.Linear(16, 16)), opt_level="O1", recipe=fp8lm.Recipe(history_len=4))
    assert model[0].recipe.history_len == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8lm.initialize(nn.Sequential(nn.Linear(16, 16)), opt_level="O1", recipe="tensorwise-current")


def test_initialize_refuses_a_bad_recipe_before_changing_the_model():
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="unknown recipe"):
        fp8lm.initialize(model, opt_level="O1", recipe="nope")
    with pytest.raises(TypeError, match="recipe must be an fp8lm.Recipe"):
        fp8lm.initialize(model, opt_level="O1", recipe=16)
    assert isinstance(model[0], nn.Linear) and not hasattr(model, "_fp8lm_opt_level")


def test_train_config_recipe():
    cfg = TrainConfig(opt_level="O1", recipe="tensorwise-current")
    cfg.validate()
    assert cfg.initialize_options() == {"recipe": fp8lm.Recipe.from_name("tensorwise-current")}
    assert TrainConfig(opt_level="O1").initialize_options() == {}
    for bad, message in [
        (TrainConfig(opt_level="O1", recipe="x"), "unknown --recipe 'x'"),
        (TrainConfig(opt_level="bf16", recipe="tensorwise-current"), "--recipe sets the FP8 layers"),
        (
            TrainConfig(opt_level="O1", recipe="tensorwise-current", amp_options={"recipe": "tensorwise-delayed"}),
            "pass one of them",
        ),
    ]:
        with pytest.raises(RunError, match=message):
            bad.validate()
