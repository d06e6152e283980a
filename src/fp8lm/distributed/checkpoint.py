"""One checkpoint format for every layout: Distributed Checkpoint (DCP) folders.

`save_checkpoint` writes a model and its optimizer, laid out in any way (one process, data
parallel, FP8 ZeRO, FSDP2, tensor or pipeline parallel, their combinations), to one folder; every
rank calls it and writes what it alone holds (replicated entries are written once).
`load_checkpoint` reads it back into the same layout; `fp8lm.distributed.reshard` reads it as the
whole model's tensors and loads those into any other layout or world size.

What is saved, under the whole model's parameter names (torch's ``get_state_dict`` with flattened
optimizer state: ``state.<name>.<key>``, ``param_groups.<name>.<option>``): the parameters as
stored (a ScalingTensor keeps its payload and scale: an O2 FP16 weight is FP16 bytes), the
optimizer state (FP8 and FP16 moments, their scales), the optimizer's skipped-step count, each
FP8 weight's scale (``weight_scales``, so that loading requantizes exactly) and the row order of
chunked tensor-parallel layers (``row_chunks``). `FP8ZeroOptimizer` writes its shard in the same
flat form: each state entry lives on the rank that owns the tensor.

Reading trusts nothing in the folder (`fp8lm.distributed.dcp_reader`): only DCP's metadata
classes are unpickled, data files must lie inside the folder, non-tensor entries load with
``torch.load(weights_only=True)``, every tensor must be finite, and everything is read into
copies and checked before the model or the optimizer changes.

Not in it: the FP8 layers' delayed-scaling state (amax histories, one per rank and not part of the
model's state dict); save it per rank with `fp8lm.nn.scaling_state_dict` for a bit-exact resume,
as ``fp8lm train`` does.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_map_only

from ..optim import FP8Adam, FP8AdamW, SkipsNonFiniteSteps
from ..optim.sharded import agree_shard_scales, requantize_to
from ..optim.state import init_state
from ..tensor import ScalingTensor
from .dcp_reader import (
    CheckpointError,
    CheckpointReader,
    PlainDataLoadPlanner,
    alone_quietly,
    check_finite,
    is_tensor,
    read_dcp,
)
from .zero import FP8ZeroOptimizer

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "save_fsdp_checkpoint",
    "load_fsdp_checkpoint",
    "state_dicts",
    "set_state_dicts",
    "CheckpointError",
    "CheckpointReader",
    "PlainDataLoadPlanner",
    "check_finite",
    "read_dcp",
    "fill_state",
    "row_chunked",
    "weight_scales",
    "restore_weight_scales",
    "zero_state_like",
]

SKIPPED = "skipped_steps"  # the optimizer's own counter, which get_state_dict leaves out
# Param groups flattened to one entry per parameter name: ranks that hold different parameters
# (pipeline stages, ZeRO owners) would otherwise write different values under one key, and DCP keeps one.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts in the checkpoint's form (the live tensors, not
    copies): flat optimizer keys by parameter name, with the skipped-step count."""
    if isinstance(optimizer, FP8ZeroOptimizer):
        return model.state_dict(), optimizer.state_dict()
    fill_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    optim_state[SKIPPED] = getattr(optimizer, SKIPPED, 0)
    return model_state, optim_state


def set_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Load what `state_dicts` returned (this rank's entries) into ``model`` and ``optimizer``."""
    optim_state = dict(optim_state)
    skipped = int(optim_state.pop(SKIPPED, 0) or 0)
    if isinstance(optimizer, FP8ZeroOptimizer):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=OPTIONS)
    if isinstance(optimizer, SkipsNonFiniteSteps):
        optimizer.skipped_steps = skipped


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``model`` and ``optimizer``, laid out in any way, to the folder ``path``; every rank
    calls it (in one process: a folder of one rank)."""
    model_state, optim_state = state_dicts(model, optimizer)
    _agree_weight_scales(model)  # after get_state_dict, whose zero step (torch's optimizers) requantizes
    # which rows a chunked tensor-parallel layer ordered rank by rank (fp8lm.distributed.reshard)
    chunked = {name: f"{chunks},{tp}" for name, (chunks, tp) in row_chunked(model).items()}
    state = {"model": model_state, "optim": optim_state, "row_chunks": chunked, "weight_scales": weight_scales(model)}
    with alone_quietly():
        dcp.save(state, checkpoint_id=os.fspath(path), no_dist=not torch.distributed.is_initialized())
    if isinstance(optimizer, (FP8Adam, FP8AdamW)):
        optimizer.forget_amaxes()  # the next step as a run resumed from here takes it
    elif isinstance(optimizer, FP8ZeroOptimizer) and isinstance(optimizer.shard, (FP8Adam, FP8AdamW)):
        optimizer.shard.forget_amaxes()


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a `save_checkpoint` folder into ``model`` and ``optimizer`` laid out as when it was
    saved (DTensor shards may be at another world size: DCP re-shards by offsets; for any other
    change use `fp8lm.distributed.reshard`); every rank calls it. Raises `CheckpointError` for
    untrusted or non-finite content before anything changes."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint folder at {path!r}; pass the folder save_checkpoint wrote")
    if isinstance(optimizer, FP8ZeroOptimizer):
        state = _zero_targets(path, model, optimizer)
    else:
        model_state, optim_state = state_dicts(model, optimizer)
        live = {"model": model_state, "optim": optim_state, "weight_scales": weight_scales(model)}
        # Copies: DCP reads in place, and these state dicts hold the live parameters and state.
        state = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), live)
    read_dcp(state, path, PlainDataLoadPlanner(), coordinated=torch.distributed.is_initialized())
    check_finite(_local_tensors(state), path)
    set_state_dicts(model, optimizer, state["model"], state["optim"])
    restore_weight_scales(model, state["weight_scales"])


# The names a checkpoint of FSDP2 training was first saved under.
save_fsdp_checkpoint = save_checkpoint
load_fsdp_checkpoint = load_checkpoint


def _zero_targets(path: str, model: nn.Module, optimizer: FP8ZeroOptimizer) -> dict:
    """What an FP8 ZeRO rank reads: the whole model, and the optimizer entries of the tensors it
    owns, shaped as the folder's metadata says (its shards may have been saved at another
    partition)."""
    metadata = CheckpointReader(path).read_metadata().state_dict_metadata
    state: dict = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}, "optim": {}}
    state["weight_scales"] = {k: v.clone() for k, v in weight_scales(model).items()}
    missing = [k for k in state["model"] if f"model.{k}" not in metadata]
    if missing:
        raise CheckpointError(f"checkpoint {path!r} lacks model entries {missing[:3]}: it is from another model")
    owned = set(optimizer.owned_names())
    for key, meta in metadata.items():
        part, _, entry = key.partition(".")
        kind, _, rest = entry.partition(".")
        name = rest.rpartition(".")[0]
        if part == "optim" and (entry == SKIPPED or (kind in ("state", "param_groups") and name in owned)):
            value = torch.empty(meta.size, dtype=meta.properties.dtype) if is_tensor(meta) else None
            state["optim"][entry] = zero_state_like(optimizer, entry, value)
    return state


def zero_state_like(optimizer: FP8ZeroOptimizer, key: str, value):
    """Entry ``key`` (``state.<name>.<field>``) of FP8 ZeRO's state as this rank holds it: a whole
    tensor of a tensor-parallel DTensor parameter's shape as that DTensor's local part; any other
    value as it is."""
    p = optimizer.param_named(key.partition(".")[2].rpartition(".")[0]) if key.startswith("state.") else None
    if not isinstance(p, DTensor) or not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape):
        return value
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = value[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(p.device).contiguous()
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


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
