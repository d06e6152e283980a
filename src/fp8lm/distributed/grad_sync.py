"""Where a run's gradients are synchronized: `GradientSync`, one per run, makes each rank's
gradients those of one process on all ranks' batches, one mesh dimension after the other:

1. ``tp``: the partial gradients of parameters replicated over the tensor-parallel ranks (each
   rank saw its slice of the sequence) are summed after backward: the sequence-parallel norms' in
   FP32 (they are small), a `SequenceParallelMoE`'s experts' in FP8 at O1/O2 (its router's in
   FP32);
2. ``dp_replicate``: every gradient is averaged over the replicas: through `FP8DataParallel` (O1/O2:
   buckets of FP8 all-reduce launched during backward) or torch's DDP (fp32/bf16) when a replica is
   the whole model (``"wrapper"``), else after backward tensor by tensor (``"all-reduce"``: the
   FP8 all-reduce at O1/O2, the gradient's dtype at bf16/fp32), under tensor or pipeline parallelism;
3. ``dp_shard``: the gradients are reduce-scattered to the ranks that own their shard: FSDP2's
   reduce-scatter during backward (``"fsdp"``: `FP8ReduceScatter` at O1/O2, BF16 at bf16, FP32 at
   fp32), or at O3 FP8 ZeRO's at the optimizer step (``"zero"``: `FP8ZeroOptimizer`, which holds
   the owners' shards and reduces before it clips);
4. ``ep``: an expert's gradient, which sums the tokens of every rank of its expert-parallel group,
   is divided by the group's size as it arrives, then averaged over the expert's replicas in the
   other groups (FP8 all-reduce at O1/O2, FP32 otherwise) after backward.

`SyncPlan` says which of these a run does (a pure function of its mesh and options); `GradientSync`
installs the ones that run inside backward or the optimizer (`wrap`, `fsdp_options`,
`shard_optimizer`), holds a micro-batch's backward back from syncing (`micro_batch`) and runs
the ones that follow backward (`finish`). FP8 travels on every wire at O1/O2/O3, through the
collectives of this package, but for the gradients that `sent_in_bf16` names (the output head's,
those of layers switched to high precision): BF16 in every one of these syncs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..tensor import ScalingTensor, gemm_layers_by_weight
from . import comm
from .accounting import ddp_bytes
from .collectives import bf16_all_reduce, fp8_all_reduce
from .data_parallel import FP8DataParallel
from .mesh import ParallelDims, ParallelMesh
from .reduction import sent_in_bf16
from .sequence_moe import sequence_parallel_parameters
from .zero import FP8ZeroOptimizer

__all__ = ["SyncPlan", "GradientSync", "DivideGrad", "SYNC_DIMS"]

SYNC_DIMS = ("tp", "dp_replicate", "dp_shard", "ep")  # the order gradients are synchronized in


@dataclass(frozen=True)
class SyncPlan:
    """How each dimension's gradients are synchronized (None: nothing to do): ``tp``
    ``"partial sum"``; ``dp_replicate`` ``"wrapper"`` or ``"all-reduce"``; ``dp_shard`` ``"fsdp"`` or
    ``"zero"``; ``ep`` ``"experts"`` (module docstring)."""

    tp: str | None = None
    dp_replicate: str | None = None
    dp_shard: str | None = None
    ep: str | None = None

    @classmethod
    def for_run(cls, dims: ParallelDims, *, fsdp: bool = False, zero: bool = False, ep: int = 1) -> SyncPlan:
        """The plan of a run on ``dims`` (the whole model on every rank: no `dims` larger than 1),
        sharding with FSDP2 (``fsdp``) or FP8 ZeRO (``zero``, O3), experts over ``ep`` ranks."""
        if fsdp and zero:
            raise ValueError("FSDP2 and FP8 ZeRO both shard the state over dp_shard: pick one")
        whole = dims.tp == dims.pp == 1  # a replica is the whole model: a wrapper syncs during backward
        sharded = fsdp or zero
        replicate: str | None = "all-reduce" if dims.dp_replicate > 1 else None
        if whole and not sharded:
            replicate = "wrapper"  # one rank included: the distributed code path
        return cls(
            tp="partial sum" if dims.tp > 1 else None,
            dp_replicate=replicate,
            dp_shard="fsdp" if fsdp else "zero" if zero else None,
            ep="experts" if ep > 1 else None,
        )

    def ways(self) -> dict[str, str]:
        """The dimensions that sync, in order, each with how."""
        return {dim: way for dim in SYNC_DIMS if (way := getattr(self, dim)) is not None}


class DivideGrad:
    """A gradient hook: the gradient divided by ``n`` (a class, so models with it still pickle)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.n


class GradientSync:
    """The gradient sync of a run: `SyncPlan` ``plan`` on ``mesh`` (None: one process, nothing to
    sync). ``fp8``: FP8 on the wires (O1/O2/O3); ``scaling``: `FP8DataParallel`'s. ``experts``: the
    expert parameters this rank holds (kept out of the data-parallel sync), spread over
    ``ep_group`` (``ep`` ranks) with one replica per group of ``replica_group`` (None: one group)."""

    def __init__(
        self,
        plan: SyncPlan,
        mesh: ParallelMesh | None,
        *,
        fp8: bool,
        scaling: str = "local",
        experts: Iterable[nn.Parameter] = (),
        ep_groups: tuple = (None, None),
    ) -> None:
        if mesh is None and plan.ways():
            raise ValueError(f"gradient sync {plan.ways()} needs the run's mesh")
        self.plan, self.mesh, self.fp8, self.scaling = plan, mesh, fp8, scaling
        self.experts = list(experts)
        self.ep_group, self.replica_group = ep_groups
        if self.experts and plan.ep is None:
            raise ValueError("experts= needs a plan with expert parallelism: SyncPlan.for_run(..., ep=N)")
        self.ep = comm.check_group(self.ep_group)[1] if plan.ep else 1
        for p in self.experts:  # as they arrive: every micro-batch's, before it accumulates
            p.register_hook(DivideGrad(self.ep))
        # unsharded, the norm adds up over an expert group of every stage and tensor-parallel place
        self.expert_model = None
        if plan.ep and mesh is not None and mesh.dims.dp_shard == 1:
            whole = mesh.dims.pp == mesh.dims.tp == 1
            self.expert_model = self.ep_group if whole else mesh.expert_model_group(self.ep)

    @classmethod
    def none(cls) -> GradientSync:
        """One process: nothing to sync."""
        return cls(SyncPlan(), None, fp8=False)

    def group(self, dim: str):
        """The process group of mesh dimension ``dim`` (or of the flattened ``dp`` / ``model``)."""
        assert self.mesh is not None, "one process: no groups"
        return self.mesh.group(dim)

    # -- installed: what syncs inside backward or the optimizer ---------------------------------

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` wrapped for the ``dp_replicate`` ``"wrapper"`` sync (`FP8DataParallel` at FP8
        levels, torch's DDP otherwise, the experts left out); else ``model`` itself."""
        if self.plan.dp_replicate != "wrapper":
            return model
        group = self.group("dp_replicate")
        if self.fp8:
            return FP8DataParallel(model, group, scaling=self.scaling, local_params=self.experts)
        if self.experts:
            held = {id(p) for p in self.experts}
            ignored = [n for n, p in model.named_parameters() if id(p) in held]
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        return nn.parallel.DistributedDataParallel(model, process_group=group)

    def fsdp_options(self, opt_level: str) -> dict:
        """`fp8lm.distributed.fully_shard`'s options for the ``dp_shard`` ``"fsdp"`` sync at
        ``opt_level``: the mesh, FP8 reduce-scatter at the FP8 levels, torch's BF16
        ``MixedPrecisionPolicy`` (gather and reduce-scatter in BF16) at bf16, plain at fp32; the
        experts stay out of FSDP2."""
        assert self.plan.dp_shard == "fsdp", self.plan
        options: dict = {"fp8_reduce_scatter": self.fp8, "mesh": self.mesh["dp_shard"]}  # type: ignore[index]
        if opt_level == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if self.experts:
            options["ignored_params"] = set(self.experts)
        return options

    def shard_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> FP8ZeroOptimizer:
        """``optimizer`` sharded for the ``dp_shard`` ``"zero"`` sync: FP8 ZeRO over ``dp_shard``,
        the gradient norm summed over the ranks that hold the model (``model``: pp x dp_shard x tp)."""
        assert self.plan.dp_shard == "zero" and self.mesh is not None, self.plan
        spread = self.mesh.dims.tp * self.mesh.dims.pp > 1
        norm = {"norm_group": self.group("model"), "norm_stage_size": self.mesh.dims.tp} if spread else {}
        return FP8ZeroOptimizer(model, optimizer, self.group("dp_shard"), **norm)

    # -- a step ------------------------------------------------------------------------------------

    def micro_batch(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch's backward: the wrapper and FSDP2 sync only on the step's last."""
        if self.plan.dp_replicate == "wrapper" and not last:
            return model.no_sync()  # type: ignore[operator]
        if self.plan.dp_shard == "fsdp" and isinstance(model, FSDPModule):
            return _fsdp_requires_sync(model, last)
        return contextlib.nullcontext()

    def finish(self, model: nn.Module) -> None:
        """After the step's last backward: the syncs that follow it, dimension by dimension."""
        routed = sequence_parallel_parameters(model) if self.plan.tp is not None else []  # a mixture's slices
        replicas = self.plan.ep is not None and self.replica_group is not None
        layers = gemm_layers_by_weight(model) if routed or replicas else {}  # one walk for both
        if self.plan.tp is not None:
            _sum_partial_grads(model, self.group("tp"))
            experts = [p for p in routed if id(p) in layers]
            others = [p for p in routed if id(p) not in layers]  # routers, biases: FP32, as the norms
            _reduce_in_place(experts, layers, self.group("tp"), self.fp8, average=False)
            _reduce_in_place(others, layers, self.group("tp"), False, average=False)
        if self.plan.dp_replicate == "all-reduce":  # the experts are not replicas: averaged below
            _average_grads(model, self.group("dp_replicate"), self.fp8, skip={id(p) for p in self.experts})
        if replicas:
            _reduce_in_place(self.experts, layers, self.replica_group, self.fp8, average=True)

    def clip_options(self) -> dict:
        """`fp8lm.clip_grad_norm_`'s options for the gradients as synced: the group over which their
        norm adds up and how many of its ranks hold each gradient (`ParallelMesh.clip_options`);
        with experts, those are split over the ``ep`` ranks of their group, summed over it too
        (every gradient whole on every rank when no rank holds a part alone: no options)."""
        mesh = self.mesh
        if mesh is None:
            return {}
        experts = {"ep_params": self.experts, "ep": self.ep} if self.plan.ep else {}
        if self.expert_model is not None:  # each stage's and tp place's part over one expert group
            return {"group": self.expert_model, "stage_size": self.ep * mesh.dims.tp, **experts}
        if mesh.model.size() > 1:  # sharded: the model group holds every expert group
            return {**mesh.clip_options(), **experts}
        return {}

    def uncounted_bytes(self, model: nn.Module, num_params: int, world: int) -> float:
        """Bytes torch's DDP sent (not counted by `comm_stats`: computed as its FP32 all-reduce over
        ``world`` ranks of what is not an expert, ``num_params`` being the whole model's: each of
        the ``ep`` ranks of a group holds its own experts); 0 for every other sync."""
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            return 0.0
        experts = self.ep * sum(p.numel() for p in self.experts)
        return ddp_bytes(num_params - experts, 4, world)


@contextlib.contextmanager
def _fsdp_requires_sync(model: FSDPModule, enabled: bool):
    """FSDP2 reduce-scatters only when ``enabled``; otherwise it accumulates unsharded gradients."""
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _sum_partial_grads(model: nn.Module, tp_group) -> None:
    """Partial DTensor gradients (the sequence-parallel norms') summed over ``tp_group`` in FP32
    (a plain all-reduce: they are small), then replicated."""
    for p in model.parameters():
        grad = p.grad
        if isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
            local = comm.all_reduce(grad.to_local().contiguous(), group=tp_group)
            p.grad = DTensor.from_local(local, grad.device_mesh, (Replicate(),), run_check=False)


def _average_grads(model: nn.Module, group, fp8: bool, skip: Collection[int] = ()) -> None:
    """Every gradient's local tensor averaged over ``group`` (but those of the parameters whose
    ids are in ``skip``): the FP8 all-reduce with ``fp8`` (BF16 for the gradients `sent_in_bf16`
    names), else a plain all-reduce in the gradient's dtype (what DDP sends). A `ScalingTensor`
    gradient (O2's E4M3 weight gradients, the head's BF16 one) takes the mean in its own format and
    storage, as one process keeps it: up to commit 1e61f4f it became an FP32 tensor, 3 bytes per
    weight more at rest and no weight-gradient telemetry under --tp / --pp with replicas."""
    layers = gemm_layers_by_weight(model) if fp8 else {}
    for p in model.parameters():
        grad = p.grad
        if grad is None or id(p) in skip:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if fp8:
            averaged = _fp8_mean(local, p, layers.get(id(p)), group)
            if isinstance(local, ScalingTensor):
                with torch.no_grad():
                    local.copy_(averaged.view(local.shape))
                continue
            averaged = averaged.to(local.dtype)
        else:
            averaged = comm.all_reduce(local.contiguous(), group=group) / comm.check_group(group)[1]
        if isinstance(grad, DTensor):
            averaged = DTensor.from_local(averaged, grad.device_mesh, grad.placements, run_check=False)
        p.grad = averaged


def _fp8_mean(
    grad: torch.Tensor, param: nn.Parameter, layer: nn.Module | None, group, average: bool = True
) -> torch.Tensor:
    """The mean (``average``, else the sum) of ``grad`` over ``group`` as the FP8 levels send it:
    FP8, or BF16 for a gradient that `sent_in_bf16` keeps out of FP8 (``layer``: the FP8 layer
    whose weight ``param`` is)."""
    if sent_in_bf16(param, layer):
        return bf16_all_reduce(grad, group, average=average)
    return fp8_all_reduce(grad, group, average=average)


def _reduce_in_place(params: list[nn.Parameter], layers: dict, group, fp8: bool, average: bool) -> None:
    """Each gradient of ``params`` averaged (``average``) or summed over ``group``, in place, in its
    own format and storage: the experts' over their replicas (one per expert group), the
    sequence-parallel mixtures' parts over ``tp``. With ``fp8`` they travel in FP8 (BF16 while
    their layer in ``layers`` is switched to high precision), else in FP32."""
    size = comm.check_group(group)[1]
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g is None:
                continue
            g = g.to_local() if isinstance(g, DTensor) else g  # under FSDP2: this rank's shard
            values = g.dequantize() if isinstance(g, ScalingTensor) else g.detach().float()
            if fp8:
                reduced = _fp8_mean(values, p, layers.get(id(p)), group, average)
            else:
                reduced = comm.all_reduce(values.clone(), group=group)
                reduced = reduced / size if average else reduced
            g.copy_(reduced.view(g.shape))
