"""Resharding a Distributed Checkpoint: read a `save_checkpoint` folder written in any layout
(data parallel, FP8 ZeRO, FSDP2, tensor or pipeline parallel, their combinations, any world
size, one process) as the whole
model's full tensors, and load those into a model and optimizer laid out in any other way.

A checkpoint holds every tensor under the parameter names of the whole model, so the full state
is the union of what the ranks wrote, read back by DCP from the offsets in its metadata. One
thing does not follow from the offsets: a column-wise tensor-parallel layer that shards fused
blocks (``chunks`` of `FP8ColwiseParallel`: q, k and v in one weight) orders its rows rank by
rank, and the checkpoint records that (``row_chunks.<name>``: chunks and tensor-parallel size),
so reading restores the model's row order and loading makes the target's. Everything read goes
through the same trust checks as `load_checkpoint`.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .checkpoint import SKIPPED, restore_weight_scales, row_chunked, set_state_dicts, state_dicts, zero_state_like
from .dcp_reader import CheckpointError, CheckpointReader, PlainDataLoadPlanner, check_finite, is_tensor, read_dcp
from .zero import FP8ZeroOptimizer

__all__ = ["read_full_state", "read_full_weights", "load_full_state", "row_chunked", "ROW_CHUNKS"]

ROW_CHUNKS = "row_chunks."  # checkpoint entries: parameter name -> (chunks, tensor-parallel size)


def rows_to_model_order(t: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    """Rows saved rank by rank (each rank's slice of each of ``chunks`` blocks) in the model's order."""
    rest = t.shape[1:]
    return t.reshape(tp, chunks, t.shape[0] // (tp * chunks), *rest).transpose(0, 1).reshape(t.shape)


def rows_to_rank_order(t: torch.Tensor, chunks: int, tp: int) -> torch.Tensor:
    """The inverse of `rows_to_model_order`."""
    rest = t.shape[1:]
    return t.reshape(chunks, tp, t.shape[0] // (tp * chunks), *rest).transpose(0, 1).reshape(t.shape)


def read_full_state(path: str | os.PathLike) -> dict:
    """The checkpoint folder ``path`` as ``{"model": {name: tensor}, "optim": {flat key: value}}``
    with whole tensors in the model's row order (every rank may call it; each reads it all)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint folder at {path!r}")
    metadata = CheckpointReader(path).read_metadata().state_dict_metadata
    state: dict = {}
    for key, meta in metadata.items():
        state[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if is_tensor(meta) else None
    read_dcp(state, path, planner=PlainDataLoadPlanner(), coordinated=False)
    check_finite(state, path)
    chunked = {
        k[len(ROW_CHUNKS) :]: tuple(map(int, v.split(","))) for k, v in state.items() if k.startswith(ROW_CHUNKS)
    }
    full: dict = {"model": {}, "optim": {}, "weight_scales": {}}
    for key, value in state.items():
        part, _, name = key.partition(".")
        if part in full:
            full[part][name] = value
    for name, (chunks, tp) in chunked.items():
        _reorder(full, name, lambda t, c=chunks, n=tp: rows_to_model_order(t, c, n))
    return full


def read_full_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model's weights of checkpoint folder ``path`` (any layout), by parameter name, in
    the model's row order: what ``--init-from``, a DPO reference and an export start from."""
    return read_full_state(path)["model"]


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, full: dict) -> None:
    """Load `read_full_state` output into ``model`` and ``optimizer`` as they are laid out now
    (DTensor shards: each rank takes its part of every full tensor; a pipeline stage: the names
    it holds; FP8 ZeRO: the state of the tensors this rank owns). Everything is checked before
    anything changes."""
    full = {"model": dict(full["model"]), "optim": dict(full["optim"]), "weight_scales": full.get("weight_scales", {})}
    for name, (chunks, tp) in row_chunked(model).items():
        _reorder(full, name, lambda t, c=chunks, n=tp: rows_to_rank_order(t, c, n))
    target_model, target_optim = state_dicts(model, optimizer)
    target_optim.pop(SKIPPED, None)
    if isinstance(optimizer, FP8ZeroOptimizer):
        # the entries of the tensors this rank owns (its state is empty before the first step)
        owned = set(optimizer.owned_names())
        target_optim = {k: v for k, v in full["optim"].items() if k.split(".")[0] in ("state", "param_groups")}
        target_optim = {k: v for k, v in target_optim.items() if k.partition(".")[2].rpartition(".")[0] in owned}
        _require_state(owned, target_optim)
        target_optim = {k: zero_state_like(optimizer, k, v) for k, v in target_optim.items()}
    local = {
        "model": _local_parts(target_model, full["model"]),
        "optim": _local_parts(target_optim, full["optim"]),
    }
    local["optim"][SKIPPED] = full["optim"].get(SKIPPED, 0)
    set_state_dicts(model, optimizer, local["model"], local["optim"])
    restore_weight_scales(model, full["weight_scales"])


def _require_state(owned: set[str], entries: dict) -> None:
    """Refuse a full state without optimizer state for a tensor this rank owns (another model)."""
    have = {k.partition(".")[2].rpartition(".")[0] for k in entries if k.startswith("state.")}
    missing = sorted(owned - have)
    if missing:
        raise CheckpointError(f"the checkpoint holds no optimizer state for {missing[:3]}: it is from another model")


def _local_parts(target: dict, full: dict) -> dict:
    """For each entry of ``target`` (this rank's state dict), this rank's part of ``full``'s."""
    missing = sorted(target.keys() - full.keys())
    if missing:
        raise CheckpointError(f"the checkpoint lacks {missing[:3]}: it is from another model or optimizer")
    out = {}
    for key, want in target.items():
        value = full[key]
        if isinstance(want, torch.Tensor) != isinstance(value, torch.Tensor) or (
            isinstance(want, torch.Tensor) and tuple(want.shape) != tuple(value.shape)
        ):
            raise CheckpointError(f"checkpoint entry {key!r} does not fit this model: it is from another one")
        out[key] = _local_part(value, want) if isinstance(want, DTensor) else value
    return out


def _local_part(full: torch.Tensor, like: DTensor) -> DTensor:
    """``full`` laid out as ``like`` (its mesh and placements): this rank's slice of it."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    local = full[index].to(like.to_local().device).contiguous() if full.dim() else full
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=full.shape, stride=like.stride()
    )


def _reorder(full: dict, name: str, fn) -> None:
    """Apply ``fn`` to parameter ``name``'s tensor and to its optimizer states of the same shape."""
    weight = full["model"].get(name)
    if weight is None:
        return
    full["model"][name] = fn(weight)
    prefix = f"state.{name}."
    for key, value in full["optim"].items():
        if key.startswith(prefix) and isinstance(value, torch.Tensor) and value.shape == weight.shape:
            full["optim"][key] = fn(value)
