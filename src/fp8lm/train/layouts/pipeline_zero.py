"""Pipeline stages with FP8 ZeRO (``--pp N`` at O3): each stage's FP8 weights, FP16 masters and
moments sharded by whole tensors over the stage's data-parallel ranks (`FP8ZeroOptimizer`), the
gradient norm summed over every stage. With ``--tp`` too (3-D at O3), each stage is split over
the ``tp`` ranks first, as in `fp8lm.train.layouts.tensor_zero`."""

from __future__ import annotations

from .base import LayoutSpec
from .pipeline import PipelineLayout
from .zero import ZeroState

__all__ = ["PipelineZeroLayout"]


class PipelineZeroLayout(ZeroState, PipelineLayout):
    name = "pipeline parallel, FP8 ZeRO"

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return ranks.pp > 1 and spec.opt_level == "O3"

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        stage, optimizer, layout = super().parallelize(model, optimizer, spec, ranks, mesh)
        return stage, layout.sync.shard_optimizer(stage, optimizer), layout
