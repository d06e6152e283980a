"""benchmarks/compiled_quantize_check.py (in benchmarks/gpu.sh) on the CPU: the compiled
quantization and an inductor-compiled layer against eager, exact with the quantization as ops,
and far off when traced where the blocks do not divide the shape (inductor's CPU fault, which
the script exists to look for on a GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compiled_quantize_check.py"


def check(*extra: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--device", "cpu", "--recipes", "blockwise", *extra]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["rows"]


@pytest.mark.slow  # inductor compiles C++ for 3 layers twice (about 40 s on 2 cores)
def test_the_check_passes_with_the_ops_and_finds_the_fault_traced():
    for row in check():
        assert all(row["fused"].values()), row
        assert row["layer"] == {"out": 0.0, "grad_x": 0.0, "grad_w": 0.0}, row
    for row in check("--cpu-traced"):
        divides = row["shape"] == [256, 256]
        assert all(row["fused"].values()), row
        if divides:
            assert row["layer"] == {"out": 0.0, "grad_x": 0.0, "grad_w": 0.0}, row
        else:  # values read from wherever: measured 1e17 and more, inf or NaN; zeros would give 1
            fault_seen = not all(error <= 1e-3 for error in row["layer"].values())  # NaN counts
            assert fault_seen, f"inductor's CPU fault no longer shows (a newer torch?): {row}"
