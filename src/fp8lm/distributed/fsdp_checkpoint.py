"""Distributed Checkpoint of FSDP2 training: the model and its optimizer through
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``, written and read
by ``torch.distributed.checkpoint`` (DCP).

What is saved: the model's sharded parameters as stored (a ScalingTensor shard keeps its payload
and scale: an O2 FP16 weight is written as FP16 bytes) and the optimizer's state (the FP8 and FP16
moment shards as DTensors, their scales, one per tensor, once), its param groups, step counts and
skipped-step counter. Each rank writes its own shards; a checkpoint saved at N ranks loads at M
(DCP re-shards by offsets), also into an unsharded model in one process. That needs one scale per
ScalingTensor weight on all ranks: FP8AdamW keeps it so, and saving requantizes the shards that
torch's optimizers (O1) left with their own scale to the smallest (one rounding).

Reading trusts nothing in the folder: the metadata goes through `CheckpointReader` (it builds
only DCP's metadata classes and reads data files inside the folder only); the non-tensor entries
(param groups, steps) are read with ``torch.load(weights_only=True)`` instead of DCP's plain
pickle; every tensor loaded must be finite; and everything is read into copies and checked before
the model or the optimizer changes.

Not in it: the FP8 layers' delayed-scaling state (amax histories, one per rank and not part of the
model's state dict); save it per rank with `fp8lm.nn.scaling_state_dict` for a bit-exact resume,
as ``fp8lm train`` does.
"""

from __future__ import annotations

import io
import os
from collections import defaultdict

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ..optim import FP8Adam, FP8AdamW, SkipsNonFiniteSteps
from ..optim.sharded import agree_shard_scales, requantize_to
from ..optim.state import init_state
from ..tensor import ScalingTensor
from .checkpoint import CheckpointError, CheckpointReader, check_finite

__all__ = [
    "save_fsdp_checkpoint",
    "load_fsdp_checkpoint",
    "PlainDataLoadPlanner",
    "fill_state",
    "read_dcp",
    "row_chunked",
    "weight_scales",
    "restore_weight_scales",
]

_SKIPPED = "skipped_steps"  # the optimizer's own counter, which get_state_dict leaves out
# Param groups flattened to one entry per parameter name: ranks that hold different parameters
# (pipeline stages) would otherwise write different values under one key, and DCP keeps one.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``: plain
    numbers, strings and containers load; anything that would run code raises `CheckpointError`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # a hostile pickle, or bytes torch cannot read at all
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(
                f"sharded checkpoint entry {name!r} is not plain data ({first}): fp8lm did not write it; resume "
                "from another checkpoint"
            ) from None
        plain = io.BytesIO()
        torch.save(obj, plain)  # DCP's own loader then reads back only what was just checked
        plain.seek(0)
        super().load_bytes(read_item, plain)


def save_fsdp_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``model`` and ``optimizer`` (sharded by FSDP2, or not) to the folder ``path``; every
    rank calls it."""
    fill_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)  # the live tensors, not copies
    _agree_weight_scales(model)  # after get_state_dict, whose zero step (torch's optimizers) requantizes
    optim_state[_SKIPPED] = getattr(optimizer, _SKIPPED, 0)
    # which rows a chunked tensor-parallel layer ordered rank by rank (fp8lm.distributed.reshard)
    chunked = {name: f"{chunks},{tp}" for name, (chunks, tp) in row_chunked(model).items()}
    state = {"model": model_state, "optim": optim_state, "row_chunks": chunked, "weight_scales": weight_scales(model)}
    dcp.save(state, checkpoint_id=os.fspath(path))
    if isinstance(optimizer, (FP8Adam, FP8AdamW)):
        optimizer.forget_amaxes()  # the next step as a run resumed from here takes it


def load_fsdp_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a `save_fsdp_checkpoint` folder, saved at any world size, into ``model`` and
    ``optimizer`` as they are laid out now; every rank calls it. Raises `CheckpointError` for
    untrusted or non-finite content (see the module docstring) before anything changes."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint folder at {path!r}; pass the folder save_fsdp_checkpoint wrote")
    fill_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    optim_state[_SKIPPED] = 0
    # Copies: DCP reads in place, and these state dicts hold the live parameters and state.
    live = {"model": model_state, "optim": optim_state, "weight_scales": weight_scales(model)}
    state = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), live)
    read_dcp(state, path, PlainDataLoadPlanner())
    check_finite(_local_tensors(state), path)
    skipped = int(state["optim"].pop(_SKIPPED))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS)
    restore_weight_scales(model, state["weight_scales"])
    if isinstance(optimizer, SkipsNonFiniteSteps):
        optimizer.skipped_steps = skipped


def read_dcp(state: dict, path: str, planner: DefaultLoadPlanner, coordinated: bool = True) -> None:
    """``dcp.load`` of ``state`` from ``path`` through the trusting-nothing reader, raising a
    `CheckpointError` of any rank as itself (DCP wraps every rank's failure in one multi-line
    exception). ``coordinated=False``: this rank reads alone (no collective)."""
    try:
        dcp.load(state, storage_reader=CheckpointReader(path), planner=planner, no_dist=not coordinated)
    except CheckpointException as e:
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


def weight_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """The scale of every weight stored as a ScalingTensor (one per tensor, its shards agreed), by
    parameter name: loading the dequantized values alone would pick each shard's scale from its
    own amax, and the optimizer's next roundings would differ from the run's."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(local, ScalingTensor):
            out[name] = local.scale.detach().reshape(())
    return out


@torch.no_grad()
def restore_weight_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Requantize each ScalingTensor weight (this rank's shard) to its saved scale: exact, the
    values were stored at that scale."""
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(local, ScalingTensor) and name in scales:
            requantize_to(local.payload, local.scale, scales[name].reshape(local.scale.shape))


def row_chunked(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> (chunks, tensor-parallel size) of rows ordered rank by rank."""
    out = {}
    for prefix, module in model.named_modules():
        for name, spec in getattr(module, "row_chunks", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = tuple(spec)
    return out


def fill_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of an fp8lm optimizer its (zero) state, so that ``get_state_dict`` need
    not take its zero-gradient step, which would requantize the weights."""
    if not isinstance(optimizer, (FP8Adam, FP8AdamW)):  # torch's optimizers: that step changes nothing
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                init_state(optimizer.state[p], p, group)


@torch.no_grad()
def _agree_weight_scales(model: nn.Module) -> None:
    """One scale per sharded ScalingTensor weight, so that the checkpoint re-shards at any world
    size: FP8AdamW keeps them agreed; torch's optimizers (O1) leave each shard its own, and the
    shards with a finer one are requantized to the smallest (one rounding)."""
    by_mesh: dict = defaultdict(list)
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else None
        if isinstance(local, ScalingTensor):
            by_mesh[p.device_mesh].append((local.payload, local.scale))
    for mesh, shards in by_mesh.items():
        agree_shard_scales(shards, mesh)


def _local_tensors(tree, prefix: str = "") -> dict:
    """This rank's part of every tensor in nested dicts and lists, by dotted name."""
    if isinstance(tree, DTensor):
        return {prefix: tree.to_local()}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    out = {prefix: tree} if isinstance(tree, torch.Tensor) else {}
    for key, value in items:
        out.update(_local_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out
