"""What data-parallel gradient sync does to a trained model's gradients: the values it flushes to
zero and its error, for the output head, the FP8 layers' weights and the rest.

Loads a run's checkpoint (``RUN``: a run folder of `fp8lm train`, e.g. the main job's O2 run),
wraps fp8lm's model of it (`fp8lm.train.export.run_model`: the run's level, recipe and policy) in
`FP8DataParallel` over torchrun's ranks, and takes one backward per rank on its own batch of the
validation split: first under ``no_sync`` (each rank's own gradients, stored in the policy's
formats), then synced. Against the float64 mean of the ranks' own gradients, it reports per group
the share of the values that are not zero in that mean and are zero after the sync, the head's
rows so lost whole, and the relative L2 error. Rank 0 prints one JSON object::

    torchrun --nproc_per_node 2 benchmarks/head_gradient_sync.py runs/o2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from fp8lm import ScalingTensor  # noqa: E402
from fp8lm.distributed import FP8DataParallel, comm_stats, reset_comm_stats, setup, shutdown  # noqa: E402
from fp8lm.train.data import eval_batches, pack, stdlib_documents  # noqa: E402
from fp8lm.train.export import read_run_checkpoint, run_autocast, run_model  # noqa: E402


def values(grad: torch.Tensor) -> torch.Tensor:
    return grad.dequantize(torch.float32) if isinstance(grad, ScalingTensor) else grad.detach().float().clone()


def backward(model: torch.nn.Module, batch, autocast) -> dict[str, torch.Tensor]:
    x, y = batch
    with autocast:
        _, loss = model(x, y)
    loss.backward()
    inner = model.module if isinstance(model, FP8DataParallel) else model
    grads = {n: values(p.grad) for n, p in inner.named_parameters() if p.grad is not None}
    inner.zero_grad(set_to_none=True)
    return grads


def ranks_mean(local: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(local, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, local.double())
    return sum(parts) / world


def group_stats(names: list[str], exact: dict, synced: dict) -> dict:
    e = torch.cat([exact[n].reshape(-1) for n in names])
    s = torch.cat([synced[n].reshape(-1).double() for n in names])
    nonzero = e != 0
    return {
        "elements": e.numel(),
        "flushed_to_zero": int((nonzero & (s == 0)).sum()),
        "flushed_fraction": float((nonzero & (s == 0)).sum() / nonzero.sum().clamp_min(1)),
        "relative_l2_error": float((s - e).norm() / e.norm()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run folder of fp8lm train (its newest checkpoint)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fp8lm-data-cache"))
    args = ap.parse_args()
    rank, world = setup(timeout_s=600)

    state = read_run_checkpoint(args.run)
    model = run_model(state).train()
    cfg = state["model_config"]
    source, docs = stdlib_documents()
    if rank != 0:
        dist.barrier()  # rank 0 writes the token cache first; the others read it
    splits = pack(source, docs, args.cache_dir, 0.05)
    if rank == 0:
        dist.barrier()
    batch = eval_batches(splits.val, world, args.batch_size, cfg.block_size)[rank]

    ddp = FP8DataParallel(model)
    with ddp.no_sync():
        local = backward(ddp, batch, run_autocast(state))
    reset_comm_stats()
    synced = backward(ddp, batch, run_autocast(state))
    sent = comm_stats()
    exact = {n: ranks_mean(g, world) for n, g in local.items()}

    fp8_weights = {id(m.weight) for m in model.modules() if getattr(m, "fp8_enabled", False)}
    params = dict(model.named_parameters())
    head = [n for n in exact if n.startswith("lm_head.")]
    layers = [n for n in exact if id(params[n]) in fp8_weights and n not in head]
    rest = [n for n in exact if n not in head and n not in layers]
    head_rows = exact["lm_head.weight"].abs().amax(1) != 0
    lost_rows = head_rows & (synced["lm_head.weight"].abs().amax(1) == 0)
    if rank == 0:
        out = {
            "benchmark": "head_gradient_sync",
            "run": str(args.run),
            "step": int(state["step"]),
            "opt_level": state.get("opt_level"),
            "world_size": world,
            "tokens_per_rank": args.batch_size * cfg.block_size,
            "output_head": {**group_stats(head, exact, synced), "rows_lost": int(lost_rows.sum())},
            "fp8_layer_weights": group_stats(layers, exact, synced),
            "other": group_stats(rest, exact, synced),
            "sync_bytes": {k: v for k, v in sent.items() if k.endswith("_bytes")},
            "machine": machine(),
        }
        print(json.dumps(out, indent=1))
    shutdown(0)


if __name__ == "__main__":
    main()
