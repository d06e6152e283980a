"""Resuming a run in another layout or at another world size (``--resume`` after a change of
``--tp``/``--pp``/``--fsdp`` or of torchrun's rank count): what changes, and the restore.

The weights and optimizer state are read as the whole model's (`fp8lm.distributed.reshard`) and
loaded into this run's layout (FP8 ZeRO's too: each rank takes the state of the tensors it owns).
Per-rank state follows the model, not the rank: each layer's FP8 scaling history comes
from a rank that held it; each data-parallel replica continues its batch stream when the number
of replicas is the same, and starts a new deterministic one (seeded by the replica and the step)
when it is not; the RNG is rank 0's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..distributed.mesh import ParallelDims
from ..distributed.reshard import load_full_state, read_full_state
from .checkpoint import CheckpointError
from .ranks import Ranks

__all__ = ["Reshard", "plan_reshard", "full_state_from_file", "merged_scaling", "load_resharded", "NEW_STREAM"]

NEW_STREAM = 1_000_003  # a replica's new batch stream: seed + replica + NEW_STREAM x step


@dataclass(frozen=True)
class Reshard:
    """A checkpoint written by ``saved`` (its dims) resumed on ``here``."""

    saved: ParallelDims
    here: ParallelDims
    saved_fsdp: bool

    @property
    def same_batches(self) -> bool:
        """Whether each replica continues its own batch stream (as many replicas as before)."""
        return self.saved.dp == self.here.dp

    def describe(self) -> str:
        stream = "each replica continues its batches" if self.same_batches else "new batch streams"
        saved, here = self.saved, self.here
        return f"{saved.describe()} on {saved.world} rank(s) -> {here.describe()} on {here.world} rank(s); {stream}"


def saved_dims(state: dict) -> tuple[ParallelDims, bool]:
    """The dims of the run that wrote checkpoint ``state`` and whether it used FSDP2."""
    layout = state.get("layout") or {"tp": 1, "pp": 1, "fsdp": False}
    world = len(state["ranks"])
    shard = bool(layout["fsdp"]) or state.get("opt_level") == "O3"
    return ParallelDims.for_world(world, tp=layout["tp"], pp=layout["pp"], shard=shard), bool(layout["fsdp"])


def plan_reshard(state: dict, ranks: Ranks) -> Reshard | None:
    """None when ``ranks`` continue the checkpoint's layout as it was (the same split, and its
    state where this layout keeps it: a shard folder under torchrun, the file in one process);
    else the `Reshard`."""
    saved, fsdp = saved_dims(state)
    sharded = state.get("optimizer_shards") is not None
    if saved == ranks.dims and sharded == ranks.distributed:
        return None
    return Reshard(saved, ranks.dims, fsdp)


def full_state_from_file(state: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A checkpoint file's full weights and optimizer state (one process, data parallel) in
    `read_full_state`'s form: the optimizer's entries by parameter name. ``model`` and
    ``optimizer``: a plain model and the optimizer built over it as the run builds them, whose
    parameter order names the file's."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = state["optimizer"]
    flat: dict = {"skipped_steps": saved.get("skipped_steps", 0)}
    for index, entries in saved["state"].items():
        for key, value in entries.items():
            flat[f"state.{order[int(index)]}.{key}"] = value
    for group in saved["param_groups"]:
        for index in group["params"]:
            for key, value in group.items():
                if key != "params":
                    flat[f"param_groups.{order[int(index)]}.{key}"] = value
    return {"model": dict(state["model"]), "optim": flat}


def merged_scaling(every_rank: list[dict], model: nn.Module, own: dict) -> dict:
    """FP8 scaling state for this rank's ``model`` (whose own current state is ``own``): each
    layer's from the first saved rank that held it."""
    merged: dict = {}
    for saved in every_rank:
        for key, value in saved["scaling"].items():
            merged.setdefault(key, value)
    missing = sorted(own.keys() - merged.keys())
    if missing:
        raise CheckpointError(f"the checkpoint holds no FP8 scaling state for {missing[:3]}: it is from another model")
    return {key: merged[key] for key in own}


def load_resharded(directory: Path, state: dict, model: nn.Module, optimizer, full_from_file) -> None:
    """Weights and optimizer state of a checkpoint of another layout into this run's: from its
    shard folder, or (no shards: one process, data parallel) from the file via ``full_from_file()``."""
    shards = state.get("optimizer_shards")
    full = read_full_state(directory / shards) if shards else full_from_file()
    load_full_state(model, optimizer, full)
