"""FP8-LM's Level 3: GPT training under FP8 tensor + sequence parallelism (``--tp``) or FP8
pipeline parallelism (``--pp``), data-parallel over the remaining ranks, against one process.

Trains like `fp8lm train`'s defaults (global batch 16 x 128 tokens, AdamW lr 3e-3 with warmup and
cosine decay, weight decay 0.1 on matrices, betas 0.9/0.95, clip 1.0) with FP8 layers (opt level
O1: FP8 GEMMs, E4M3 weight gradients, torch's AdamW); each data-parallel rank draws its own
batches of ``16 / dp`` sequences (rank 0 with the single process's seed). Rank 0 prints one JSON
object: the validation loss on 8 fixed batches after the last step, the bytes each rank sent per
step (`comm_stats`, by kind) and the bytes the same layout sends in BF16 by the same algorithm
costs (``bf16_bytes_per_step``: every FP8 payload at 2 bytes per element, no scales)::

    python benchmarks/level3.py --steps 200
    torchrun --nproc_per_node 4 benchmarks/level3.py --tp 2 --steps 200
    torchrun --nproc_per_node 4 benchmarks/level3.py --pp 2 --steps 200
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

import fp8lm  # noqa: E402
from fp8lm.distributed import comm, comm_stats, ddp_bytes, reset_comm_stats, setup, shutdown  # noqa: E402
from fp8lm.distributed.accounting import KINDS, collective_bytes  # noqa: E402
from fp8lm.distributed.pipeline import FP8PipelineStage, carrier_numel  # noqa: E402
from fp8lm.train.data import BatchSampler, eval_batches, pack, stdlib_documents  # noqa: E402
from fp8lm.train.gpt_parallel import (  # noqa: E402
    PipelineStageModule,
    clip_grads_over_,
    finish_tensor_parallel_grads,
    tensor_parallel_plan,
)
from fp8lm.train.loop import lr_at  # noqa: E402
from fp8lm.train.model import GPT, preset  # noqa: E402

GLOBAL_BATCH, MICRO_BATCHES, LR = 16, 4, 3e-3


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)


class TensorParallelRun:
    """The GPT under `tensor_parallel_plan` on the mesh's ``tp`` dimension."""

    def __init__(self, model, mesh, cfg) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        self.tp_group, self.dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
        self.dp_size = mesh["dp"].size()
        self.model = parallelize_module(model, mesh["tp"], tensor_parallel_plan(cfg))

    def loss(self, x, y) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return self.model(x, y)[1]

    def train_step(self, x, y) -> float:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = self.model(x, y)[1]
            loss.backward()
        finish_tensor_parallel_grads(self.model, self.tp_group, self.dp_group if self.dp_size > 1 else None)
        return float(loss.detach())

    def clip(self) -> float:
        return float(clip_grads_over_(list(self.model.parameters()), 1.0, self.tp_group, plain_replicated=True))

    def bf16_bytes(self, cfg, local_batch: int) -> float:
        """Per rank and step at BF16: each block's 2 gathers and 2 reduce-scatters forward and their
        2 + 2 backward, the head's gather and its reduce-scatter, over the whole sequence at 2 bytes
        per element; the partial gradients (norms, row-wise biases) in FP32; DDP's FP32 gradient
        all-reduce over the data-parallel ranks."""
        n = self.tp_group.size()
        activation = local_batch * cfg.block_size * cfg.n_embd
        wire = collective_bytes("all_gather", 2 * activation, n) * (8 * cfg.n_layer + 2)
        partial = cfg.n_layer * 6 * cfg.n_embd + 2 * cfg.n_embd  # ln_1, ln_2 (w, b), 2 biases; ln_f
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in self.model.parameters())
        return wire + collective_bytes("all_reduce", 4 * partial, n) + ddp_bytes(local, 4, self.dp_size)


class PipelineRun:
    """The GPT cut into ``pp`` stages on the mesh's ``pp`` dimension, GPipe schedule."""

    def __init__(self, model, mesh, cfg, local_batch: int) -> None:
        from torch.distributed.pipelining import ScheduleGPipe

        self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        self.dp_size, self.stage, self.n_stages = mesh["dp"].size(), mesh["pp"].get_local_rank(), mesh["pp"].size()
        self.micro = local_batch // MICRO_BATCHES
        self.model = PipelineStageModule(model, self.stage, self.n_stages, self.micro)
        self.boundary = (self.micro, cfg.block_size, cfg.n_embd)
        carrier = torch.empty(carrier_numel(math.prod(self.boundary))).requires_grad_()
        first = torch.zeros(self.micro, cfg.block_size, dtype=torch.long)
        out = torch.zeros(self.micro, cfg.block_size, cfg.vocab_size) if self.model.last else carrier
        self.pipe = FP8PipelineStage(
            self.model,
            self.stage,
            self.n_stages,
            torch.device("cpu"),
            input_args=first if self.model.first else carrier,
            output_args=out.requires_grad_(),
            group=self.pp_group,
        )
        self.schedule = ScheduleGPipe(self.pipe, n_microbatches=MICRO_BATCHES, loss_fn=_lm_loss)

    def train_step(self, x, y) -> float:
        losses: list = []
        if self.model.first:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=losses)
        finish_tensor_parallel_grads(self.model, dp_group=self.dp_group if self.dp_size > 1 else None)
        mean = torch.tensor([sum(float(v.detach()) for v in losses) / MICRO_BATCHES if losses else 0.0])
        return float(comm.all_reduce(mean, group=self.pp_group))  # the last stage's loss, everywhere

    def clip(self) -> float:
        return float(clip_grads_over_(list(self.model.parameters()), 1.0, self.pp_group))

    def bf16_bytes(self, cfg, local_batch: int) -> float:
        """Per rank and step at BF16: one activation (first stages) or gradient (last stages) per
        micro-batch and boundary at 2 bytes per element; DDP's FP32 gradient all-reduce."""
        sends = (0 if self.model.last else 1) + (0 if self.model.first else 1)
        local = sum(p.numel() for p in self.model.parameters())
        return sends * MICRO_BATCHES * 2 * math.prod(self.boundary) + ddp_bytes(local, 4, self.dp_size)

    def loss(self, x, y) -> torch.Tensor:
        """The validation loss through the stages, micro-batch by micro-batch (FP8 boundaries)."""
        total = torch.zeros(1)
        for mx, my in zip(x.chunk(x.shape[0] // self.micro), y.chunk(y.shape[0] // self.micro)):
            h = mx if self.model.first else torch.empty(carrier_numel(math.prod(self.boundary)))
            if not self.model.first:
                comm.recv(h, self.stage - 1, group=self.pp_group)
            h = self.model(h)
            if not self.model.last:
                comm.send(h, self.stage + 1, group=self.pp_group)
            else:
                total += _lm_loss(h, my) / (x.shape[0] // self.micro)
        return comm.broadcast(total, src=self.n_stages - 1, group=self.pp_group)[0]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class SingleRun:
    def __init__(self, model) -> None:
        self.model = model

    def loss(self, x, y) -> torch.Tensor:
        return self.model(x, y)[1]

    def train_step(self, x, y) -> float:
        loss = self.loss(x, y)
        loss.backward()
        return float(loss.detach())

    def clip(self) -> float:
        return float(fp8lm.clip_grad_norm_(self.model.parameters(), 1.0))

    def bf16_bytes(self, cfg, local_batch: int) -> float:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fp8lm-data-cache"))
    args = ap.parse_args()
    rank, world = setup(timeout_s=600) if "WORLD_SIZE" in os.environ else (0, 1)
    if args.tp > 1 and args.pp > 1:
        raise SystemExit("level3.py runs --tp or --pp, not both")
    inner = max(args.tp, args.pp)
    if world % inner:
        raise SystemExit(f"{world} ranks cannot hold --tp {args.tp} x --pp {args.pp}")
    dp = world // inner

    cfg = preset(args.preset)
    source, docs = stdlib_documents()
    if rank != 0:
        torch.distributed.barrier()
    splits = pack(source, docs, args.cache_dir, 0.05)
    if rank == 0 and world > 1:
        torch.distributed.barrier()
    torch.manual_seed(args.seed)
    model, _ = fp8lm.initialize(GPT(cfg), opt_level="O1")
    if world == 1:
        run = SingleRun(model)
        dp_rank = 0
    else:
        from torch.distributed.device_mesh import init_device_mesh

        name = "tp" if args.tp > 1 else "pp"
        mesh = init_device_mesh("cpu", (dp, inner), mesh_dim_names=("dp", name))
        dp_rank = mesh["dp"].get_local_rank()
        local = GLOBAL_BATCH // dp
        run = TensorParallelRun(model, mesh, cfg) if args.tp > 1 else PipelineRun(model, mesh, cfg, local)
    sampler = BatchSampler(splits.train, GLOBAL_BATCH // dp, cfg.block_size, args.seed + dp_rank)
    val = eval_batches(splits.val, 8, GLOBAL_BATCH, cfg.block_size)
    opt = optimizer(run.model)

    step_stats, losses, skipped = [], [], 0
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, args.steps // 10, args.steps, 0.1)
        reset_comm_stats()
        losses.append(run.train_step(*sampler.next()))
        if math.isfinite(run.clip()):
            opt.step()
        else:
            skipped += 1
        opt.zero_grad(set_to_none=True)
        step_stats.append(comm_stats())
    seconds = time.perf_counter() - start

    run.model.eval()
    with torch.no_grad():
        val_loss = sum(float(run.loss(vx, vy)) for vx, vy in val) / len(val)
    bf16 = run.bf16_bytes(cfg, GLOBAL_BATCH // dp)
    per_step = {k: sum(s[k] for s in step_stats) / len(step_stats) for k in step_stats[0]} if step_stats else {}
    if rank == 0:
        result = {
            "benchmark": "level3",
            "preset": args.preset,
            "world_size": world,
            "dp": dp,
            "tp": args.tp,
            "pp": args.pp,
            "steps": args.steps,
            "global_batch": GLOBAL_BATCH,
            "val_loss": val_loss,
            "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]),
            "skipped_steps": skipped,
            "seconds": seconds,
            "comm_bytes_per_step": per_step.get("total_bytes", 0.0),
            "comm_bytes_per_step_by_kind": {k: per_step.get(f"{k}_bytes", 0.0) for k in KINDS},
            "bf16_bytes_per_step": bf16,
            "num_params": sum(p.numel() for p in model.parameters()),
            "machine": machine(),
        }
        print(json.dumps(result, indent=1))
    if world > 1:
        shutdown(0)


if __name__ == "__main__":
    main()
