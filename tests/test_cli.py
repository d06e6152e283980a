import json
import os
import shutil
import subprocess
import sys

from cli_helpers import run_main
from fp8lm.cli import SUBCOMMANDS, build_parser


def test_parser_has_train_and_compare_with_the_same_run_options():
    parser = build_parser()
    assert {"train", "compare"} <= set(SUBCOMMANDS)
    t = parser.parse_args(["train", "--steps", "5", "--opt-level", "O2"])
    c = parser.parse_args(["compare", "--steps", "5"])
    assert t.steps == c.steps == 5 and t.opt_level == "O2" and c.levels == "bf16,O1,O2"
    assert c.out == "runs/compare"


def test_train_prints_the_summary(tmp_path, token_cache, email_corpus, tiny_cli_args, capsys):
    data = ["--data", email_corpus, "--cache-dir", token_cache]
    rc, out, _ = run_main(["train", *tiny_cli_args, *data, "--steps", "3", "--out", str(tmp_path / "r")], capsys)
    assert rc == 0
    printed = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert printed["steps"] == 3 and printed["opt_level"] == "bf16"
    assert (tmp_path / "r" / "summary.json").exists()


def test_compare_writes_compare_json_and_plot_and_prints_the_table(
    tmp_path, token_cache, email_corpus, tiny_cli_args, capsys
):
    out_dir = tmp_path / "cmp"
    run = ["compare", *tiny_cli_args, "--levels", "bf16,fp32", "--steps", "4", "--out", str(out_dir)]
    data = ["--data", email_corpus, "--eval-every", "2", "--cache-dir", token_cache]
    rc, out, _ = run_main([*run, *data], capsys)
    assert rc == 0
    result = json.loads((out_dir / "compare.json").read_text())
    assert list(result["levels"]) == ["bf16", "fp32"]
    for row in result["levels"].values():
        for key in ("val_loss", "rel_gap_vs_bf16", "bytes_per_param", "act_bytes_per_token", "tokens_per_s"):
            assert key in row
    assert result["levels"]["bf16"]["rel_gap_vs_bf16"] == 0.0
    assert result["steps"] == 4 and result["tokens"] == 4 * 4 * 32
    assert (out_dir / "loss.png").stat().st_size > 10_000
    assert "val_loss" in out and "fp32" in out and f"plot: {out_dir / 'loss.png'}" in out
    # rerunning into the same folder is refused before any level trains
    rc, _, err = run_main(run, capsys)
    assert rc == 2 and "already holds a training run" in err
    # an interrupted comparison (fp32 never started) continues with --resume: bf16 is kept as it was
    bf16_summary = (out_dir / "bf16" / "summary.json").read_bytes()
    shutil.rmtree(out_dir / "fp32")
    (out_dir / "compare.json").unlink()
    rc, _, _ = run_main([*run, *data, "--resume"], capsys)
    assert rc == 0 and (out_dir / "bf16" / "summary.json").read_bytes() == bf16_summary
    again = json.loads((out_dir / "compare.json").read_text())["levels"]
    assert again["bf16"] == result["levels"]["bf16"]
    assert again["fp32"]["val_loss"] == result["levels"]["fp32"]["val_loss"]  # retrained, same seed and data


def one_error_line(rc, out, err):
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0]
    return lines[0]


def test_bad_inputs_give_one_clear_line_and_leave_nothing_complete(
    tmp_path, token_cache, email_corpus, tiny_cli_args, capsys
):
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        "invalid choice: 'O7'": ["train", "--opt-level", "O7", "--out", str(out)],
        "does not exist": ["train", *tiny_cli_args, "--data", str(tmp_path / "missing"), "--out", str(out)],
        "holds no non-empty text files": ["train", *tiny_cli_args, "--data", str(empty), "--out", str(out)],
        "unknown opt level(s) O7": ["compare", *tiny_cli_args, "--levels", "bf16,O7", "--out", str(out)],
        "--grad-sync-scaling sets the FP8 gradient all-reduce of O1/O2 (this run is bf16)": [
            "train",
            *tiny_cli_args,
            "--grad-sync-scaling",
            "shared",
            "--out",
            str(out),
        ],
        "needs the 'datasets' package": ["train", *tiny_cli_args, "--hf-dataset", "wikitext", "--out", str(out)],
    }
    if _importable("datasets"):
        del cases["needs the 'datasets' package"]
    for expected, argv in cases.items():
        line = one_error_line(*run_main(argv, capsys))
        assert expected in line, line
    assert not out.exists()
    # a checkpoint of another model shape
    assert (
        run_main(
            [
                "train",
                *tiny_cli_args,
                "--data",
                email_corpus,
                "--steps",
                "1",
                "--out",
                str(tmp_path / "base"),
                "--cache-dir",
                token_cache,
            ],
            capsys,
        )[0]
        == 0
    )
    line = one_error_line(
        *run_main(
            [
                "train",
                *tiny_cli_args,
                "--data",
                email_corpus,
                "--n-layer",
                "3",
                "--steps",
                "1",
                "--init-from",
                str(tmp_path / "base"),
                "--out",
                str(out),
                "--cache-dir",
                token_cache,
            ],
            capsys,
        )
    )
    assert "does not fit this model" in line and "n_layer=2 (here 3)" in line
    assert not out.exists()


def _importable(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_installed_command_reports_errors_on_stderr_with_nonzero_exit(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fp8lm.cli", "train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"fp8lm train: error: data path {str(tmp_path / 'nope')!r} does not exist; "
        "pass an existing text file or folder to --data"
    )
    assert not (tmp_path / "out").exists()
