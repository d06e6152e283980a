"""Data parallelism with the whole model state on every rank: gradients averaged during backward by
`FP8DataParallel` (FP8 all-reduce) at O1/O2, by torch's ``DistributedDataParallel`` (FP32
all-reduce, the baseline FP8-LM compares with) at fp32/bf16 (`GradientSync`'s ``"wrapper"``).
Checkpoints are Distributed Checkpoint folders, as every layout's (the replicated state written once)."""

from __future__ import annotations

from torch import nn

from ...amp import initialize
from ...distributed import FP8DataParallel
from .base import Layout, LayoutSpec, ShardedCheckpoints, gradient_sync

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
        sync = gradient_sync(spec, ranks, mesh)
        return sync.wrap(model), optimizer, cls(ranks, mesh, sync)

    def core(self, model: nn.Module) -> nn.Module:
        return model.module

    def counted_comm(self, model: nn.Module) -> dict | None:
        # torch's DDP is not counted but computed (comm_bytes)
        return None if isinstance(model, nn.parallel.DistributedDataParallel) else super().counted_comm(model)

    def data_parallel_state(self, model: nn.Module) -> dict | None:
        """FP8DataParallel's own state (its gradient scaling) for the checkpoint."""
        return model.get_extra_state() if isinstance(model, FP8DataParallel) else None

    def load_data_parallel_state(self, model: nn.Module, state: dict | None) -> None:
        if state is not None and isinstance(model, FP8DataParallel):
            model.set_extra_state(state)
