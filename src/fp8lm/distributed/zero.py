"""FP8 ZeRO (``opt_level="O3"``): FP8 weights on every rank, master weights and Adam states
partitioned across ranks by whole tensors.

Partition (FP8-LM / MS-AMP): tensors sorted by size, largest first, each given to the rank with
the fewest elements so far; a tensor's scale stays with it. Each step:

1. gradients (FP8 ScalingTensors from FP8 layers, plain ones otherwise) are reduce-scattered in
   FP8 to their owners (all-to-all of uint8 payloads laid out by owner, FP32 sums on the owner),
   but those `sent_in_bf16` names (the output head's, a switched layer's), which go in BF16;
2. each rank's optimizer updates only the tensors it owns: their FP16 master and FP8/FP16 moments
   live only there (`fp8lm.optim.FP8AdamW` keeps the master of an FP8 weight in its state);
3. the owners' updated weights, already FP8 with their scales, are all-gathered as bytes (a plain
   FP32 parameter, e.g. a norm gain, travels in FP32).

A non-finite gradient anywhere skips the step on every rank. Checkpoints are sharded by tensor
name with `torch.distributed.checkpoint` (see `save_checkpoint`), so they load at any world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..grad import clip_grad_norm_
from ..optim.dtensor import sharded_like
from ..optim.skipping import SkipsNonFiniteSteps
from ..tensor import ScalingTensor, gemm_layers_by_weight
from . import comm
from .data_parallel import broadcast_module
from .reduction import BF16Reduction, FlatLayout, FP8Reduction, split_by_wire

__all__ = ["partition_by_size", "FP8ZeroOptimizer"]


def partition_by_size(numels: list[int], world_size: int) -> list[int]:
    """Owner rank of each tensor: largest first, each to the rank holding the fewest elements so
    far (the lowest rank on a tie); deterministic, so every rank computes the same answer."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += numels[i]
    return owners


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor-parallel DTensor; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _storage(p: torch.Tensor) -> torch.Tensor:
    """The bytes this rank stores a parameter in: a ScalingTensor's payload, or the tensor itself
    (of a tensor-parallel DTensor: its local part)."""
    p = _local(p)
    return p.payload if isinstance(p, ScalingTensor) else p.data


class FP8ZeroOptimizer(SkipsNonFiniteSteps, torch.optim.Optimizer):
    """Shards ``optimizer`` (built over ``model``'s parameters, e.g. by ``fp8lm.initialize(...,
    "O3")``) across ``process_group``.

    ``optimizer`` becomes this rank's shard: its param groups keep only the tensors this rank
    owns. This object's ``param_groups`` hold every parameter with the hyper-parameters (an LR
    scheduler may change them); they are copied to the shard at each step. Gradients accumulate
    locally until `step` (or `reduce_gradients`), so gradient accumulation needs no ``no_sync``.
    Skipped steps and clipping follow `fp8lm.optim.SkipsNonFiniteSteps` (one count for all ranks;
    `clip_grad_norm_` by the global norm).

    ``norm_group``: the ranks over which the gradient norm adds up, when more than
    ``process_group``'s hold parameters of the model (pipeline stages, each sharded over its own
    data-parallel ranks: the stages' ``pp x dp`` group); ``process_group`` by default.
    ``norm_stage_size``: how many ranks of ``norm_group`` hold each owned gradient (the
    tensor-parallel ranks, whose DTensor parameters ZeRO partitions by their local parts:
    `fp8lm.clip_grad_norm_`'s ``stage_size``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        process_group=None,
        norm_group=None,
        norm_stage_size: int = 1,
    ) -> None:
        self.rank, self.world_size = comm.check_group(process_group)
        if any(optimizer.state.values()):
            raise ValueError(
                "the optimizer already has state; shard it before its first step "
                "(fp8lm.distributed.wrap does this right after fp8lm.initialize)"
            )
        names = {id(p): n for n, p in model.named_parameters()}
        params: list[nn.Parameter] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        "the optimizer holds a parameter that is not in the model: build it over model.parameters()"
                    )
                params.append(p)
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in the optimizer's param groups")
        self.process_group = process_group
        self.norm_group = norm_group if norm_group is not None else process_group
        self.norm_stage_size = norm_stage_size
        self.names = [names[id(p)] for p in params]
        self.params = params
        self.owners = partition_by_size([_local(p).numel() for p in params], self.world_size)
        self.shard = optimizer
        self._owner_of = {id(p): o for p, o in zip(params, self.owners)}
        super().__init__([dict(g, params=list(g["params"])) for g in optimizer.param_groups], optimizer.defaults)
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if self._owner_of[id(p)] == self.rank]
        self._layer_of = gemm_layers_by_weight(model)
        self._grad_layouts: dict[tuple, FlatLayout] = {}  # by the positions reduced together and the wire
        self._weight_layout = FlatLayout.by_owner(
            [_storage(p).numel() * _storage(p).element_size() for p in params], self.owners, self.world_size
        )
        self._reduced = False
        broadcast_module(model, process_group)  # every replica starts from rank 0's weights

    @property
    def owned(self) -> list[nn.Parameter]:
        return [p for p, o in zip(self.params, self.owners) if o == self.rank]

    # -- step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_gradients(self) -> bool:
        """Reduce-scatter the gradients in FP8 (those `sent_in_bf16` names in BF16) to their owners
        (once per step): an owned parameter's ``.grad`` becomes the FP32 mean over ranks, the
        others' ``.grad`` None. Returns whether every reduced gradient is finite (the same answer
        on every rank)."""
        if self._reduced:
            return self._finite
        grads = [
            _local(p.grad) if p.grad is not None else torch.zeros(_local(p).shape, device=p.device) for p in self.params
        ]
        reduced = [
            self._reduce(grads, positions, in_bf16) for in_bf16, positions in split_by_wire(self.params, self._layer_of)
        ]
        for p in self.params:
            p.grad = None
        flags = []
        for positions, layout, shard in reduced:
            for s, a, b in layout.pieces(self.rank):
                p = self.params[positions[s]]
                p.grad = sharded_like(shard[a:b].view(_local(p).shape), p)
            flags.append(torch.isfinite(shard).all())
        flag = torch.stack(flags).all().float().reshape(1)  # on the gradients' device (NCCL)
        self._finite = bool(comm.all_reduce(flag, dist.ReduceOp.MIN, self.process_group)[0] > 0)
        self._reduced = True
        return self._finite

    def _reduce(self, grads: list[torch.Tensor], positions: list[int], bf16: bool) -> tuple:
        """The gradients at ``positions`` reduce-scattered to their owners, in BF16 or FP8:
        ``positions``, their by-owner layout and this rank's FP32 shard of the mean."""
        key = (tuple(positions), bf16)
        layout = self._grad_layouts.get(key)
        if layout is None:
            owners = [self.owners[i] for i in positions]
            layout = FlatLayout.by_owner([grads[i].numel() for i in positions], owners, self.world_size)
            self._grad_layouts[key] = layout
        parts = [grads[i] for i in positions]
        if bf16:
            reduction: BF16Reduction | FP8Reduction = BF16Reduction(parts, layout, self.process_group, average=True)
        else:
            reduction = FP8Reduction(parts, layout, self.process_group, average=True)
        return positions, layout, reduction.start().reduce()

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the reduced gradients by their global norm (computed across the shards); returns
        the norm before clipping. `fp8lm.clip_grad_norm_(optimizer, max_norm)` calls this."""
        self.reduce_gradients()
        owned = [p for p in self.owned if p.grad is not None]
        # each rank holds whole gradients of its own parameters: their norms add up over the group
        total = clip_grad_norm_(
            owned,
            max_norm,
            norm_type,
            error_if_nonfinite,
            group=self.norm_group or dist.group.WORLD,
            stage_size=self.norm_stage_size,
        )
        # Finite gradients whose squares overflow float32 too: clipping by 0 would apply a
        # momentum-only step; like every fp8lm clip, the step is skipped and counted.
        self._finite = self._finite and bool(torch.isfinite(total))  # the same answer on every rank
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        finite = self.reduce_gradients()
        self._reduced = False
        self.record_step(finite)
        if not finite:
            for p in self.params:
                p.grad = None
            return loss
        for mine, theirs in zip(self.param_groups, self.shard.param_groups):
            theirs.update({k: v for k, v in mine.items() if k != "params"})
        self.shard.step()
        self.broadcast_weights()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._reduced = False

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """All-gather the owners' weights as stored (FP8 payload bytes, or FP32) with their scales."""
        layout = self._weight_layout
        device = self.params[0].device  # collectives run on the weights' device (NCCL: the GPU)
        mine = torch.zeros(layout.chunk, dtype=torch.uint8, device=device)
        scales = torch.zeros(len(self.params), dtype=torch.float32, device=device)
        for s, a, b in layout.pieces(self.rank):
            p = self.params[s]
            mine[a:b] = _storage(p).reshape(-1).view(torch.uint8)
            if isinstance(_local(p), ScalingTensor):
                scales[s] = _local(p).scale
        gathered = torch.empty(layout.numel, dtype=torch.uint8, device=device)
        comm.all_gather(gathered, mine, self.process_group)
        # Only the owner's entry is non-zero: a MAX all-reduce hands every scale to every rank.
        comm.all_reduce(scales, dist.ReduceOp.MAX, self.process_group)
        for s, (p, off, n) in enumerate(zip(self.params, layout.offsets, layout.lengths)):
            if self.owners[s] == self.rank:
                continue
            _storage(p).reshape(-1).view(torch.uint8).copy_(gathered[off : off + n])
            if isinstance(_local(p), ScalingTensor):
                _local(p).scale.copy_(scales[s])

    # -- memory ----------------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Bytes of training state on this rank: ``weights`` (every parameter as stored),
        ``master_weights``, ``exp_avg``, ``exp_avg_sq`` (this rank's shard), ``scales``,
        ``gradients`` (held now), ``total``, ``num_params`` and ``bytes_per_param``."""
        out = dict.fromkeys(("weights", "master_weights", "exp_avg", "exp_avg_sq", "scales", "gradients"), 0)
        for p in self.params:
            out["weights"] += _nbytes(_storage(p))
            out["scales"] += 4 if isinstance(_local(p), ScalingTensor) else 0
            if p.grad is not None:
                g = _local(p.grad)
                out["gradients"] += _nbytes(_storage(g))
                out["scales"] += 4 if isinstance(g, ScalingTensor) else 0
        for state in self.shard.state.values():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                kind = {"master": "master_weights", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}.get(key)
                if kind is None:
                    kind = "scales" if key.endswith("_scale") else None
                if kind is None:
                    continue
                out[kind] += _nbytes(_storage(value))
        out["total"] = sum(out.values())
        out["num_params"] = sum(_local(p).numel() for p in self.params)  # this rank's parts under TP
        out["bytes_per_param"] = out["total"] / max(1, out["num_params"])
        return out

    # -- checkpoints -----------------------------------------------------------------------------
    def _shard_params(self) -> list[nn.Parameter]:
        return [p for g in self.shard.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """This rank's shard in the flat form of torch's ``get_state_dict`` (what
        `fp8lm.distributed.save_checkpoint` writes for every optimizer): ``state.<name>.<key>`` and
        ``param_groups.<name>.<option>`` for each tensor this rank owns, and ``skipped_steps`` (the
        same on every rank). All ranks' entries together are the whole state, loadable at any world
        size and by the same optimizer in one process."""
        name_of = dict(zip(map(id, self.params), self.names))
        params = self._shard_params()
        out: dict = {}
        for index, state in self.shard.state_dict()["state"].items():
            for key, value in state.items():
                out[f"state.{name_of[id(params[index])]}.{key}"] = value
        for group in self.param_groups:
            for p in group["params"]:
                if self._owner_of[id(p)] == self.rank:
                    out.update({f"param_groups.{name_of[id(p)]}.{k}": v for k, v in group.items() if k != "params"})
        out["skipped_steps"] = self.skipped_steps
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the entries of the tensors this rank owns from ``state_dict`` (`state_dict`'s form:
        the union of the shards saved at any world size, or one process's flat state; entries of
        tensors other ranks own are ignored) and the param groups' options."""
        known = set(self.names)
        states: dict[str, dict] = {}
        options: dict[str, dict] = {}
        for key, value in state_dict.items():
            if key == "skipped_steps":
                continue  # the optimizer's own count, set once the shard has loaded
            kind, _, entry = key.partition(".")
            name, _, field = entry.rpartition(".")
            if kind not in ("state", "param_groups") or name not in known:
                raise ValueError(f"checkpoint entry {key!r} names no parameter of this model: it is from another model")
            (states if kind == "state" else options).setdefault(name, {})[field] = value
        name_of = dict(zip(map(id, self.params), self.names))
        for group in self.param_groups:
            saved = next((options[name_of[id(p)]] for p in group["params"] if name_of[id(p)] in options), {})
            group.update({k: v for k, v in saved.items() if k in group})
        sd = self.shard.state_dict()
        sd["state"] = {
            i: states[name_of[id(p)]] for i, p in enumerate(self._shard_params()) if name_of[id(p)] in states
        }
        self.shard.load_state_dict(sd)
        if "skipped_steps" in state_dict:
            self.skipped_steps = int(state_dict["skipped_steps"])

    def param_named(self, name: str) -> nn.Parameter | None:
        """The parameter called ``name`` in the model (None if there is none)."""
        return dict(zip(self.names, self.params)).get(name)

    def owned_names(self) -> list[str]:
        """Names of the parameters whose optimizer state lives on this rank."""
        return [n for n, o in zip(self.names, self.owners) if o == self.rank]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
