"""The mixture of experts on the CUDA code path (fake CUDA tensors, benchmarks/moe.py --trace-only):
no host synchronization in a training step, and the experts' GEMMs as grouped kernels."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "moe.py"
pytestmark = pytest.mark.slow  # one traced run of the script, ~15 s


@pytest.fixture(scope="module")
def trace() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(SCRIPT), "--trace-only", "--trace-shape", "4x64x32x64"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["cuda_trace"]


@pytest.mark.parametrize("model", ["grouped", "grouped_rowwise", "moe_layer", "moe_layer_bf16"])
def test_a_training_step_reads_nothing_back_to_the_host(trace, model):
    # .item(), .tolist(), .cpu() and torch.bincount's size on a GPU each wait for the device
    assert trace[model]["total"]["syncs"] == 0
    assert trace[model]["forward"]["launches"] > 0 and trace[model]["backward"]["launches"] > 0


def test_the_experts_gemms_are_grouped_kernels(trace):
    grouped, loop = trace["grouped"], trace["loop_of_fp8linear"]
    assert grouped["gemm_ops"] == ["_grouped_mm", "_scaled_grouped_mm"]
    assert grouped["forward"]["fp8_gemms"] == 1 and grouped["total"]["gemms"] == 3  # one per pass
    assert loop["total"]["gemms"] == loop["total"]["fp8_gemms"] == 3 * 4  # one per expert and pass
    assert grouped["total"]["launches"] < loop["total"]["launches"] / 2
    rowwise = trace["grouped_rowwise"]  # E4M3 output gradients: all three GEMMs grouped FP8
    assert rowwise["gemm_ops"] == ["_scaled_grouped_mm"] and rowwise["total"]["fp8_gemms"] == 3
    # the mixture: router GEMM (mm) and the experts' two grouped layers
    assert trace["moe_layer"]["forward"]["gemms"] == 3 and trace["moe_layer_bf16"]["total"]["fp8_gemms"] == 0
