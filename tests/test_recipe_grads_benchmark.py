"""benchmarks/recipe_grads.py: weight gradients at rest under a fine-grained recipe. Its pure
pieces against float64 (what row scales keep of a gradient, what the E4M3 first moment then
keeps of either), and a run on a tiny GPT."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "recipe_grads.py"


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("recipe_grads", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe_grads = _module()


def _graded_rows() -> torch.Tensor:
    """Rows 2**(-4 i) apart, i = 0..7: the lowest lie below one E4M3 scale's 17.8 binades."""
    g = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).abs() + 1
    return g * torch.tensor([2.0 ** (-4 * i) for i in range(8)])[:, None]


def test_row_scales_keep_the_small_rows_that_one_scale_flushes():
    g = _graded_rows()
    tensorwise, rowwise = (recipe_grads.stored(g, s) for s in ("tensorwise", "rowwise"))
    assert recipe_grads.lost(g, rowwise) == 0.0
    assert recipe_grads.lost(g, tensorwise) >= 2 / 8  # rows 6 and 7 (2**-24, 2**-28) at least
    assert bool((tensorwise[6:] == 0).all()) and bool((rowwise[6:] != 0).all())


def test_the_e4m3_first_moment_loses_them_either_way():
    """``m' = beta1 m + (1 - beta1) q(g)`` stored with one E4M3 scale, from m = 0, against float64:
    every value that only row scales kept is flushed by the moment, under either storage."""
    g = _graded_rows()
    exact = 0.1 * g.double()
    m = torch.zeros_like(g)
    stored = {s: recipe_grads.stored(g, s) for s in ("tensorwise", "rowwise")}
    moments = {s: recipe_grads.next_moment(m, q, 0.9) for s, q in stored.items()}
    rescued = (stored["tensorwise"] == 0) & (stored["rowwise"] != 0)
    assert int(rescued.sum()) >= 2 * 64  # rows 6 and 7 at least
    assert bool((moments["rowwise"][rescued] == 0).all()) and bool((moments["tensorwise"][rescued] == 0).all())
    assert recipe_grads.lost(exact, moments["rowwise"]) > 0
    sqnr = {s: recipe_grads.sqnr_db(exact, q) for s, q in moments.items()}
    assert abs(sqnr["rowwise"] - sqnr["tensorwise"]) < 0.5 and sqnr["rowwise"] > 25


def test_recipe_grads_benchmark_on_a_tiny_gpt(token_cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--preset", "tiny", "--steps", "2", "--recipe", "rowwise", "--cache-dir", token_cache]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["head"] == "lm_head" and result["layers"] == 9
    assert set(result["storage"]) == set(recipe_grads.STORAGES)
    assert result["storage"]["rowwise"]["grad_lost"]["worst"] <= result["storage"]["tensorwise"]["grad_lost"]["worst"]
