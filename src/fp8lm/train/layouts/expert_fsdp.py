"""Expert parallelism with FSDP2 (``--ep N --fsdp``): the experts spread over groups of N
consecutive ranks as ``--ep`` alone spreads them (`expert.ExpertParallelLayout`: FP8 token
all-to-alls within a group, each expert's gradient divided by N as it arrives and averaged over its
replicas in the other groups, in FP8 at O1/O2), and everything else sharded over all ranks with
`fp8lm.distributed.fully_shard` as ``--fsdp`` alone shards it (`fsdp.FSDPLayout`: FP8 weight
all-gather and gradient reduce-scatter at O1/O2, BF16 at bf16, FP32 at fp32). The experts stay out
of FSDP2 (``ignored_params``): each rank keeps its experts whole, with their optimizer state.

The gradient norm adds the sharded gradients' squares over all ranks and each expert's once (its
replicas' squares divided by their number). Every forward needs every rank. Checkpoints are
Distributed Checkpoint folders (the shards, and each expert written by a rank that holds it); the
checkpoint file holds no full weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...distributed import comm, precompute_fp8_scales
from ...tensor import ScalingTensor
from .base import Layout, LayoutSpec, ShardedCheckpoints, point_optimizer_at
from .expert import average_over_replicas, expert_groups, spread_experts
from .fsdp import FSDPLayout, fsdp_options, shard_blocks_and_model

__all__ = ["ExpertFSDPLayout"]


class ExpertFSDPLayout(FSDPLayout):
    name = "expert parallel + FSDP2"

    def __init__(
        self, ranks, mesh=None, experts: list[nn.Parameter] | None = None, groups: tuple = (None, None), fp8=True
    ) -> None:
        super().__init__(ranks, mesh)
        self.experts = experts or []
        self.ep_group, self.replica_group = groups
        self.fp8 = fp8

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return spec.ep > 1 and spec.fsdp

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        groups = expert_groups(mesh, spec.ep, ranks.world, "dp_shard")
        model, optimizer, experts = spread_experts(model, optimizer, spec, groups[0])
        names = {id(p): n for n, p in model.named_parameters()}
        options = {**fsdp_options(spec), "mesh": mesh["dp_shard"], "ignored_params": set(experts)}
        shard_blocks_and_model(model, options)
        point_optimizer_at(optimizer, names, dict(model.named_parameters()))
        precompute_fp8_scales(model)
        return model, optimizer, cls(ranks, mesh, experts, groups, spec.fp8)

    def clip(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip by the norm of the whole model's gradients: the shards' squares summed over all
        ranks, each expert's once (after averaging over its replicas, equal on each)."""
        if self.replica_group is not None:
            average_over_replicas(self.experts, self.replica_group, self.fp8)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        held = {id(p.grad) for p in self.experts if p.grad is not None}
        replicas = self.ranks.world // comm.check_group(self.ep_group)[1]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        squares = torch.zeros((), dtype=torch.float64, device=local[0].device)
        for g, values in zip(grads, local, strict=True):
            values = values.dequantize() if isinstance(values, ScalingTensor) else values
            squares += values.double().square().sum() / (replicas if id(g) in held else 1)
        assert self.mesh is not None  # parallelize ran on torchrun's mesh
        comm.all_reduce(squares, group=self.mesh.group("dp_shard"))
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).float()
        coef = torch.where(torch.isfinite(total), coef, torch.full_like(coef, float("nan")))
        divided: set[int] = set()
        with torch.no_grad():
            for g in local:
                if isinstance(g, ScalingTensor):
                    if id(g.scale) not in divided:  # views of one buffer share their scale
                        g.scale.div_(coef)
                        divided.add(id(g.scale))
                else:
                    g.mul_(coef.to(g.dtype))
        return float(total)

    def model_state(self, model: nn.Module) -> None:  # type: ignore[override]
        """No full weights in the checkpoint file: rank 0 holds only its own experts."""
        return ShardedCheckpoints.model_state(self, model)

    def comm_bytes(self, model: nn.Module, num_params: int) -> float:
        return Layout.comm_bytes(self, model, num_params)
