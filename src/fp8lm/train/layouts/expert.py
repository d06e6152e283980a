"""Expert parallelism (``--ep N``, N dividing the world size): the ranks form groups of N
consecutive ranks; in each, rank ``r`` holds the experts ``[r E/N, (r+1) E/N)`` of each mixture
(`fp8lm.distributed.ExpertParallelMoE`: tokens travel to their experts and back in FP8
all-to-alls within the group), and every rank a replica of everything else, kept in sync over all
ranks as data parallelism does (`FP8DataParallel` at O1/O2, torch's DDP at fp32/bf16), the experts
left out. With more ranks than N, each expert has a replica in every group: its gradients are
averaged over them (an FP8 all-reduce at O1/O2, FP32 at fp32/bf16) before the step.

An expert's gradient sums the tokens of its group's ranks, each rank's loss a mean over its own
batch: it is divided by N as it arrives and averaged over the groups, as the replicated gradients
are averaged over all ranks, so the step is that of one process on all ranks' batches. The all-to-alls send FP8 at O1/O2 and the rows as they
are at bf16/fp32 (the baseline of their bytes). The gradient norm adds the replicated gradients' squares
once and the experts' over one group. Every forward needs every rank (validation too).
Checkpoints are Distributed Checkpoint folders, each expert written by the rank that holds it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ...amp import initialize
from ...distributed import FP8DataParallel, comm, ddp_bytes, fp8_all_reduce
from ...distributed.expert_parallel import expert_parallel, expert_parameters
from ...tensor import ScalingTensor
from .base import Layout, LayoutSpec, point_optimizer_at
from .replicated import ReplicatedLayout

__all__ = ["ExpertParallelLayout", "average_over_replicas", "expert_groups"]


class DivideGrad:
    """A gradient hook: the gradient divided by ``n`` (a class, so models with it still pickle)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.n


def spread_experts(model: nn.Module, optimizer, spec: LayoutSpec, ep_group):
    """Keep this rank's experts of ``ep_group`` (the optimizer pointed at them), convert the model
    for an FP8 level, and divide the experts' gradients by the expert-parallel size; returns the
    model, the optimizer and this rank's expert parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    expert_parallel(model, ep_group, fp8=spec.fp8)  # the bf16 and fp32 baselines send their own rows
    point_optimizer_at(optimizer, names, dict(model.named_parameters()))  # this rank's experts only
    if spec.fp8:
        model, optimizer = initialize(model, optimizer, spec.opt_level, **spec.initialize_options)
    experts = expert_parameters(model)
    for p in experts:
        p.register_hook(DivideGrad(spec.ep))
    return model, optimizer, experts


class ExpertParallelLayout(ReplicatedLayout):
    name = "expert parallel"
    collective_forward = True

    def __init__(
        self, ranks, mesh=None, experts: list[nn.Parameter] | None = None, groups: tuple = (None, None), fp8=True
    ) -> None:
        super().__init__(ranks, mesh)
        self.experts = experts or []
        # the expert-parallel group (the ranks that exchange tokens) and the group of an expert's
        # replicas (None: one replica)
        self.ep_group, self.replica_group = groups
        self.fp8 = fp8

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return spec.ep > 1 and not spec.fsdp

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        group = mesh.group("dp_replicate")
        ep_group, replica_group = expert_groups(mesh, spec.ep, ranks.world)
        model, optimizer, experts = spread_experts(model, optimizer, spec, ep_group)
        if spec.fp8:
            model = FP8DataParallel(model, group, scaling=spec.grad_sync_scaling, local_params=experts)
        else:
            held = {id(p) for p in experts}
            ignored = [n for n, p in model.named_parameters() if id(p) in held]
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
            model = nn.parallel.DistributedDataParallel(model, process_group=group)
        return model, optimizer, cls(ranks, mesh, experts, (ep_group, replica_group), spec.fp8)

    def comm_bytes(self, model: nn.Module, num_params: int) -> float:
        """The counted all-to-alls, and the replicated gradients' sync: counted by FP8DataParallel,
        computed for torch's DDP (FP32 all-reduce of what is not an expert)."""
        counted = Layout.comm_bytes(self, model, num_params)
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            return counted
        experts = self.ranks.world * sum(p.numel() for p in self.experts)
        return counted + ddp_bytes(num_params - experts, 4, self.ranks.world)

    def counted_comm(self, model: nn.Module) -> dict | None:
        """The counted collectives by kind (under DDP: the all-to-alls; its all-reduce is computed)."""
        return Layout.counted_comm(self, model)

    def clip(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip by the norm of the whole model's gradients: the replicated ones (equal on every
        rank) once, each expert's from the rank that holds it."""
        if self.replica_group is not None:
            average_over_replicas(self.experts, self.replica_group, self.fp8)
        grads = [p.grad for p in model.parameters() if p.grad is not None]  # model: the core
        held = {id(p.grad) for p in self.experts if p.grad is not None}
        device = grads[0].device
        squares = torch.zeros(2, dtype=torch.float64, device=device)  # replicated, this rank's experts
        for g in grads:
            values = g.dequantize() if isinstance(g, ScalingTensor) else g
            squares[1 if id(g) in held else 0] += values.double().square().sum()
        mine = squares[1:].clone()
        comm.all_reduce(mine, group=self.ep_group)  # the experts of one group: each once
        total = (squares[0] + mine[0]).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).float()
        coef = torch.where(torch.isfinite(total), coef, torch.full_like(coef, float("nan")))
        divided: set[int] = set()
        with torch.no_grad():
            for g in grads:
                if isinstance(g, ScalingTensor):
                    if id(g.scale) not in divided:  # views of one buffer share their scale
                        g.scale.div_(coef)
                        divided.add(id(g.scale))
                else:
                    g.mul_(coef.to(g.dtype))
        return float(total)


def average_over_replicas(experts: list[nn.Parameter], replica_group, fp8: bool) -> None:
    """Each expert's gradient averaged over its replicas (one per group): in FP8 with ``fp8``."""
    with torch.no_grad():
        for p in experts:
            g = p.grad
            if g is None:
                continue
            values = g.dequantize() if isinstance(g, ScalingTensor) else g.detach().float()
            if fp8:
                mean = fp8_all_reduce(values, replica_group, average=True)
            else:
                mean = comm.all_reduce(values.clone(), group=replica_group) / comm.check_group(replica_group)[1]
            g.copy_(mean)


def expert_groups(mesh, ep: int, world: int, data_parallel: str = "dp_replicate") -> tuple:
    """The expert-parallel group of this rank (``ep`` consecutive ranks) and the group of its
    experts' replicas (the ranks at its place in the other groups; None when there is one group).
    ``data_parallel``: the mesh dimension of all ranks (the whole group when ``ep`` is the world)."""
    if ep == world:
        return mesh.group(data_parallel), None
    experts = init_device_mesh(mesh.root.device_type, (world // ep, ep), mesh_dim_names=("ep_replicate", "ep"))
    return experts.get_group("ep"), experts.get_group("ep_replicate")
