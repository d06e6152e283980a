"""benchmarks/recipes.py runs, and its figures say what the recipes are for: an outlier row costs
the other rows their precision under one scale per tensor, not under row or block scales."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "recipes.py"


def test_recipes_benchmark_on_a_tiny_gpt(token_cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--preset", "tiny", "--steps", "2", "--timing-steps", "1", "--cache-dir", token_cache]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    outliers = result["outlier_rows_sqnr_db"]
    tensorwise = outliers["tensorwise-current-e4m3"]["input"]["other_rows_db"]
    for name in ("rowwise", "blockwise", "mxfp8"):
        assert outliers[name]["input"]["other_rows_db"] > tensorwise + 5, (name, outliers[name], tensorwise)
    sqnr = result["sqnr_db"]
    assert sqnr["nvfp4"]["input"]["mean_db"] < sqnr["rowwise"]["input"]["mean_db"] - 5  # 4-bit elements
    assert result["layers"] == 9 and set(result["step_ms"]) >= {"tensorwise-delayed", "rowwise", "nvfp4"}
    assert result["bits_per_element"]["mxfp8"]["activation"] == 8.25
