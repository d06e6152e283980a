"""benchmarks/vllm_serve.py's scoring of vLLM's prompt log-probabilities against fp8lm's
predictions (no vLLM needed): the positions line up, and an off-by-one would show."""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

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
