"""benchmarks/level3.py's gathering: a run folder's levels over a saved table's (``--merge``), with the
gaps to one process and the byte ratios computed from the merged levels."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "level3.py"


def _level3():
    spec = importlib.util.spec_from_file_location("level3", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(val_loss: float, bytes_per_step: float, tokens_per_s: float = 1000.0) -> dict:
    return {
        "val_loss": val_loss,
        "train_loss": val_loss,
        "world_size": 4,
        "comm_bytes_per_step": bytes_per_step,
        "tokens_per_s": tokens_per_s,
        "skipped_steps": 0,
    }


def _write_run(out: Path, layout: str, level: str, summary: dict, command: list[str]) -> None:
    (out / layout / level).mkdir(parents=True)
    (out / layout / level / "summary.json").write_text(json.dumps(summary))
    (out / layout / "command.json").write_text(json.dumps([command]))


def test_merge_retrains_one_level_and_keeps_the_others(tmp_path):
    level3 = _level3()
    known = {
        "single": {"command": "python old-single", "levels": {"bf16": _summary(2.0, 0), "O1": _summary(2.2, 0)}},
        "fsdp": {
            "command": "python old-fsdp",
            "levels": {"bf16": _summary(2.0, 100.0), "O1": _summary(2.2, 140.0), "O2": _summary(2.0, 60.0)},
        },
        "tp": {
            "command": "python old-tp",
            "levels": {"bf16": {**_summary(2.0, 50.0), "val_loss_vs_one_process": -0.5, "time_vs_one_process": 3.0}},
        },
    }
    _write_run(tmp_path, "single", "O1", _summary(2.0, 0), ["new-single"])
    _write_run(tmp_path, "fsdp", "O1", _summary(2.02, 70.0), ["new-fsdp"])

    layouts = level3.gather(tmp_path, json.loads(json.dumps(known)))

    fsdp = layouts["fsdp"]
    assert set(fsdp["levels"]) == {"bf16", "O1", "O2"}
    assert fsdp["levels"]["O1"]["comm_bytes_per_step"] == 70.0  # the run folder's level replaces the table's
    assert fsdp["levels"]["O2"]["comm_bytes_per_step"] == 60.0  # the others stay
    assert fsdp["o1_over_bf16_bytes"] == 0.7 and fsdp["o2_over_bf16_bytes"] == 0.6
    # the gap to one process is against the merged one-process level: the run folder's O1
    assert abs(fsdp["levels"]["O1"]["val_loss_vs_one_process"] - 0.01) < 1e-12
    assert abs(fsdp["levels"]["bf16"]["val_loss_vs_one_process"]) < 1e-12
    assert fsdp["command"] == "python old-fsdp && python new-fsdp"  # both commands are named
    assert layouts["tp"]["command"] == "python old-tp"  # a layout the run folder lacks stays as the table has it
    assert layouts["tp"]["levels"]["bf16"]["comm_bytes_per_step"] == 50.0
    # its gap and step time were measured against the one-process run of their time: kept as saved
    assert layouts["tp"]["levels"]["bf16"]["val_loss_vs_one_process"] == -0.5
    assert layouts["tp"]["levels"]["bf16"]["time_vs_one_process"] == 3.0


def test_merging_a_folder_again_names_its_commands_once(tmp_path):
    level3 = _level3()
    _write_run(tmp_path, "single", "O1", _summary(2.0, 0), ["single"])
    _write_run(tmp_path, "fsdp", "O1", _summary(2.02, 70.0), ["fsdp"])
    known = {"fsdp": {"command": "python old-fsdp", "levels": {"bf16": _summary(2.0, 100.0)}}}
    once = level3.gather(tmp_path, json.loads(json.dumps(known)))
    twice = level3.gather(tmp_path, json.loads(json.dumps(once)))
    assert once["fsdp"]["command"] == twice["fsdp"]["command"] == "python old-fsdp && python fsdp"
    assert twice["single"]["command"] == "python single"


def test_gather_without_a_table_reads_the_run_folder_alone(tmp_path):
    level3 = _level3()
    _write_run(tmp_path, "fsdp", "bf16", _summary(2.0, 100.0), ["fsdp"])
    layouts = level3.gather(tmp_path)
    assert set(layouts) == {"fsdp"} and set(layouts["fsdp"]["levels"]) == {"bf16"}
    assert "o1_over_bf16_bytes" not in layouts["fsdp"]
