"""`fp8lm train --final-bf16-fraction`: the last steps of an FP8 run with every FP8 layer's GEMMs in
BF16 (precision annealing), decided by the step number alone."""

import math
import shutil

import pytest
import torch

from fp8lm.train.config import RunError
from fp8lm.train.loop import train
from fp8lm.train.report import read_metrics
from test_train import cache, cfg  # noqa: F401  (the fixture and the tiny run's config)


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(opt_level="O2", final_bf16_fraction=1.0),
            "--final-bf16-fraction must be a finite number in \\[0.0, 1.0\\)",
        ),
        (dict(opt_level="O2", final_bf16_fraction=-0.1), "--final-bf16-fraction must be"),
        (dict(opt_level="O2", final_bf16_fraction=math.nan), "--final-bf16-fraction must be"),
        (dict(final_bf16_fraction=0.2), "this run is bf16: drop it or pick an FP8 level"),
        (
            dict(opt_level="O1", final_bf16_fraction=0.2, fallback=True, telemetry_every=1),
            "--fallback and --final-bf16-fraction both switch layers to BF16",
        ),
    ],
)
def test_bad_fraction_is_refused_before_any_output(tmp_path, cache, kw, match):  # noqa: F811
    with pytest.raises(RunError, match=match):
        train(cfg(tmp_path, cache, **kw))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("steps, fraction, first", [(10, 0.2, 8), (500, 0.2, 400), (10, 0.04, None), (10, 0.0, None)])
def test_the_first_bf16_step(tmp_path, cache, steps, fraction, first):  # noqa: F811
    c = cfg(tmp_path, cache, opt_level="O2", steps=steps, final_bf16_fraction=fraction)
    assert c.bf16_from_step() == first


def _scaling(path):
    return torch.load(path, weights_only=True)["ranks"][0]["scaling"]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_last_steps_leave_fp8_alone_and_say_so(tmp_path, cache, capsys):  # noqa: F811
    s = train(cfg(tmp_path, cache, opt_level="O1", steps=4, save_every=1, keep_checkpoints=4, final_bf16_fraction=0.5))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r.get("bf16_gemms", False) for r in records] == [False, False, True, True]
    assert s["bf16_from_step"] == 2
    assert "step 3: the last 2 steps run the FP8 layers' GEMMs in BF16" in capsys.readouterr().out
    ckpt = [_scaling(tmp_path / "run" / "checkpoints" / f"step_0000000{n}.pt") for n in (1, 2, 3, 4)]
    assert ckpt[0] and not _same(ckpt[0], ckpt[1])  # FP8 steps update the delayed scaling state
    assert _same(ckpt[1], ckpt[2]) and _same(ckpt[1], ckpt[3])  # BF16 steps (and the BF16 validation) do not


@pytest.mark.slow
def test_resume_into_and_within_the_bf16_steps_is_bit_identical(tmp_path, cache):  # noqa: F811
    options = dict(opt_level="O2", recipe="rowwise", steps=6, save_every=2, keep_checkpoints=3, final_bf16_fraction=0.5)
    whole = train(cfg(tmp_path, cache, **options))
    out = tmp_path / "run"
    for keep in (2, 4):  # before the BF16 steps, and within them
        resumed_out = tmp_path / f"resumed{keep}"
        shutil.copytree(out, resumed_out)
        (resumed_out / "summary.json").unlink()
        for step in range(keep + 1, 7):
            (resumed_out / "checkpoints" / f"step_0000000{step}.pt").unlink(missing_ok=True)
        resumed = train(cfg(tmp_path, cache, **options, out=str(resumed_out), resume=True))
        assert (resumed_out / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()
        assert resumed["val_loss"] == whole["val_loss"]


@pytest.mark.parametrize(
    "options, step, fallback, expected",
    [
        ({"steps": 10, "final_bf16_fraction": 0.2}, 8, None, set()),  # step 8 (0-based 7) computed in FP8
        ({"steps": 10, "final_bf16_fraction": 0.2}, 9, None, True),
        ({"steps": 10, "final_bf16_fraction": 0.0}, 10, None, set()),
        ({"steps": 10}, 10, {"high_precision": {"blocks.0.mlp.c_fc": True, "lm_head": False}}, {"blocks.0.mlp.c_fc"}),
    ],
)
def test_which_layers_a_checkpoints_last_step_computed_in_high_precision(options, step, fallback, expected):
    from fp8lm.train.export import run_high_precision

    assert run_high_precision({"options": options, "step": step, "fallback": fallback}) == expected


def _logits(model, autocast, x):
    with torch.no_grad(), autocast:
        return model(x)[0].float()


@pytest.mark.parametrize("fraction", [0.5, 0.0])
def test_run_model_computes_as_the_runs_last_step_did(tmp_path, cache, fraction):  # noqa: F811
    from fp8lm.train.export import full_weights, read_run_checkpoint, run_autocast, run_model
    from fp8lm.train.model import GPT

    policy = '{"*.attn.c_proj": {"fp8_gemm": false}}'
    train(cfg(tmp_path, cache, opt_level="O1", steps=2, final_bf16_fraction=fraction, policy=policy))
    state = read_run_checkpoint(tmp_path / "run")
    model = run_model(state)
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "high_precision")}
    assert layers and all(m.high_precision == bool(fraction) for m in layers.values())
    assert [n for n, m in layers.items() if not m.fp8_enabled] == [
        "blocks.0.attn.c_proj",
        "blocks.1.attn.c_proj",
        "lm_head",
    ]
    plain = GPT(state["model_config"])
    plain.load_state_dict(full_weights(state))
    x = torch.randint(0, state["model_config"].vocab_size, (2, 16))
    same = torch.equal(_logits(model, run_autocast(state), x), _logits(plain.eval(), run_autocast(state), x))
    assert same == bool(fraction)  # BF16 GEMMs throughout, as the plain model under BF16 autocast


def test_compare_gives_the_bf16_steps_and_the_fallback_to_the_fp8_levels_alone(tmp_path):
    from fp8lm.train.compare import _level_config
    from fp8lm.train.config import TrainConfig

    for options, field in [
        (dict(final_bf16_fraction=0.2), "final_bf16_fraction"),
        (dict(fallback=True, telemetry_every=5), "fallback"),
    ]:
        cfg = TrainConfig(**options)
        runs = {level: _level_config(cfg, level, tmp_path) for level in ("fp32", "bf16", "O1", "O2", "O3")}
        assert {level: bool(getattr(r, field)) for level, r in runs.items()} == {
            "fp32": False,
            "bf16": False,
            "O1": True,
            "O2": True,
            "O3": True,
        }
        for run in runs.values():
            run.validate()  # each level's run is one that trains
