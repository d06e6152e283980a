"""FP8AdamW over DTensor shards (FSDP2's parameters): one scale per tensor on every rank.

Each rank steps its own shards with the fused step; what has to be equal everywhere is agreed by
two small reductions over each parameter mesh (`mesh_reduce`: DTensor's collectives, 4 floats per
tensor before the step and 4 after: 3 scales and whether the step was applied):

- before the step, the amaxes of the stored weight, moments and gradient, MAX over the mesh: every
  rank sees an inf or NaN of any shard (all then skip the step, as one process would), and the
  step's scales are chosen from the whole tensors' amaxes;
- after the step, each new scale, MIN over the mesh. The MIN is the scale one process picks for
  the whole tensor (the bounds grow with the gradient's amax, the one amax the fused step measures
  on its own shard), and a rank whose shard chose a finer scale requantizes to it: a power-of-two
  ratio, so at most one more rounding, within one unit in the last place of the stored format.

A sharded state tensor so has one scale, a plain tensor equal on all ranks: Distributed
Checkpoint saves it once and can re-shard the payloads at any world size.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..formats import format_of
from ..ops.cast import saturating_cast
from .dtensor import local_tensor, mesh_reduce
from .functional import amax_bounds
from .fused import stored_amaxes
from .slots import AdamSlot, ParamSlot

__all__ = ["ShardedParam", "agree_amaxes", "agree_scales", "agree_shard_scales", "requantize_to"]


@dataclass
class ShardedParam:
    """A DTensor parameter in a step: its state, this step's `adam_hyperparams` and ratio bound,
    and its slot (None where this rank's shard is empty)."""

    param: DTensor
    state: dict
    slot: AdamSlot | None
    hyperparams: torch.Tensor
    max_ratio: float

    def scaled_state(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """``(payload, scale)`` of this rank's weight (None for a plain one), first and second moment."""
        w_payload, w_scale, w_scaled = ParamSlot.weight_source(self.param, self.state)
        weight = (w_payload, w_scale) if w_scaled else None
        return [
            weight,
            (local_tensor(self.state["exp_avg"]), self.state["exp_avg_scale"]),
            (local_tensor(self.state["exp_avg_sq"]), self.state["exp_avg_sq_scale"]),
        ]

    def local_amaxes(self) -> torch.Tensor:
        """The amaxes of this rank's stored w, m, v and its gradient, dequantized (4,); zeros when empty."""
        slot = self.slot
        if slot is None:
            return torch.zeros(4)
        known = [*slot.stored, None]
        payloads = slot.step_payloads()
        missing = [i for i, a in enumerate(known) if a is None]
        payload_amaxes = torch.tensor([0.0 if a is None else a for a in known])
        payload_amaxes[missing] = stored_amaxes([payloads[i] for i in missing]).cpu()
        scales = torch.stack([s.float().cpu() for s in slot.step_scales()])
        return payload_amaxes / scales


def _by_mesh(params: list[ShardedParam]) -> dict:
    groups: dict = defaultdict(list)
    for entry in params:
        groups[entry.param.device_mesh].append(entry)
    return groups


def agree_amaxes(params: list[ShardedParam]) -> bool:
    """Give every slot the amaxes of the whole tensors (MAX over the mesh) as its stored amaxes;
    returns False when an amax, or a bound the step derives from them, is not finite: every rank
    then skips the step."""
    finite = True
    for mesh, group in _by_mesh(params).items():
        local = torch.stack([e.local_amaxes() for e in group]).nan_to_num(nan=math.inf)
        whole = mesh_reduce(local, mesh, "max")
        hyperparams = torch.stack([e.hyperparams.cpu() for e in group])
        bounds = amax_bounds(whole, hyperparams, torch.tensor([e.max_ratio for e in group]))
        finite = finite and bool(torch.isfinite(torch.cat([whole.view(-1), bounds[:, 1:].reshape(-1)])).all())
        for e, row in zip(group, whole):
            if e.slot is not None:
                scales = torch.stack([s.float().cpu() for s in e.slot.step_scales()[:3]])
                a_w, a_m, a_v = (row[:3] * scales).tolist()
                e.slot.stored = (a_w, a_m, a_v)
    return finite


def agree_scales(params: list[ShardedParam], applied: bool) -> None:
    """After a step on every rank (``applied``: whether it was applied here), give each stored tensor
    the smallest of its shards' new scales, requantizing the shards that chose another one."""
    for mesh, group in _by_mesh(params).items():
        local = torch.full((len(group), 4), math.inf)
        for i, e in enumerate(group):
            local[i, 3] = float(applied)
            if e.slot is not None:
                for j, pair in enumerate(e.scaled_state()):
                    if pair is not None:
                        local[i, j] = pair[1].float().cpu()
        agreed = mesh_reduce(local, mesh, "min")
        if applied and not bool((agreed[:, 3] == 1).all()):
            raise RuntimeError(
                "FP8AdamW: another rank skipped a step that this rank applied (a bound overflowed on one shard "
                "only, e.g. with eps=0); the shards now disagree: resume from the last checkpoint with eps > 0"
            )
        if not applied:
            continue
        for e, row in zip(group, agreed):
            for pair, scale in zip(e.scaled_state(), row[:3]):
                if pair is not None:
                    payload, own = pair
                    requantize_to(payload, own, scale)


def agree_shard_scales(shards: list[tuple[torch.Tensor, torch.Tensor]], mesh) -> None:
    """Give this rank's ``(payload, scale)`` shards of tensors sharded over ``mesh`` the smallest
    scale of each tensor's shards (an empty shard has none), requantizing those that differ."""
    local = torch.tensor([float(scale) if payload.numel() else math.inf for payload, scale in shards])
    for (payload, scale), agreed in zip(shards, mesh_reduce(local, mesh, "min")):
        requantize_to(payload, scale, agreed)


@torch.no_grad()
def requantize_to(payload: torch.Tensor, scale: torch.Tensor, agreed: torch.Tensor) -> None:
    """Store ``payload / scale`` with scale ``agreed`` (a power of two no larger than ``scale``)."""
    agreed = agreed.to(scale.device, torch.float32)
    if bool(scale == agreed):
        return
    if payload.numel():
        payload.copy_(saturating_cast(payload.float(), agreed / scale, format_of(payload.dtype)))
    scale.copy_(agreed)
