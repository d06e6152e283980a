import json
import math
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from fp8lm.train.checkpoint import CheckpointError, list_checkpoints
from fp8lm.train.config import FP8_LEVELS, OPT_LEVELS, RunError, TrainConfig
from fp8lm.train.loop import lr_at, train
from fp8lm.train.report import read_metrics

# Real text, small enough to scan in milliseconds: the standard library's email package.
EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
TINY = dict(model="tiny", batch_size=4, seq_len=32, eval_every=4, eval_batches=2, progress=False, lr=1e-2, data=EMAIL)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


def cfg(tmp_path, cache, **kw):
    return TrainConfig(**{**TINY, "out": str(tmp_path / "run"), "cache_dir": cache, **kw})


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    lrs = [lr_at(s, 1.0, 10, 110, 0.1) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    for s in range(10, 110):  # float64 reference of the cosine
        ref = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 99))
        assert lrs[s] == pytest.approx(ref, rel=1e-12)
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_run_writes_metrics_summary_and_keeps_the_last_checkpoints(tmp_path, cache):
    s = train(cfg(tmp_path, cache, steps=10, grad_accum=2, save_every=3, keep_checkpoints=2))
    out = tmp_path / "run"
    for key in ("train_loss", "val_loss", "tokens_per_s", "steps", "opt_level", "memory", "act_bytes_per_token"):
        assert key in s
    assert s["steps"] == 10 and s["tokens"] == 10 * 4 * 2 * 32 and s["opt_level"] == "bf16"
    assert json.loads((out / "summary.json").read_text())["val_loss"] == s["val_loss"]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 10]
    assert s["val_loss"] == records[-1]["val_loss"]
    assert s["train_loss"] == pytest.approx(sum(r["train_loss"] for r in records) / 10)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000009.pt", "step_00000010.pt"]
    ckpt = torch.load(out / "checkpoints" / "step_00000010.pt", weights_only=True)
    assert ckpt["step"] == 10 and ckpt["opt_level"] == "bf16"
    assert not list(out.rglob("*.tmp*"))


# O2: test_train_resume.py; the FP8 levels take several seconds: slow tier
@pytest.mark.parametrize(
    "level", [pytest.param(lv, marks=pytest.mark.slow) if lv in FP8_LEVELS else lv for lv in OPT_LEVELS if lv != "O2"]
)
def test_resume_continues_bit_identically(tmp_path, cache, level):
    whole = train(cfg(tmp_path, cache, opt_level=level, steps=8, save_every=4, keep_checkpoints=3))
    out = tmp_path / "run"
    resumed_out = tmp_path / "resumed"
    shutil.copytree(out, resumed_out)
    (resumed_out / "summary.json").unlink()
    (resumed_out / "checkpoints" / "step_00000008.pt").unlink()
    resumed = train(cfg(tmp_path, cache, opt_level=level, steps=8, save_every=4, out=str(resumed_out), resume=True))
    assert (resumed_out / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()
    assert resumed["val_loss"] == whole["val_loss"] and resumed["train_loss"] == whole["train_loss"]


def test_resume_can_extend_a_finished_run(tmp_path, cache):
    train(cfg(tmp_path, cache, steps=4))
    s = train(cfg(tmp_path, cache, steps=6, resume=True))
    assert s["steps"] == 6 and len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 6


def test_fp32_saves_more_activation_bytes_than_bf16(tmp_path, cache):
    a = train(cfg(tmp_path, cache, steps=1, opt_level="fp32", out=str(tmp_path / "a")))
    b = train(cfg(tmp_path, cache, steps=1, opt_level="bf16", out=str(tmp_path / "b")))
    assert b["act_bytes_per_token"] < a["act_bytes_per_token"]


@pytest.mark.slow  # 30 steps
def test_init_from_starts_from_the_checkpoint_weights(tmp_path, cache):
    base = train(cfg(tmp_path, cache, steps=30, eval_every=30))
    fine = train(cfg(tmp_path, cache, steps=1, lr=1e-9, init_from=str(tmp_path / "run"), out=str(tmp_path / "ft")))
    assert fine["val_loss"] == pytest.approx(base["val_loss"], abs=1e-3)


def test_refuses_to_overwrite_a_run_and_to_resume_nothing(tmp_path, cache):
    with pytest.raises(RunError, match="no checkpoint"):
        train(cfg(tmp_path, cache, steps=2, resume=True))
    train(cfg(tmp_path, cache, steps=2))
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(RunError, match="already holds a training run; pass --resume"):
        train(cfg(tmp_path, cache, steps=2))
    with pytest.raises(RunError, match="already reached step 2"):
        train(cfg(tmp_path, cache, steps=2, resume=True))
    with pytest.raises(CheckpointError, match="opt level bf16, not fp32"):
        train(cfg(tmp_path, cache, steps=3, resume=True, opt_level="fp32"))
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before


def test_checkpoint_of_another_shape_is_refused_before_any_output(tmp_path, cache):
    train(cfg(tmp_path, cache, steps=1))
    with pytest.raises(CheckpointError, match="n_embd=32 \\(here 64\\)"):
        train(cfg(tmp_path, cache, steps=1, n_embd=64, init_from=str(tmp_path / "run"), out=str(tmp_path / "ft")))
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(opt_level="O7"), "unknown opt level 'O7'"),
        (dict(steps=0), "steps must be >= 1"),
        (dict(n_embd=30, n_head=4), "divisible by n_head"),
        (dict(hf_dataset="y"), "either --data or --hf-dataset"),
        (dict(resume=True, init_from="x"), "drop --init-from"),
        (dict(amp_options={"module_filter": None}), "apply to O1/O2/O3 only"),
        (dict(exp_avg_sq="E4M3"), "which only O2/O3 have"),
        (dict(telemetry_every=-1), "telemetry_every must be >= 0"),
        (dict(fallback=True), "needs an FP8 level"),
        (dict(opt_level="O2", fallback=True, telemetry_every=0), "--telemetry-every >= 1"),
        (dict(val_fraction=1.5), "--val-fraction must be a finite number in \\(0.0, 1.0\\), got 1.5"),
        (dict(lr=math.inf), "--lr must be a finite number in \\(0.0, inf\\), got inf"),
        (dict(lr=0.0), "--lr must be a finite number"),
        (dict(weight_decay=math.nan), "--weight-decay must be a finite number in \\[0.0, inf\\), got nan"),
        (dict(weight_decay=-0.1), "--weight-decay must be"),
        (dict(grad_clip=math.inf), "--grad-clip must be"),
        (dict(min_lr_ratio=math.nan), "--min-lr-ratio must be"),
        (dict(beta2=1.0), "--beta2 must be a finite number in \\[0.0, 1.0\\), got 1.0"),
        (dict(val_fraction=math.nan), "--val-fraction must be"),
        (dict(device="tpu:x"), "unknown device 'tpu:x'"),
        (dict(opt_level="O2", exp_avg_sq="int4"), "unknown --exp-avg-sq format 'int4'"),
    ],
)
def test_bad_config_is_refused_before_any_output(tmp_path, cache, kw, match):
    with pytest.raises(RunError, match=match):
        train(cfg(tmp_path, cache, **kw))
    assert not (tmp_path / "run").exists()


def test_tensorboard_events_when_tensorboard_is_installed(tmp_path, cache):
    pytest.importorskip("tensorboard")
    train(cfg(tmp_path, cache, steps=2, eval_every=1))
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_fp8_second_moment_becomes_a_policy_override_of_initialize():
    cfg = TrainConfig(opt_level="O2", exp_avg_sq="e5m2", amp_options={"history_len": 4})
    assert cfg.initialize_options() == {"history_len": 4, "policy": {"*": {"exp_avg_sq": "E5M2"}}}
    assert TrainConfig(opt_level="O2").initialize_options() == {}


def test_telemetry_every_n_steps_goes_to_telemetry_jsonl_and_the_metrics(tmp_path, cache):
    s = train(cfg(tmp_path, cache, opt_level="O2", steps=5, telemetry_every=2))
    out = tmp_path / "run"
    records = read_metrics(out / "telemetry.jsonl")
    assert sorted({r["step"] for r in records}) == [1, 3, 5]  # steps 1, 3, 5: sampled every 2 from the first
    assert {r["kind"] for r in records} == {"input", "weight", "grad_output", "weight_grad", "exp_avg", "exp_avg_sq"}
    metrics = read_metrics(out / "metrics.jsonl")
    for m in metrics:
        sampled = [r for r in records if r["step"] == m["step"]]
        if sampled:
            assert m["telemetry_underflow"] == max(r["underflow"] for r in sampled)
            assert m["telemetry_saturation"] == max(r["saturation"] for r in sampled)
        else:
            assert "telemetry_underflow" not in m
    assert s["fallback_events"] == [] and s["world_size"] == 1 and s["comm_bytes_per_step"] == 0.0
    train(cfg(tmp_path, cache, opt_level="O2", steps=3, telemetry_every=0, out=str(tmp_path / "off")))
    assert not (tmp_path / "off" / "telemetry.jsonl").exists()


def test_fallback_switches_are_logged_and_checkpointed(tmp_path, cache, monkeypatch, capsys):
    import fp8lm.train.run as run
    from fp8lm.fallback import FallbackPolicy, PrecisionFallback

    # thresholds any underflow or saturation crosses: such a layer switches to BF16 at once
    eager = FallbackPolicy(underflow=1e-12, saturation=1e-12, patience=1)
    monkeypatch.setattr(run, "PrecisionFallback", lambda layers: PrecisionFallback(layers, eager))
    s = train(cfg(tmp_path, cache, opt_level="O1", steps=3, telemetry_every=2, fallback=True))
    events = [e for m in read_metrics(tmp_path / "run" / "metrics.jsonl") for e in m.get("fallback", [])]
    assert events and events[0]["to"] == "bf16"
    assert s["fallback_events"] == events
    printed = capsys.readouterr().out
    assert all(f"step {e['step']}: fallback: {e['layer']} -> {e['to']}" in printed for e in events)
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "step_00000003.pt", weights_only=True)
    last = {e["layer"]: e["to"] == "bf16" for e in events}  # the latest switch of each layer
    assert {k: v for k, v in ckpt["fallback"]["high_precision"].items() if k in last} == last
    assert ckpt["fallback"]["events"] == events
