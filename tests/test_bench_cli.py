"""`fp8lm bench`: runs a benchmark script of the checkout, echoes and saves its JSON; clear errors."""

import json

from cli_helpers import run_main
from fp8lm.bench import scripts_dir


def test_runs_a_tiny_gemm_benchmark_and_saves_its_json(tmp_path, capsys):
    rc, out, err = run_main(
        ["bench", "gemm", "--out", str(tmp_path), "--", "--shapes", "64x64x64", "--reps", "1"], capsys
    )
    assert rc == 0, err
    saved = json.loads((tmp_path / "gemm.json").read_text())
    assert json.loads(out[: out.rindex("}") + 1]) == saved
    assert "machine" in json.dumps(saved) and "64" in json.dumps(saved)


def one_error_line(rc, out, err, match):
    """Exit status 2 and one error line last on stderr (after "running NAME" progress lines)."""
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("fp8lm bench: error: ") and match in last, (rc, out, err)
    assert "Traceback" not in err


def test_bad_names_missing_scripts_and_broken_output_are_clear_errors(tmp_path, capsys):
    one_error_line(*run_main(["bench", "gemm", "nope", "--out", str(tmp_path)], capsys), "unknown benchmark(s) nope")
    one_error_line(*run_main(["bench", "gemm", "--scripts", str(tmp_path)], capsys), "no benchmark scripts in")
    fake = tmp_path / "benchmarks"
    fake.mkdir()
    (fake / "common.py").write_text("")
    (fake / "gemm.py").write_text("print('not json')\n")
    (fake / "quantize.py").write_text("import sys\nsys.exit(3)\n")
    out = tmp_path / "out"
    one_error_line(
        *run_main(["bench", "gemm", "--scripts", str(fake), "--out", str(out)], capsys), "printed no valid JSON"
    )
    one_error_line(*run_main(["bench", "quantize", "--scripts", str(fake), "--out", str(out)], capsys), "exit status 3")
    assert not out.exists() or not list(out.iterdir())
    rc, _, err = run_main(["train", "--steps", "1", "--", "--reps", "1"], capsys)
    assert rc == 2 and "for fp8lm bench only" in err


def test_the_scripts_are_found_in_this_checkout():
    assert (scripts_dir() / "gemm.py").is_file()
