"""Data parallelism with the whole model state on every rank: `FP8DataParallel` (FP8 gradient
all-reduce) at O1/O2, torch's ``DistributedDataParallel`` (FP32 gradient all-reduce, the
baseline FP8-LM compares with) at fp32/bf16. Checkpoints are Distributed Checkpoint folders, as
every layout's (the replicated state written once)."""

from __future__ import annotations

import contextlib

from torch import nn

from ...amp import initialize
from ...distributed import FP8DataParallel, ddp_bytes
from .base import Layout, LayoutSpec, ShardedCheckpoints

__all__ = ["ReplicatedLayout"]


class ReplicatedLayout(ShardedCheckpoints, Layout):
    name = "data parallel"

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return ranks.distributed and ranks.tp == ranks.pp == 1 and not spec.fsdp and spec.opt_level != "O3"

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        if spec.fp8:  # FP8DataParallel itself, at any world size (one rank included: the code path)
            model, optimizer = initialize(model, optimizer, spec.opt_level, **spec.initialize_options)
            model = FP8DataParallel(model, mesh.group("dp_replicate"), scaling=spec.grad_sync_scaling)
        else:
            model = nn.parallel.DistributedDataParallel(model, process_group=mesh.group("dp_replicate"))
        return model, optimizer, cls(ranks, mesh)

    def core(self, model: nn.Module) -> nn.Module:
        return model.module

    def gradient_sync(self, model: nn.Module, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last_micro_batch else model.no_sync()

    def comm_bytes(self, model: nn.Module, num_params: int) -> float:
        # torch's DDP is not counted but computed: its FP32 gradients by the standard all-reduce cost
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return ddp_bytes(num_params, 4, self.ranks.world)
        return super().comm_bytes(model, num_params)

    def counted_comm(self, model: nn.Module) -> dict | None:
        return None if isinstance(model, nn.parallel.DistributedDataParallel) else super().counted_comm(model)

    def data_parallel_state(self, model: nn.Module) -> dict | None:
        """FP8DataParallel's own state (its gradient scaling) for the checkpoint."""
        return model.get_extra_state() if isinstance(model, FP8DataParallel) else None

    def load_data_parallel_state(self, model: nn.Module, state: dict | None) -> None:
        if state is not None and isinstance(model, FP8DataParallel):
            model.set_extra_state(state)
