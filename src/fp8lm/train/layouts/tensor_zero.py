"""Tensor parallelism with FP8 ZeRO (``--tp N`` at O3): each model replica is split over the
``tp`` ranks (`TensorParallelLayout`), and its FP8 weights' FP16 masters and moments are sharded
by whole tensors over the data-parallel ranks (`FP8ZeroOptimizer`, partitioning each rank's local
parts: tensor-parallel peers own the same tensors). After each step an FP8 weight's parts agree
on one scale over ``tp`` (`fp8lm.optim.FP8AdamW`), so checkpoints reshard to any layout; the
gradient norm adds up over ``dp x tp``."""

from __future__ import annotations

from .base import LayoutSpec
from .tensor import TensorParallelLayout
from .zero import ZeroState

__all__ = ["TensorParallelZeroLayout"]


class TensorParallelZeroLayout(ZeroState, TensorParallelLayout):
    name = "tensor parallel, FP8 ZeRO"

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return ranks.tp > 1 and ranks.pp == 1 and spec.opt_level == "O3"

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        model, optimizer, layout = super().parallelize(model, optimizer, spec, ranks, mesh)
        return model, layout.sync.shard_optimizer(model, optimizer), layout
