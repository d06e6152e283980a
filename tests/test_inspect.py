"""`fp8lm inspect RUN_DIR`: the worst tensors of a run's telemetry and its heatmap; clear errors."""

import json

import pytest

from cli_helpers import run_main
from fp8lm.train.config import TrainConfig
from fp8lm.train.loop import train
from fp8lm.train.telemetry_report import heatmap_grid


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_run, token_cache):
    out = tmp_path_factory.mktemp("inspect") / "run"
    train(
        TrainConfig(
            **{
                **tiny_run,
                "cache_dir": token_cache,
                "opt_level": "O2",
                "steps": 5,
                "telemetry_every": 2,
                "out": str(out),
            }
        )
    )
    return out


def test_prints_the_worst_tensors_and_writes_the_heatmap(run, capsys):
    rc, out, err = run_main(["inspect", str(run), "--top", "3"], capsys)
    assert rc == 0, err
    records = [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]
    worst_underflow = max(records, key=lambda r: r["underflow"])
    table = out[out.index("worst underflow:") : out.index("worst saturation:")]
    first_row = table.splitlines()[3].split()
    assert first_row[:3] == [str(worst_underflow["step"]), worst_underflow["layer"], worst_underflow["kind"]]
    assert len(table.strip().splitlines()) == 1 + 2 + 3  # title, header, rule, --top rows
    png = run / "telemetry_grad_output_underflow.png"
    assert out.strip().endswith(f"heatmap: {png}") and png.stat().st_size > 5_000


def test_heatmap_grid_is_layers_by_sampled_steps_with_the_worst_micro_batch():
    records = [
        {"step": 1, "layer": "a", "kind": "input", "underflow": 0.0},  # forward: model order
        {"step": 1, "layer": "b", "kind": "input", "underflow": 0.0},
        {"step": 1, "layer": "b", "kind": "grad_output", "underflow": 0.0},  # backward: reversed
        {"step": 1, "layer": "a", "kind": "grad_output", "underflow": 0.1},
        {"step": 1, "layer": "a", "kind": "grad_output", "underflow": 0.3},  # a second micro-batch
        {"step": 3, "layer": "b", "kind": "grad_output", "underflow": 0.2},
        {"step": 3, "layer": "a", "kind": "input", "underflow": 0.9},
    ]
    layers, steps, grid = heatmap_grid(records, "grad_output", "underflow")
    assert layers == ["a", "b"] and steps == [1, 3]
    assert grid[0][0] == 0.3 and grid[1][0] == 0.0 and grid[1][1] == 0.2
    assert grid[0][1] != grid[0][1]  # NaN: no record


def one_error_line(rc, out, err, match):
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and match in err, (rc, out, err)


def test_missing_folder_and_a_run_without_telemetry_are_one_clear_line(run, tmp_path, tiny_run, token_cache, capsys):
    one_error_line(*run_main(["inspect", str(tmp_path / "nope")], capsys), "does not exist")
    bare = tmp_path / "bare"
    train(
        TrainConfig(**{**tiny_run, "cache_dir": token_cache, "steps": 1, "out": str(bare)})
    )  # bf16: no FP8 layers, no telemetry
    capsys.readouterr()
    one_error_line(*run_main(["inspect", str(bare)], capsys), "no telemetry recorded")
    one_error_line(*run_main(["inspect", str(run), "--top", "0"], capsys), "--top must be >= 1")
    assert not list(bare.glob("*.png"))
