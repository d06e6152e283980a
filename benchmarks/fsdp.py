"""fp8lm on FSDP2 against torch's FSDP2 (BF16 mixed precision, and FP32), on gloo ranks.

Under ``torchrun --nproc_per_node N`` one run measures, side by side on the same model:

- ``comm``: bytes per step handed to the all-gathers (weights) and to the reduce-scatters
  (gradients), counted by `fp8lm.distributed.comm_stats` around each FSDP2 collective, the step
  time, and each rank's training-state bytes per parameter (`fp8lm.memory_report` after the step,
  gradients held) for fp8lm O2 (`fp8lm.distributed.fully_shard`, FP8AdamW), torch FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` and torch FSDP2 in FP32 (both
  with torch's AdamW); model ``--comm-model``;
- ``gradients``: fp8lm's FP8 reduce-scatter after one backward against an FP32 all-reduce of the
  same gradients: relative L2 error and the worst element's share of `fp8_all_reduce_error_bound`;
- ``training``: validation loss after ``--steps`` steps of fp8lm O2 on FSDP2, model
  ``--train-model``, each rank on its slice of the global batch.

Without torchrun it trains the same recipe in one process on the whole batch (the reference for
``training``). ``--results PATH`` merges the JSON into PATH under ``"<N>ranks"`` (or ``"one_process"``)::

    python benchmarks/fsdp.py --results benchmarks/results/fsdp_cpu.json
    torchrun --nproc_per_node 2 benchmarks/fsdp.py --results benchmarks/results/fsdp_cpu.json
    torchrun --nproc_per_node 4 benchmarks/fsdp.py --results benchmarks/results/fsdp_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

import fp8lm  # noqa: E402
from fp8lm.distributed import (  # noqa: E402
    comm_stats,
    fp8_all_reduce_error_bound,
    fully_shard,
    precompute_fp8_scales,
    setup,
    shutdown,
)
from fp8lm.distributed.fsdp import CountedAllGather, CountedReduceScatter, FP8ReduceScatter  # noqa: E402
from fp8lm.optim import FP8AdamW  # noqa: E402
from fp8lm.train.data import BatchSampler, eval_batches, pack, stdlib_documents  # noqa: E402
from fp8lm.train.loop import lr_at  # noqa: E402
from fp8lm.train.model import GPT, preset  # noqa: E402

LR, WEIGHT_DECAY, BETAS = 3e-3, 0.1, (0.9, 0.95)


class Tallied:
    """An FSDP2 comm object whose `comm_stats` bytes are added to ``tally[kind]``."""

    def __init__(self, inner, tally: dict, kind: str):
        self.inner, self.tally, self.kind = inner, tally, kind

    def allocate(self, *args, **kwargs):
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        before = comm_stats()["total_bytes"]
        out = self.inner(*args, **kwargs)
        self.tally[self.kind] += comm_stats()["total_bytes"] - before
        return out


def build(variant: str, model_name: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """A GPT sharded over its blocks and as a whole, its optimizer, and its byte tally."""
    torch.manual_seed(seed)
    model = GPT(preset(model_name))
    options: dict = {"fp8_reduce_scatter": variant == "fp8lm_O2"}
    if variant == "fp8lm_O2":
        model, _ = fp8lm.initialize(model, opt_level="O2")
    elif variant == "torch_bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    tally = {"all_gather": 0.0, "reduce_scatter": 0.0}
    modules = [*model.blocks, model]
    for module in modules:
        fully_shard(module, **options)
    for module in modules:
        scatter = FP8ReduceScatter() if variant == "fp8lm_O2" else CountedReduceScatter()
        module.set_custom_all_gather(Tallied(CountedAllGather(), tally, "all_gather"))
        module.set_custom_reduce_scatter(Tallied(scatter, tally, "reduce_scatter"))
    opt_class = FP8AdamW if variant == "fp8lm_O2" else torch.optim.AdamW
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return model, opt_class(groups, lr=LR, betas=BETAS), tally


def train_step(model, opt, x, y, lr: float) -> torch.Tensor:
    for group in opt.param_groups:
        group["lr"] = lr
    precompute_fp8_scales(model)  # nothing to agree for torch's variants
    _, loss = model(x, y)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    opt.step()
    return loss.detach()


def comm_variant(variant: str, args, rank: int, world: int) -> dict:
    model, opt, tally = build(variant, args.comm_model)
    block = preset(args.comm_model).block_size
    g = torch.Generator().manual_seed(rank)
    times, per_step = [], []
    for step in range(args.comm_steps + 1):  # the first step warms up: not timed
        x = torch.randint(0, 256, (args.batch_size // world, block), generator=g)
        for kind in tally:
            tally[kind] = 0.0
        dist.barrier()
        start = time.perf_counter()
        train_step(model, opt, x, torch.roll(x, -1, 1), LR)
        dist.barrier()
        if step:
            times.append(time.perf_counter() - start)
            per_step.append(dict(tally))
        memory = fp8lm.memory_report(model, opt)
        opt.zero_grad(set_to_none=True)
    return {
        "all_gather_bytes_per_step": per_step[-1]["all_gather"],
        "reduce_scatter_bytes_per_step": per_step[-1]["reduce_scatter"],
        "step_seconds_median": statistics.median(times),
        "state_bytes_per_param": memory["bytes_per_param"],
        "memory": memory,
    }


def gradient_check(args, rank: int, world: int) -> dict:
    """fp8lm's FP8 reduce-scatter after one backward against the same gradients of unsharded copies
    (one per rank, same weights): relative L2 error against their FP32 all-reduce, and the worst
    element's share of `fp8_all_reduce_error_bound` (one scale per chunk of FSDP2's flat buffer,
    whose amax is at most the rank's largest gradient: appended to each rank's input)."""
    model, _, _ = build("fp8lm_O2", args.comm_model)
    torch.manual_seed(0)
    plain, _ = fp8lm.initialize(GPT(preset(args.comm_model)), opt_level="O2")
    block = preset(args.comm_model).block_size
    x = torch.randint(0, 256, (args.batch_size // world, block), generator=torch.Generator().manual_seed(rank))
    precompute_fp8_scales(model)
    model(x, torch.roll(x, -1, 1))[1].backward()
    plain(x, torch.roll(x, -1, 1))[1].backward()
    rank_amax = torch.stack([_values(q.grad).abs().max() for q in plain.parameters()]).max().reshape(1)
    amaxes = [torch.empty_like(rank_amax) for _ in range(world)]
    dist.all_gather(amaxes, rank_amax)
    worst_share, err_sq, ref_sq = 0.0, 0.0, 0.0
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        local_ref = _values(q.grad).reshape(-1)
        everyone = [torch.empty_like(local_ref) for _ in range(world)]
        dist.all_gather(everyone, local_ref)
        fp32 = local_ref.clone()
        dist.all_reduce(fp32)
        row = q.numel() // q.shape[0]
        got = p.grad.to_local().reshape(-1).double()
        span = slice(_shard_offset(p) * row, _shard_offset(p) * row + got.numel())
        exact = torch.stack(everyone).double().mean(0)[span]
        inputs = [torch.cat([g.double()[span], a.double()]) for g, a in zip(everyone, amaxes)]
        bound = fp8_all_reduce_error_bound(inputs, average=True, segment=got.numel() + 1)[:-1]
        if got.numel():
            worst_share = max(worst_share, float(((got - exact).abs() / bound).max()))
        fp32_mean = (fp32 / world).double()[span]
        err_sq += float(((got - fp32_mean) ** 2).sum())
        ref_sq += float((fp32_mean**2).sum())
    totals = torch.tensor([err_sq, ref_sq], dtype=torch.float64)
    dist.all_reduce(totals)
    share = torch.tensor([worst_share], dtype=torch.float64)
    dist.all_reduce(share, dist.ReduceOp.MAX)
    return {
        "rel_l2_error_vs_fp32_all_reduce": float((totals[0] / totals[1]).sqrt()),
        "worst_share_of_bound": float(share[0]),
    }


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") else t.detach().float()


def _shard_offset(p) -> int:
    """First row of this rank's dim-0 shard (FSDP2 splits like torch.chunk)."""
    rows = p.shape[0]
    per_rank = -(-rows // dist.get_world_size())
    return min(dist.get_rank() * per_rank, rows)


def training(args, rank: int, world: int) -> dict:
    """fp8lm O2: FSDP2 over ``world`` ranks (each on its slice of the global batch), or one process."""
    cfg = preset(args.train_model)
    source, docs = stdlib_documents()
    if rank:
        dist.barrier()  # rank 0 writes the token cache first
    splits = pack(source, docs, args.cache_dir, 0.05)
    if rank == 0 and world > 1:
        dist.barrier()
    sampler = BatchSampler(splits.train, args.batch_size, cfg.block_size, args.seed)  # the same global batches
    val = eval_batches(splits.val, 8, args.batch_size, cfg.block_size)
    if world > 1:
        model, opt, _ = build("fp8lm_O2", args.train_model, args.seed)
    else:
        torch.manual_seed(args.seed)
        model, _ = fp8lm.initialize(GPT(cfg), opt_level="O2")
        groups = [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        opt = FP8AdamW(groups, lr=LR, betas=BETAS)
    share = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = sampler.next()
        train_step(model, opt, x[share], y[share], lr_at(step, LR, args.steps // 10, args.steps, 0.1))
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        val_loss = sum(float(model(vx, vy)[1]) for vx, vy in val) / len(val)
    return {"model": args.train_model, "steps": args.steps, "val_loss": val_loss, "seconds": seconds}


def merge(path: Path, key: str, result: dict) -> None:
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = result
    if "one_process" in results:
        reference = results["one_process"]["training"]["val_loss"]
        for name, entry in results.items():
            if name.endswith("ranks"):
                entry["training"]["val_loss_vs_one_process"] = entry["training"]["val_loss"] / reference - 1
    path.write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comm-model", default="small", help="preset of the byte and time comparison")
    ap.add_argument("--comm-steps", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--train-model", default="tiny", help="preset of the training comparison")
    ap.add_argument("--steps", type=int, default=200, help="training steps")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fp8lm-data-cache"))
    ap.add_argument("--results", type=Path, help="merge the result into this JSON file")
    args = ap.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    rank, world = setup(timeout_s=1200) if distributed else (0, 1)
    result: dict = {"world_size": world, "global_batch": args.batch_size}
    if distributed:
        result["comm_model"] = args.comm_model
        result["comm"] = {v: comm_variant(v, args, rank, world) for v in ("fp8lm_O2", "torch_bf16", "torch_fp32")}
        bf16 = result["comm"]["torch_bf16"]
        for kind in ("all_gather", "reduce_scatter"):
            result[f"{kind}_vs_bf16"] = (
                result["comm"]["fp8lm_O2"][f"{kind}_bytes_per_step"] / bf16[f"{kind}_bytes_per_step"]
            )
        result["gradients"] = gradient_check(args, rank, world)
    result["training"] = training(args, rank, world)
    if rank == 0:
        result["machine"] = machine()
        print(json.dumps(result, indent=1))
        if args.results:
            merge(args.results, f"{world}ranks" if distributed else "one_process", result)
    if distributed:
        shutdown(0)


if __name__ == "__main__":
    main()
