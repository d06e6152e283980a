"""Systematic gradient error of FP8 choices, at fixed weights.

Loads one checkpoint's weights into bf16 and into each variant of `fidelity.py` (a level plus
`fp8lm.initialize` options), runs the same training batches through all of them and compares the
gradients of chosen parameters with bf16's. Per variant and parameter it prints the norm of the
mean difference over the batches (the systematic part), the norm of that mean's standard error
(the batch noise), the norm of bf16's mean gradient, and the cosine between the mean difference
and the parameter (for a norm's gain, the gain minus 1): a negative cosine means training under
the variant pushes the parameter away from zero faster than bf16 does. A training loss run for
thousands of steps turns a systematic gradient error into drift; noise averages out.

    python benchmarks/grad_bias.py CKPT [--variants O1,O1-head-gemm-bf16] [--batches 24]
        [--params ln_f.bias,ln_f.weight]

CKPT: a checkpoint written by `fp8lm train` (a ``step_*.pt``); the corpus is the default one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import fp8lm
from fp8lm.policy import FP8_LEVELS
from fp8lm.train.data import BatchSampler, pack, stdlib_documents
from fp8lm.train.model import GPT, GPTConfig
from fp8lm.train.run import BF16Autocast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402
from fidelity import VARIANTS, variant_options  # noqa: E402

WARMUP_BATCHES = 8  # delayed scaling's amax histories fill before anything is compared


def build(state: dict, model_config: dict, variant: str) -> torch.nn.Module:
    """The checkpoint's model under ``variant`` (``"bf16"``: plain, run under BF16 autocast)."""
    model = GPT(GPTConfig(**model_config))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    level, options = variant_options(variant)
    if level in FP8_LEVELS:
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        model, _ = fp8lm.initialize(model, opt, level, **options)
    return model


def gradients(model: torch.nn.Module, batch, names: list[str]) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss of one batch and the FP32 gradients of the ``names`` parameters."""
    model.zero_grad(set_to_none=True)
    with BF16Autocast("cpu"):
        _, loss = model(*batch)
    loss.backward()
    params = dict(model.named_parameters())
    return loss.item(), {n: params[n].grad.detach().float().clone() for n in names}


def is_norm_gain(name: str, param: torch.Tensor) -> bool:
    """A normalization layer's gain (1-D weight), whose neutral value is 1."""
    return param.dim() == 1 and name.endswith("weight")


def summarize(diffs: list[torch.Tensor], ref: list[torch.Tensor], param: torch.Tensor, is_gain: bool) -> dict:
    d, r = torch.stack(diffs), torch.stack(ref)
    mean = d.mean(0)
    direction = (param.float() - (1.0 if is_gain else 0.0)).flatten()
    return {
        "mean_diff_norm": mean.norm().item(),
        "noise_norm": (d.std(0) / len(d) ** 0.5).norm().item(),
        "mean_grad_norm": r.mean(0).norm().item(),
        "cos_with_param": torch.nn.functional.cosine_similarity(mean.flatten(), direction, dim=0).item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--variants", default="O1,O1-head-gemm-bf16,O1-gemm-bf16")
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--params", default="ln_f.bias,ln_f.weight")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cache-dir", default="runs/cache")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: see python benchmarks/fidelity.py --list")
    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    names = args.params.split(",")
    models = {v: build(ckpt["model"], ckpt["model_config"], v) for v in ["bf16", *variants]}
    tokens = pack(*stdlib_documents(), args.cache_dir).train
    sampler = BatchSampler(tokens, args.batch_size, ckpt["model_config"]["block_size"], seed=0)
    for _ in range(WARMUP_BATCHES):
        batch = sampler.next()
        for model in models.values():
            gradients(model, batch, names)
    losses: dict[str, list[float]] = {v: [] for v in models}
    grads: dict[str, dict[str, list[torch.Tensor]]] = {v: {n: [] for n in names} for v in models}
    for _ in range(args.batches):
        batch = sampler.next()
        for v, model in models.items():
            loss, g = gradients(model, batch, names)
            losses[v].append(loss)
            for n in names:
                grads[v][n].append(g[n])
    result = {
        "benchmark": "grad_bias",
        "machine": machine(),
        "checkpoint_step": ckpt["step"],
        "batches": args.batches,
        "batch_size": args.batch_size,
        "variants": {},
    }
    for v in variants:
        diffs = {n: [a - b for a, b in zip(grads[v][n], grads["bf16"][n])] for n in names}
        per_param = {
            n: summarize(diffs[n], grads["bf16"][n], ckpt["model"][n], is_norm_gain(n, ckpt["model"][n])) for n in names
        }
        loss_diff = float(np.mean(losses[v]) - np.mean(losses["bf16"]))
        result["variants"][v] = {"loss_diff": loss_diff, "params": per_param}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
