"""benchmarks/vllm_serve.py's scoring of vLLM's prompt log-probabilities against fp8lm's
predictions (no vLLM needed): the positions line up, an off-by-one would show, and
benchmarks/export_agreement.py --serve-dir writes what it reads."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cli_helpers import run_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from vllm_serve import score  # noqa: E402


def served_as(logits: torch.Tensor, windows: list[list[int]]) -> list[list]:
    """What vLLM's ``prompt_logprobs=1`` returns for prompts ``window[:-1]`` of a model whose
    next-token logits at each position are ``logits``: None, then per position the true token's
    and the most likely token's log-probabilities with their ranks."""
    out = []
    for w, window in enumerate(windows):
        logp = torch.log_softmax(logits[w], -1)
        entries: list = [None]
        for p in range(len(window) - 2):
            order = logp[p].argsort(descending=True).tolist()
            wanted = {window[p + 1], order[0]}
            entries.append({t: SimpleNamespace(logprob=logp[p, t].item(), rank=order.index(t) + 1) for t in wanted})
        out.append(entries)
    return out


def test_a_server_computing_fp8lms_model_scores_full_agreement_and_its_perplexity():
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 16, (3, 9), generator=g)
    logits = torch.randn(3, 8, 16, generator=g) * 3
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logp = torch.log_softmax(logits, -1)
    reference = {
        "inputs": inputs.tolist(),
        "targets": targets.tolist(),
        "reference_argmax": logits.argmax(-1).tolist(),
        "reference_target_logprob": logp.gather(-1, targets[..., None])[..., 0].tolist(),
    }
    result = score(reference, served_as(logits, inputs.tolist()), tokens=15)
    assert result["positions"] == 15 and result["agreement"] == 1.0  # 3 windows x 6 positions, cut at 15
    assert math.isclose(result["perplexity"], result["reference_perplexity"], rel_tol=1e-12)
    used = torch.cat([logp[w, :6].gather(-1, targets[w, :6, None])[:, 0] for w in range(3)])[:15]
    assert math.isclose(result["reference_perplexity"], math.exp(-used.double().mean().item()), rel_tol=1e-9)
    shifted = torch.roll(logits, 1, dims=1)  # a server one position off
    assert score(reference, served_as(shifted, inputs.tolist()), tokens=15)["agreement"] < 0.5


def test_the_reference_export_agreement_writes_lines_up_with_the_scoring(
    tmp_path, email_corpus, token_cache, tiny_cli_args, capsys
):
    """benchmarks/export_agreement.py --serve-dir writes what `score` reads: a server that returns
    fp8lm's own predictions and log-probabilities scores agreement 1 and fp8lm's perplexity."""
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    run = tmp_path / "run"
    cmd = ["train", *tiny_cli_args, "--steps", "2", "--opt-level", "O2", "--recipe", "rowwise", "--arch", "llama"]
    assert run_main([*cmd, "--data", email_corpus, "--cache-dir", token_cache, "--out", str(run)], capsys)[0] == 0
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "export_agreement.py"
    serve = tmp_path / "serve"
    args = ["--run", f"tiny={run}", "--tokens", "40", "--input-activations", "fp8", "--serve-dir", str(serve)]
    args += ["--fp8-recipes", "rowwise"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout)["runs"]["tiny"]
    assert "hf-fp8-w8a8" in measured
    # the run's own recipe rebuilt with fresh scales is fp8lm's model (rowwise keeps no scaling state)
    assert measured["recipes_vs_high_precision"]["rowwise"] == measured["high_precision"]
    assert 0.5 < measured["bf16_vs_high_precision"]["agreement"] <= 1.0
    assert {p.name for p in serve.iterdir()} >= {"tiny-hf-fp8", "tiny-hf-fp8-w8a8", "tiny-reference.json"}
    reference = json.loads((serve / "tiny-reference.json").read_text())
    inputs, targets = torch.tensor(reference["inputs"]), torch.tensor(reference["targets"])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # windows: targets are the inputs shifted
    own = [[None] for _ in reference["inputs"]]
    for w, window in enumerate(reference["inputs"]):
        for p in range(len(window) - 2):
            top, true = reference["reference_argmax"][w][p], window[p + 1]
            logprob = reference["reference_target_logprob"][w][p]
            own[w].append({top: SimpleNamespace(logprob=logprob if top == true else -1.0, rank=1)})
            own[w][-1].setdefault(true, SimpleNamespace(logprob=logprob, rank=2))
    result = score(reference, own, tokens=40)
    assert result["agreement"] == 1.0 and math.isclose(result["perplexity"], result["reference_perplexity"])
