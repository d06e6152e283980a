"""Sharded checkpoints of FP8 ZeRO training with `torch.distributed.checkpoint` (DCP).

The model's state dict (plain dequantized tensors, the same on every rank) is written once; each
rank writes the optimizer state of the tensors it owns, keyed by parameter name. Loading reads
each rank's entries by name, so a checkpoint saved on N ranks loads on M: the new partition
simply picks other names.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from .zero import FP8ZeroOptimizer

__all__ = ["save_checkpoint", "load_checkpoint"]

_MODEL, _OPTIM = "model.", "optim."


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: FP8ZeroOptimizer) -> None:
    """Write ``model`` and every rank's optimizer shard to the directory ``path`` (all ranks call it)."""
    _check(optimizer)
    state = {_MODEL + k: v for k, v in model.state_dict().items()}
    state.update({_OPTIM + k: v for k, v in optimizer.state_dict().items()})
    dcp.save(state, checkpoint_id=os.fspath(path))


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: FP8ZeroOptimizer) -> None:
    """Load a `save_checkpoint` directory written at any world size (all ranks call it)."""
    _check(optimizer)
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path!r}")
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    owned = set(optimizer.owned_names())
    state = {_MODEL + k: v for k, v in model.state_dict().items()}
    missing = [k for k in state if k not in metadata]
    if missing:
        raise ValueError(f"checkpoint at {path!r} lacks model entries {missing[:5]}: it is from another model")
    for key, meta in metadata.items():
        owner = key[len(_OPTIM):].rpartition("/")[0]  # "": the optimizer's own entries (skipped_steps)
        if key.startswith(_OPTIM) and (owner in owned or not owner):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict({k[len(_MODEL):]: v for k, v in state.items() if k.startswith(_MODEL)})
    optimizer.load_state_dict({k[len(_OPTIM):]: v for k, v in state.items() if k.startswith(_OPTIM)})


def _check(optimizer) -> None:
    if not isinstance(optimizer, FP8ZeroOptimizer):
        raise TypeError(
            f"sharded checkpoints are for FP8ZeroOptimizer (opt_level O3), got {type(optimizer).__name__}; "
            "save other levels with the model's and optimizer's own state_dict()"
        )
