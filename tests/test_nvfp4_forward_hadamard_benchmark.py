"""benchmarks/nvfp4_forward_hadamard.py runs, and its transform pair leaves the exact products as
they are. On a tensor with outlier features the transform loses precision in the forward: an
outlier is its block's largest value, which NVFP4 keeps nearly exactly (it sets the block's scale);
spread over the block, it is held in sixteen 4-bit values instead (docs/measurements/recipes.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "nvfp4_forward_hadamard.py"


def test_nvfp4_forward_hadamard_benchmark_on_a_tiny_gpt(token_cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--preset", "tiny", "--steps", "2", "--cache-dir", token_cache]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["exact_rel_error"] < 1e-5
    for recipe in ("nvfp4", "nvfp4-4over6"):
        layers, synthetic = result["gemm_output_sqnr_db"][recipe], result["outlier_features_sqnr_db"][recipe]
        assert set(layers) == {"0", "16", "32", "64", "128"}
        assert layers["0"]["fprop"]["layers"] == result["layers"] == 9
        # 4-bit elements: far from exact, far from nothing
        assert 10 < layers["0"]["fprop"]["mean_db"] < 40 and 10 < layers["0"]["dgrad"]["mean_db"] < 40
        for n in ("16", "32", "64", "128"):
            assert synthetic[n]["fprop"] < synthetic["0"]["fprop"], (recipe, n, synthetic)
