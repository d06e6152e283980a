"""Weight gradients at rest under a fine-grained recipe: one E4M3 scale per tensor (what O2
stores) against the recipe's row or block scales, and what the first moment keeps of either.

Real gradients: the main job's GPT (``--preset``, ``small``) trains ``--steps`` O2 steps with
``--recipe`` and the output head in FP8 (``fp8lm.policy.preset("O2", output_head=False)``, so
the head's gradient is E4M3 too), at the main job's batch and peak learning rate held constant;
then one more batch runs with every FP8 layer's weight gradient kept in FP32 (the weight-gradient
GEMM's output, before it is stored). For each layer the gradient ``g`` is stored

- ``tensorwise``: E4M3 with one power-of-two scale (`fp8lm.quantize`, as `FP8Linear` stores it);
- ``rowwise``, ``blockwise``, ``mxfp8``: E4M3 with the recipe's weight scales (one per row,
  128 x 128 blocks, 1 x 32 blocks: `fp8lm.fake_quantize(g, recipe, "weight")`);
- ``blocks16``: E4M3 with FP32 scales per 16 x 16 block (nvfp4's weight blocks, E4M3 elements).

and the optimizer's next first moment is formed from each, as FP8AdamW does:
``m' = beta1 m + (1 - beta1) q(g)`` from the run's stored ``m``, stored in E4M3 with one
power-of-two scale from its amax. Reported per storage: SQNR of ``q(g)`` against ``g`` and the
fraction of ``g``'s non-zero values stored as zero; SQNR of the stored ``m'`` against the exact
``beta1 m + (1 - beta1) g`` (float64), and the fraction of elements where the stored ``m'`` is
zero but the exact one is not. Mean over the layers / worst layer, and the output head alone.

    python benchmarks/recipe_grads.py --results benchmarks/results/recipe_grads_cpu.json
    python benchmarks/recipe_grads.py --preset tiny --steps 3 --results ''   # smoke
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from common import emit, machine

import fp8lm
from fp8lm.formats import E4M3, FP32
from fp8lm.nn import FP8Linear
from fp8lm.ops.gemm import CPUBF16Linear
from fp8lm.policy import preset as policy_preset
from fp8lm.train.data import BatchSampler, pack, stdlib_documents
from fp8lm.train.model import GPT, preset

STORAGES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "blocks16")


def sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    x, q = x.double(), q.double()
    noise = (x - q).square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(x.square().sum().item() / noise)


def lost(exact: torch.Tensor, stored: torch.Tensor) -> float:
    """Fraction of the non-zero values of ``exact`` stored as zero."""
    nonzero = int(torch.count_nonzero(exact))
    return int(torch.count_nonzero((stored == 0) & (exact != 0))) / nonzero if nonzero else 0.0


def stored(g: torch.Tensor, storage: str) -> torch.Tensor:
    """``g`` (2-D, float32) as stored at rest by ``storage`` (module doc), its values in float32."""
    if storage == "tensorwise":
        return fp8lm.quantize(g, E4M3).dequantize()
    if storage == "blocks16":
        return fp8lm.fake_quantize(g, fp8lm.Recipe.from_name("blockwise").replace(block=16), "weight")
    return fp8lm.fake_quantize(g, storage, "weight")


@contextmanager
def bf16_autocast():
    with CPUBF16Linear(), torch.autocast("cpu", dtype=torch.bfloat16):
        yield


def step(model: GPT, opt, batch) -> None:
    with bf16_autocast():
        _, loss = model(*batch)
    loss.backward()
    fp8lm.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_o2(args) -> tuple[GPT, torch.optim.Optimizer, BatchSampler]:
    torch.manual_seed(args.seed)
    source, docs = stdlib_documents()
    splits = pack(source, docs, args.cache_dir)
    cfg = preset(args.preset)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    policy = policy_preset("O2", output_head=False)
    model, opt = fp8lm.initialize(model, opt, "O2", recipe=args.recipe, policy=policy)
    sampler = BatchSampler(splits.train, args.batch_size, cfg.block_size, args.seed)
    for _ in range(args.steps):
        step(model, opt, sampler.next())
    return model, opt, sampler


def fp32_weight_grads(model: GPT, batch) -> dict[str, torch.Tensor]:
    """Every FP8 layer's weight gradient on ``batch`` before storage: the layers' gradient format
    set to FP32 for this batch, the gradient taken by a hook before it is accumulated (and then
    stored by `fp8lm.initialize`'s hook)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear) and m.fp8_enabled}
    formats = {n: m.weight_grad_format for n, m in layers.items()}
    grads: dict[str, torch.Tensor] = {}
    handles = []
    for n, m in layers.items():
        m.weight_grad_format = FP32

        def keep(grad, n=n):
            grads[n] = grad.detach().float().clone()

        handles.append(m.weight.register_hook(keep))
    with bf16_autocast():
        _, loss = model(*batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    for n, m in layers.items():
        m.weight_grad_format = formats[n]
    return grads


def next_moment(m: torch.Tensor, g: torch.Tensor, beta1: float) -> torch.Tensor:
    """``beta1 m + (1 - beta1) g`` stored in E4M3 with one power-of-two scale, as float32."""
    return fp8lm.quantize(beta1 * m + (1 - beta1) * g, E4M3).dequantize()


def layer_metrics(g: torch.Tensor, m: torch.Tensor, beta1: float) -> dict[str, dict[str, float]]:
    exact_m = beta1 * m.double() + (1 - beta1) * g.double()
    out = {}
    for storage in STORAGES:
        q = stored(g, storage)
        m_next = next_moment(m, q, beta1)
        out[storage] = {
            "grad_sqnr_db": sqnr_db(g, q),
            "grad_lost": lost(g, q),
            "m_sqnr_db": sqnr_db(exact_m, m_next),
            "m_lost": lost(exact_m, m_next),
        }
    return out


def summarize(per_layer: dict[str, dict], head: str) -> dict:
    out = {}
    for storage in STORAGES:
        entry = {}
        for key in ("grad_sqnr_db", "grad_lost", "m_sqnr_db", "m_lost"):
            values = [layer[storage][key] for layer in per_layer.values()]
            worst = min(values) if key.endswith("db") else max(values)
            entry[key] = {
                "mean": round(statistics.fmean(values), 6),
                "worst": round(worst, 6),
                "head": round(per_layer[head][storage][key], 6),
            }
        out[storage] = entry
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--recipe", default="blockwise", help="the recipe the O2 run trains with")
    parser.add_argument("--steps", type=int, default=200, help="O2 steps before the gradients are taken")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "fp8lm" / "tokens"))
    parser.add_argument("--results", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, opt, sampler = train_o2(args)
    grads = fp32_weight_grads(model, sampler.next())
    params = dict(model.named_parameters())
    beta1 = opt.param_groups[0]["betas"][0]
    per_layer = {}
    for name, g in grads.items():
        state = opt.state[params[f"{name}.weight"]]
        m = state["exp_avg"].float() / state["exp_avg_scale"]
        per_layer[name] = layer_metrics(g, m, beta1)
    head = [n for n, m in model.named_modules() if n in grads][-1]  # the last linear layer: the output head
    result = {
        "benchmark": "recipe_grads",
        "command": "python benchmarks/recipe_grads.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset,
        "recipe": args.recipe,
        "o2_steps": args.steps,
        "layers": len(grads),
        "head": head,
        "machine": machine(),
        "storage": summarize(per_layer, head),
        "per_layer": {
            name: {k: {m: round(v, 6) for m, v in e.items()} for k, e in d.items()} for name, d in per_layer.items()
        },
    }
    emit(result, args.results)
    return result


if __name__ == "__main__":
    main()
