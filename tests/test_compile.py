"""torch.compile(model, fullgraph=True) of an fp8lm GPT at O1 and O2 (and of a llama at O2): one graph, no graph break, no
recompile across training steps, and the loss of every step equal to eager within float32
rounding. Runs benchmarks/compile_gpt.py (its JSON is what docs/performance.md reports).

The backend is ``aot_eager``: dynamo and AOTAutograd trace exactly what inductor gets (graph
breaks and recompiles are decided there), without generating code, which takes minutes per model
on a 2-core CPU; the inductor figures of the gpt2 preset are in docs/performance.md."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_gpt.py"


def compile_gpt(preset: str, steps: int, *extra: str, levels: str = "O1,O2") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--preset", preset, "--levels", levels, "--steps", str(steps), "--backend", "aot_eager", *extra]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def check_one_graph_and_eager_losses(result: dict, steps: int, levels: tuple[str, ...] = ("O1", "O2")) -> None:
    assert [level["level"] for level in result["levels"]] == list(levels)
    for level in result["levels"]:
        assert "error" not in level, level
        assert level["graph_breaks"] == 0 and level["graphs"] == 1 and level["recompiles"] == 0, level
        assert len(level["loss_compiled"]) == steps
        assert level["max_diff_ulps"] <= 1.0, level  # within the loss's last float32 bit
        assert all(math.isfinite(loss) for loss in level["loss_eager"])


@pytest.mark.slow
def test_fullgraph_compile_of_gpt2_sized_blocks():
    """gpt2's widths (768, vocabulary 50,257) with 1 of its 12 identical blocks: the whole preset
    takes minutes here; its figures are in benchmarks/results/compile_gpt2_cpu.json. Many layers
    in one graph without recompiles: test_linear's recompile-limit test."""
    result = compile_gpt("gpt2", 3, "--layers", "1")
    assert result["num_layers"] == 1
    check_one_graph_and_eager_losses(result, steps=3)


@pytest.mark.slow
def test_fullgraph_compile_of_a_llama_at_o2():
    """--arch llama (RMSNorm, rotary positions, SwiGLU, two query heads sharing one key/value head)
    at O2: one graph over the training steps, the eager losses."""
    result = compile_gpt("tiny", 3, "--arch", "llama", "--n-kv-head", "1", levels="O2")
    assert (result["arch"], result["n_kv_head"]) == ("llama", 1)
    check_one_graph_and_eager_losses(result, steps=3, levels=("O2",))


@pytest.mark.slow
def test_fullgraph_compile_of_a_gpt_with_a_fine_grained_recipe():
    """blockwise (1 x 128 / 128 x 128 scales, emulated GEMMs) at O2: one graph over the steps, the
    eager losses; with the CPU quantization as ops (the default) and traced op by op."""
    result = compile_gpt("tiny", 3, "--recipe", "blockwise", "--cpu-quantization", "op,traced", levels="O2")
    assert result["recipe"] == "blockwise"
    assert [level["cpu_quantization"] for level in result["levels"]] == ["op", "traced"]
    check_one_graph_and_eager_losses({"levels": result["levels"][:1]}, steps=3, levels=("O2",))
    check_one_graph_and_eager_losses({"levels": result["levels"][1:]}, steps=3, levels=("O2",))
