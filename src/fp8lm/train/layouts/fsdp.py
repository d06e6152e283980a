"""FSDP2 over the data-parallel ranks (``--fsdp``): each rank holds its shards of the weights,
gradients and optimizer state (DTensors). O1/O2 after `fp8lm.initialize` (FP8 weight all-gather,
FP8 gradient reduce-scatter), bf16 with torch's BF16 ``MixedPrecisionPolicy``, fp32 plain, all
through `fp8lm.distributed.fully_shard` so that `comm_stats` counts every collective. After each
step the FP8 all-gather scales are agreed for the next forward (`precompute_fp8_scales`).
Checkpoints keep the sharded model and optimizer in a ``step_<step>.dcp/`` folder (Distributed
Checkpoint), and the checkpoint file the full weights (for ``--init-from`` and inspection)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from ...amp import initialize
from ...distributed import fully_shard, precompute_fp8_scales
from ..config import RunError
from .base import Layout, LayoutSpec, ShardedCheckpoints, point_optimizer_at

__all__ = ["FSDPLayout", "fsdp_options", "shard_blocks_and_model"]


def fsdp_options(spec: LayoutSpec) -> dict:
    """`fully_shard`'s options for a level: FP8 reduce-scatter at the FP8 levels, torch's BF16
    ``MixedPrecisionPolicy`` at bf16, plain at fp32."""
    options: dict = {"fp8_reduce_scatter": spec.fp8}
    if spec.opt_level == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return options


def shard_blocks_and_model(model: nn.Module, options: dict) -> None:
    """FSDP2 over each of the model's blocks, then over the whole (what is left: embeddings, head)."""
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks  # a stage's: by index
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)


class FSDPLayout(ShardedCheckpoints, Layout):
    name = "FSDP2"
    collective_forward = True

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return spec.fsdp and ranks.tp == ranks.pp == 1

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        if mesh is None:
            raise RunError(
                "--fsdp shards over torchrun's ranks: launch with torchrun --nproc_per_node N, or drop --fsdp"
            )
        if spec.fp8:
            model, optimizer = initialize(model, optimizer, spec.opt_level, **spec.initialize_options)
        names = {id(p): name for name, p in model.named_parameters()}
        shard_blocks_and_model(model, {**fsdp_options(spec), "mesh": mesh["dp_shard"]})
        point_optimizer_at(optimizer, names, dict(model.named_parameters()))
        precompute_fp8_scales(model)
        return model, optimizer, cls(ranks, mesh)

    def gradient_sync(self, model: nn.Module, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        return _fsdp_gradient_sync(model, last_micro_batch)

    def after_step(self, model: nn.Module) -> None:
        precompute_fp8_scales(model)

    def model_state(self, model: nn.Module) -> dict:  # type: ignore[override]
        """The full weights too (gathered to rank 0): for ``--init-from`` and inspection."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0
        return get_model_state_dict(model, options=options)


@contextlib.contextmanager
def _fsdp_gradient_sync(model: nn.Module, enabled: bool):
    """FSDP2 reduce-scatters only when ``enabled``; otherwise it accumulates unsharded gradients."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
