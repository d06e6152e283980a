"""FP8 ZeRO (opt_level O3 under torchrun): each data-parallel rank owns whole tensors' master
weights and moments (`FP8ZeroOptimizer`: FP8 gradient reduce-scatter at the optimizer step,
`GradientSync`'s ``"zero"``; FP8 weight all-gather), clips by the global norm of the reduced
gradients and skips a non-finite step itself; checkpoints keep the shards in a ``step_<step>.dcp/``
folder next to the checkpoint file, in the format of every layout."""

from __future__ import annotations

import torch
from torch import nn

from ...amp import initialize
from ...distributed import FP8ZeroOptimizer
from ...grad import clip_grad_norm_
from .base import Layout, LayoutSpec, ShardedCheckpoints, gradient_sync

__all__ = ["ZeroLayout", "ZeroState"]


class ZeroState(ShardedCheckpoints):
    """What FP8 ZeRO changes in a layout: the optimizer state this rank holds is its shard; the
    optimizer reduces, clips (by the global norm, `fp8lm.clip_grad_norm_`) and skips a non-finite
    step itself; checkpoints keep its shards (and the model) in a ``step_<step>.dcp/`` folder."""

    def local_optimizer(self, optimizer: FP8ZeroOptimizer) -> torch.optim.Optimizer:
        return optimizer.shard

    def clip(self, model: nn.Module, optimizer: FP8ZeroOptimizer, max_norm: float) -> float:
        return float(clip_grad_norm_(optimizer, max_norm))  # FP8 ZeRO's: over the reduced gradients' owners

    def clip_and_step(self, model: nn.Module, optimizer: FP8ZeroOptimizer, max_norm: float) -> tuple[float, bool]:
        grad_norm = self.clip(model, optimizer, max_norm)
        optimizer.step()
        return grad_norm, bool(optimizer.last_step_skipped)


class ZeroLayout(ZeroState, Layout):
    name = "FP8 ZeRO"

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return ranks.distributed and ranks.tp == ranks.pp == 1 and spec.opt_level == "O3"

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        model, optimizer = initialize(model, optimizer, spec.opt_level, **spec.initialize_options)
        sync = gradient_sync(spec, ranks, mesh)
        return model, sync.shard_optimizer(model, optimizer), cls(ranks, mesh, sync)  # one rank included
