"""Expert parallelism with FSDP2 (``--ep N --fsdp``): the experts spread over groups of N
consecutive ranks as ``--ep`` alone spreads them (`expert.ExpertParallelLayout`: FP8 token
all-to-alls within a group, each expert's gradient divided by N as it arrives and averaged over its
replicas in the other groups, in FP8 at O1/O2), and everything else sharded over all ranks with
`fp8lm.distributed.fully_shard` as ``--fsdp`` alone shards it (`fsdp.FSDPLayout`: FP8 weight
all-gather and gradient reduce-scatter at O1/O2, BF16 at bf16, FP32 at fp32). The experts stay out
of FSDP2 (``ignored_params``): each rank keeps its experts whole, with their optimizer state. All of
it is the run's `GradientSync`.

The gradient norm (`fp8lm.clip_grad_norm_`) adds the sharded gradients' squares over all ranks and
each expert's once (its replicas' squares divided by their number). Every forward needs every rank.
Checkpoints are Distributed Checkpoint folders (the shards, and each expert written by a rank that
holds it); the checkpoint file holds no full weights.
"""

from __future__ import annotations

from torch import nn

from ...distributed import precompute_fp8_scales
from .base import LayoutSpec, ShardedCheckpoints, point_optimizer_at
from .expert import spread_experts
from .fsdp import FSDPLayout, shard_blocks_and_model

__all__ = ["ExpertFSDPLayout"]


class ExpertFSDPLayout(FSDPLayout):
    name = "expert parallel + FSDP2"

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return spec.ep > 1 and spec.fsdp and ranks.pp == ranks.tp == 1

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        model, optimizer, sync = spread_experts(model, optimizer, spec, ranks, mesh)
        names = {id(p): n for n, p in model.named_parameters()}
        shard_blocks_and_model(model, spec, sync)
        point_optimizer_at(optimizer, names, dict(model.named_parameters()))
        precompute_fp8_scales(model)
        return model, optimizer, cls(ranks, mesh, sync)

    def model_state(self, model: nn.Module) -> None:  # type: ignore[override]
        """No full weights in the checkpoint file: rank 0 holds only its own experts."""
        return ShardedCheckpoints.model_state(self, model)
