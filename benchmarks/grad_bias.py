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

Besides `fidelity.py`'s variants, ``split-SCOPE-GEMMS`` splits an FP8 linear layer into its three
GEMMs: bf16's model in which only the GEMMS (``+``-joined from ``fwd``, ``dgrad``, ``wgrad``) of
the SCOPE's layers (``head``, ``blocks`` or ``all``) read FP8-rounded operands (per-tensor current
scaling, E4M3 inputs and weights, E5M2 output gradients), everything else as bf16, e.g.
``split-head-wgrad`` or ``split-all-fwd+dgrad+wgrad``; ``split-all-none`` is the control (bf16's
numbers through the same code).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import fp8lm
from fp8lm.policy import FP8_LEVELS
from fp8lm.train.data import BatchSampler, pack, stdlib_documents
from fp8lm.train.model import GPT, GPTConfig
from fp8lm.train.run import BF16Autocast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402
from fidelity import VARIANTS, variant_options  # noqa: E402

WARMUP_BATCHES = 8  # delayed scaling's amax histories fill before anything is compared
GEMMS = ("fwd", "dgrad", "wgrad")
SCOPES = ("head", "blocks", "all")


def _fp8(t: torch.Tensor, fmt: fp8lm.Format) -> torch.Tensor:
    """``t`` rounded to ``fmt`` with a per-tensor scale from its own amax, back in BF16."""
    return fp8lm.quantize(t.detach().float(), fmt).dequantize().to(torch.bfloat16)


class _SplitLinear(torch.autograd.Function):
    """``y = x W^T + b`` as BF16 autocast computes it, except that the chosen GEMMs read
    FP8-rounded operands: what an FP8 GEMM does to the numbers, one GEMM at a time."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemms):
        ctx.gemms, ctx.x_dtype, ctx.has_bias = gemms, x.dtype, bias is not None
        x16, w16 = x.detach().to(torch.bfloat16), weight.detach().to(torch.bfloat16)
        ctx.save_for_backward(x16, w16)
        fp8 = "fwd" in gemms
        b16 = None if bias is None else bias.detach().to(torch.bfloat16)
        with torch.autocast("cpu", enabled=False):
            return F.linear(_fp8(x16, fp8lm.E4M3) if fp8 else x16, _fp8(w16, fp8lm.E4M3) if fp8 else w16, b16)

    @staticmethod
    def backward(ctx, grad_out):
        x16, w16 = ctx.saved_tensors
        g16 = grad_out.to(torch.bfloat16).reshape(-1, grad_out.shape[-1])
        x2 = x16.reshape(-1, x16.shape[-1])
        gq = _fp8(g16, fp8lm.E5M2)
        with torch.autocast("cpu", enabled=False):
            dgrad = "dgrad" in ctx.gemms
            grad_x = (gq if dgrad else g16) @ (_fp8(w16, fp8lm.E4M3) if dgrad else w16)
            wgrad = "wgrad" in ctx.gemms
            grad_w = (gq if wgrad else g16).t() @ (_fp8(x2, fp8lm.E4M3) if wgrad else x2)
        grad_b = g16.sum(0).float() if ctx.has_bias else None
        return grad_x.reshape(x16.shape).to(ctx.x_dtype), grad_w.float(), grad_b, None


def split_variant(variant: str) -> tuple[str, tuple[str, ...]] | None:
    """``(scope, gemms)`` of a ``split-SCOPE-GEMMS`` variant, None for other names."""
    parts = variant.split("-")
    if len(parts) != 3 or parts[0] != "split":
        return None
    gemms = () if parts[2] == "none" else tuple(parts[2].split("+"))
    if parts[1] not in SCOPES or not set(gemms) <= set(GEMMS):
        raise SystemExit(f"bad variant {variant!r}: split-SCOPE-GEMMS, SCOPE in {SCOPES}, GEMMS from {GEMMS}")
    return parts[1], gemms


def split_gemms(model: GPT, scope: str, gemms: tuple[str, ...]) -> None:
    """Route the ``scope`` linear layers of ``model`` through `_SplitLinear` with ``gemms``."""
    for name, module in model.named_modules():
        in_scope = {"head": name == "lm_head", "blocks": name.startswith("blocks."), "all": True}[scope]
        if isinstance(module, torch.nn.Linear) and in_scope:
            module.forward = lambda x, m=module: _SplitLinear.apply(x, m.weight, m.bias, gemms)


def build(state: dict, model_config: dict, variant: str) -> torch.nn.Module:
    """The checkpoint's model under ``variant`` (``"bf16"``: plain, run under BF16 autocast)."""
    model = GPT(GPTConfig(**model_config))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    split = split_variant(variant)
    if split is not None:
        split_gemms(model, *split)
        return model
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
    unknown = [v for v in variants if v not in VARIANTS and split_variant(v) is None]
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
