"""Data-parallel FP8 training of the default GPT preset against the single-process run.

Trains like `fp8lm train`'s defaults (preset "small", 500 steps, global batch 16 x 128 tokens,
AdamW lr 3e-3 with warmup and cosine decay, weight decay 0.1 on matrices, betas 0.9/0.95, clip
1.0) through `fp8lm.distributed.wrap`, each rank on its own stream of batches of
``batch_size / world`` sequences. Without torchrun it runs in one process (plain
`fp8lm.initialize`). Rank 0 prints one JSON object::

    python benchmarks/dist_train.py --opt-level O2
    torchrun --nproc_per_node 2 benchmarks/dist_train.py --opt-level O2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

import fp8lm  # noqa: E402
from fp8lm.distributed import comm_stats, ddp_bytes, reset_comm_stats, setup, shutdown, wrap  # noqa: E402
from fp8lm.train.data import BatchSampler, eval_batches, pack, stdlib_documents  # noqa: E402
from fp8lm.train.loop import lr_at  # noqa: E402
from fp8lm.train.model import GPT, preset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--opt-level", choices=["O1", "O2", "O3"], default="O2")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fp8lm-data-cache"))
    args = ap.parse_args()
    rank, world = setup(timeout_s=600) if "WORLD_SIZE" in os.environ else (0, 1)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must divide by the {world} ranks")

    cfg = preset("small")
    source, docs = stdlib_documents()
    if rank != 0:
        torch.distributed.barrier()  # rank 0 writes the token cache first; the others read it
    splits = pack(source, docs, args.cache_dir, 0.05)
    if rank == 0 and world > 1:
        torch.distributed.barrier()
    sampler = BatchSampler(splits.train, args.batch_size // world, cfg.block_size, args.seed + rank)
    val = eval_batches(splits.val, 8, args.batch_size, cfg.block_size)

    torch.manual_seed(args.seed)
    model = GPT(cfg)
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    model, opt = wrap(model, opt, args.opt_level)
    sharded = isinstance(opt, fp8lm.distributed.FP8ZeroOptimizer)

    warmup, step_bytes, losses, skipped = args.steps // 10, [], [], 0
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, 3e-3, warmup, args.steps, 0.1)
        reset_comm_stats()
        x, y = sampler.next()
        _, loss = model(x, y)
        loss.backward()
        norm = opt.clip_grad_norm_(1.0) if sharded else fp8lm.clip_grad_norm_(model.parameters(), 1.0)
        if math.isfinite(float(norm)):
            opt.step()
        else:
            skipped += 1
        opt.zero_grad(set_to_none=True)
        step_bytes.append(comm_stats()["total_bytes"])
        losses.append(loss.item())
    seconds = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        val_loss = sum(float(model(vx, vy)[1]) for vx, vy in val) / len(val)
    num_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            json.dumps(
                {
                    "benchmark": "dist_train",
                    "opt_level": args.opt_level,
                    "world_size": world,
                    "steps": args.steps,
                    "global_batch": args.batch_size,
                    "val_loss": val_loss,
                    "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]),
                    "skipped_steps": skipped,
                    "seconds": seconds,
                    "num_params": num_params,
                    "comm_bytes_per_step": sum(step_bytes) / len(step_bytes),
                    "fp32_ddp_bytes_per_step": ddp_bytes(num_params, 4, world),
                    "bf16_ddp_bytes_per_step": ddp_bytes(num_params, 2, world),
                    "machine": machine(),
                },
                indent=1,
            )
        )
    if world > 1:
        shutdown(0)


if __name__ == "__main__":
    main()
