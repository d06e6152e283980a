"""Expert parallelism (``--ep N``, N dividing the world size): the ranks form groups of N
consecutive ranks; in each, rank ``r`` holds the experts ``[r E/N, (r+1) E/N)`` of each mixture
(`fp8lm.distributed.ExpertParallelMoE`: tokens travel to their experts and back in FP8
all-to-alls within the group), and every rank a replica of everything else, kept in sync over all
ranks as data parallelism does (`FP8DataParallel` at O1/O2, torch's DDP at fp32/bf16), the experts
left out. With more ranks than N, each expert has a replica in every group.

An expert's gradient sums the tokens of its group's ranks, each rank's loss a mean over its own
batch: `GradientSync` divides it by N as it arrives and averages it over the groups (an FP8
all-reduce at O1/O2, FP32 at fp32/bf16) after backward, as the replicated gradients are averaged
over all ranks, so the step is that of one process on all ranks' batches. The all-to-alls send FP8
at O1/O2 and the rows as they are at bf16/fp32 (the baseline of their bytes). The gradient norm
(`fp8lm.clip_grad_norm_`) adds the replicated gradients' squares once and the experts' over one
group. Every forward needs every rank (validation too). Checkpoints are Distributed Checkpoint
folders, each expert written by the rank that holds it.
"""

from __future__ import annotations

from torch import nn

from ...amp import initialize
from ...distributed.expert_parallel import expert_parallel, expert_parameters
from .base import Layout, LayoutSpec, gradient_sync, point_optimizer_at
from .replicated import ReplicatedLayout

__all__ = ["ExpertParallelLayout", "split_experts", "spread_experts"]


def split_experts(model: nn.Module, optimizer, spec: LayoutSpec, mesh) -> tuple:
    """Keep this rank's experts of its expert-parallel group (``spec.ep`` of the data-parallel ranks
    at its pipeline stage and tensor-parallel place), the optimizer pointed at them; returns the
    groups `GradientSync` takes as ``ep_groups``. On the plain model, before `fp8lm.initialize`."""
    groups = mesh.expert_groups(spec.ep)
    names = {id(p): n for n, p in model.named_parameters()}
    expert_parallel(model, groups[0], fp8=spec.fp8)  # the bf16 and fp32 baselines send their own rows
    point_optimizer_at(optimizer, names, dict(model.named_parameters()))  # this rank's experts only
    return groups


def spread_experts(model: nn.Module, optimizer, spec: LayoutSpec, ranks, mesh):
    """`split_experts`, then the model converted for an FP8 level; returns the model, the optimizer
    and the run's `GradientSync` (which divides and averages the experts' gradients)."""
    groups = split_experts(model, optimizer, spec, mesh)
    if spec.fp8:
        model, optimizer = initialize(model, optimizer, spec.opt_level, **spec.initialize_options)
    return model, optimizer, gradient_sync(spec, ranks, mesh, experts=expert_parameters(model), ep_groups=groups)


class ExpertParallelLayout(ReplicatedLayout):
    name = "expert parallel"
    collective_forward = True

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return spec.ep > 1 and not spec.fsdp and ranks.pp == ranks.tp == 1  # else the pipeline's or tensor's

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        model, optimizer, sync = spread_experts(model, optimizer, spec, ranks, mesh)
        return sync.wrap(model), optimizer, cls(ranks, mesh, sync)

    def counted_comm(self, model: nn.Module) -> dict | None:
        """The counted collectives by kind (under DDP: the all-to-alls; its all-reduce is computed)."""
        return Layout.counted_comm(self, model)
