"""FSDP2 over the data-parallel ranks (``--fsdp``): each rank holds its shards of the weights,
gradients and optimizer state (DTensors). O1/O2 after `fp8lm.initialize` (FP8 weight all-gather,
FP8 gradient reduce-scatter), bf16 with torch's BF16 ``MixedPrecisionPolicy``, fp32 plain, all
through `fp8lm.distributed.fully_shard` so that `comm_stats` counts every collective (the options:
`GradientSync.fsdp_options`). After each step the FP8 all-gather scales are agreed for the next
forward (`precompute_fp8_scales`). Checkpoints keep the sharded model and optimizer in a
``step_<step>.dcp/`` folder (Distributed Checkpoint), and the checkpoint file the full weights (for
``--init-from`` and inspection)."""

from __future__ import annotations

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ...amp import initialize
from ...distributed import fully_shard, precompute_fp8_scales
from ...distributed.grad_sync import GradientSync
from ..config import RunError
from .base import Layout, LayoutSpec, ShardedCheckpoints, gradient_sync, point_optimizer_at

__all__ = ["FSDPLayout", "shard_blocks_and_model"]


def shard_blocks_and_model(model: nn.Module, spec: LayoutSpec, sync: GradientSync) -> None:
    """FSDP2 over each of the model's blocks, then over the whole (what is left: embeddings, head),
    with ``sync``'s options at ``spec``'s level; every forward runs under ``spec``'s autocast, so
    O1's output head (a BF16 GEMM) has its FP32 weight all-gathered in BF16 (`fully_shard`'s
    ``autocast_dtype``: the values the GEMM multiplies anyway)."""
    options = {**sync.fsdp_options(spec.opt_level), "autocast_dtype": spec.autocast_dtype}
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
        sync = gradient_sync(spec, ranks, mesh)
        shard_blocks_and_model(model, spec, sync)
        point_optimizer_at(optimizer, names, dict(model.named_parameters()))
        precompute_fp8_scales(model)
        return model, optimizer, cls(ranks, mesh, sync)

    def after_step(self, model: nn.Module) -> None:
        precompute_fp8_scales(model)

    def model_state(self, model: nn.Module) -> dict:  # type: ignore[override]
        """The full weights too (gathered to rank 0): for ``--init-from`` and inspection."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0
        return get_model_state_dict(model, options=options)
