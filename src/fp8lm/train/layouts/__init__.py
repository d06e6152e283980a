"""How a run's model and optimizer are spread over the ranks: one class per layout, each in its own
module, all behind the `Layout` protocol (`base`). `parallelize` picks the first of `LAYOUTS` that
applies to the run and lets it convert and spread the model; the training loop then calls only the
layout's methods.

A new layout is a new module here and an entry in `LAYOUTS`.
"""

from __future__ import annotations

import torch
from torch import nn

from ...distributed.mesh import ParallelMesh
from ..ranks import Ranks
from .base import Layout, LayoutSpec, PipelineShape
from .expert import ExpertParallelLayout
from .expert_fsdp import ExpertFSDPLayout
from .fsdp import FSDPLayout
from .pipeline import PipelineLayout
from .pipeline_zero import PipelineZeroLayout
from .replicated import ReplicatedLayout
from .tensor import TensorParallelLayout
from .tensor_zero import TensorParallelZeroLayout
from .zero import ZeroLayout

__all__ = [
    "LAYOUTS",
    "Layout",
    "LayoutSpec",
    "PipelineShape",
    "ExpertFSDPLayout",
    "ExpertParallelLayout",
    "parallelize",
    "FSDPLayout",
    "PipelineLayout",
    "PipelineZeroLayout",
    "ReplicatedLayout",
    "TensorParallelLayout",
    "TensorParallelZeroLayout",
    "ZeroLayout",
]

# Asked in order; the one-process layout (the base) last.
LAYOUTS: tuple[type[Layout], ...] = (
    ExpertFSDPLayout,
    ExpertParallelLayout,
    PipelineZeroLayout,
    PipelineLayout,
    TensorParallelZeroLayout,
    TensorParallelLayout,
    FSDPLayout,
    ZeroLayout,
    ReplicatedLayout,
    Layout,
)


def parallelize(
    model: nn.Module, optimizer: torch.optim.Optimizer, spec: LayoutSpec, ranks: Ranks, mesh: ParallelMesh | None
) -> tuple[nn.Module, torch.optim.Optimizer, Layout]:
    """Convert ``model``/``optimizer`` for ``spec``'s level and spread them over ``ranks`` (on
    ``mesh``, None in one process) with the layout that applies; returns the model to train, the
    optimizer and the layout."""
    for layout in LAYOUTS:
        if layout.applies(spec, ranks):
            return layout.parallelize(model, optimizer, spec, ranks, mesh)
    raise ValueError(f"no layout for {spec} on {ranks}")  # unreachable: config.validate refuses first
