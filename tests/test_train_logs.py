"""metrics.jsonl, telemetry.jsonl and summary.json are strict JSON: an inf or NaN is null, named in
the record's "nonfinite" entry, and read back as it was."""

import json
import math

import pytest

from fp8lm.train.config import TrainConfig
from fp8lm.train.logs import JsonLines, parse_strict, strict_json
from fp8lm.train.loop import train
from fp8lm.train.run import TrainingRun


def strict_loads(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_nonfinite_values_become_null_and_are_named():
    record = {"step": 3, "train_loss": math.inf, "grad_norm": math.nan, "fallback": [{"amax": -math.inf}], "lr": 0.5}
    text = strict_json(record)
    assert strict_loads(text) == {
        "step": 3,
        "train_loss": None,
        "grad_norm": None,
        "fallback": [{"amax": None}],
        "lr": 0.5,
        "nonfinite": {"train_loss": "inf", "grad_norm": "nan", "fallback.0.amax": "-inf"},
    }
    back = parse_strict(text)
    assert back["train_loss"] == math.inf and math.isnan(back["grad_norm"]) and back["fallback"][0]["amax"] == -math.inf
    assert back["step"] == 3 and back["lr"] == 0.5 and "nonfinite" not in back


def test_finite_records_are_written_as_json_dumps_writes_them():
    record = {"step": 1, "train_loss": 2.5, "lr": 1e-3, "tokens": 128}
    assert strict_json(record) == json.dumps(record)


def test_json_lines_are_strict_and_resume_restores_nonfinite_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = JsonLines(path, None)
    for step, loss in enumerate([1.0, math.nan, math.inf], start=1):
        log.write({"step": step, "train_loss": loss})
    log.close()
    lines = [strict_loads(line) for line in path.read_text().splitlines()]
    assert [r["train_loss"] for r in lines] == [1.0, None, None]
    assert [r.get("nonfinite") for r in lines] == [None, {"train_loss": "nan"}, {"train_loss": "inf"}]
    resumed = JsonLines(path, keep_until_step=2)
    resumed.close()
    assert len(resumed.records) == 2 and math.isnan(resumed.records[1]["train_loss"])
    assert [strict_loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_summary_json_is_strict_when_a_value_is_not_finite(tmp_path, tiny_run, token_cache, monkeypatch):
    monkeypatch.setattr(TrainingRun, "evaluate", lambda self: {"val_loss": math.nan})
    cfg = TrainConfig(**{**tiny_run, "steps": 1, "out": str(tmp_path / "run"), "cache_dir": token_cache})
    summary = train(cfg)
    assert math.isnan(summary["val_loss"])
    written = strict_loads((tmp_path / "run" / "summary.json").read_text())
    assert written["val_loss"] is None and written["nonfinite"] == {"val_loss": "nan"}
    metrics = [strict_loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["val_loss"] is None and metrics[-1]["nonfinite"] == {"val_loss": "nan"}


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_strict_json_never_writes_nan_or_infinity(value):
    text = strict_json({"a": {"b": [value, 1.0]}}, indent=1)
    assert "NaN" not in text and "Infinity" not in text
    assert strict_loads(text)["nonfinite"] == {"a.b.0": repr(value)}
