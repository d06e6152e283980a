"""benchmarks/recipe_layers.py (in benchmarks/gpu.sh) runs on CPU at toy sizes: each recipe's layer
step, the GEMM its forward takes, and its distance from the emulated layer."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "recipe_layers.py"


def test_recipe_layers_benchmark_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--device", "cpu", "--tokens", "128", "--width", "64", "--reps", "1", "--backend", "scaled_mm"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)["recipes"]
    assert set(result) == {"tensorwise-delayed", "rowwise", "blockwise", "mxfp8", "nvfp4"}
    # torch's CPU _scaled_mm takes tensorwise and row-wise scales; the block formats are emulated here
    assert result["rowwise"]["path"] == "scaled_mm:rowwise" and result["tensorwise-delayed"]["path"] == "scaled_mm"
    assert {result[name]["path"] for name in ("blockwise", "mxfp8", "nvfp4")} == {"emulated"}
    for name, figures in result.items():
        assert figures["step_ms"] > 0 and figures["next_microbatch_ms"] > 0 and figures["over_bf16"] > 0, name
        assert max(figures["max_rel_err"].values()) < 2**-6, (name, figures["max_rel_err"])
        if figures["path"] == "emulated":  # the same computation as the reference layer
            assert max(figures["max_rel_err"].values()) == 0, name
