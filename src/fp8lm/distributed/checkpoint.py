"""Sharded checkpoints of FP8 ZeRO training with `torch.distributed.checkpoint` (DCP).

The model's state dict (plain dequantized tensors, the same on every rank) is written once; each
rank writes the optimizer state of the tensors it owns, keyed by parameter name. Loading reads
each rank's entries by name, so a checkpoint saved on N ranks loads on M: the new partition
simply picks other names.

Loading trusts nothing in the folder. DCP's ``.metadata`` file is a pickle: `CheckpointReader`
reads it with an unpickler that builds only DCP's metadata classes, and refuses data files named
outside the folder. Every entry loaded must be a tensor (DCP would read other entries with a
plain pickle) and finite.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from .zero import FP8ZeroOptimizer

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointReader", "CheckpointError", "check_finite"]

_MODEL, _OPTIM = "model.", "optim."

# Everything the .metadata pickle of a DCP checkpoint holds besides builtin containers and dtypes.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("torch.serialization", "_get_layout"),
}


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, untrusted, or does not fit the run."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in _METADATA_GLOBALS and not is_dtype:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")
        return super().find_class(module, name)


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file reader, made unable to run code or read outside its folder: the metadata pickle
    may only build DCP's metadata classes, and every data file must lie inside the folder
    (symlinks resolved). Violations raise `CheckpointError`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except Exception as e:  # any malformed or hostile pickle
            raise CheckpointError(f"cannot read sharded checkpoint metadata {str(path)!r}: {_first_line(e)}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{str(path)!r} is not DCP checkpoint metadata but a {type(metadata).__name__}")
        metadata.storage_meta = StorageMeta(load_id=self.load_id)  # as DCP's own reader does
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        root = Path(self.path).resolve()
        for info in (metadata.storage_data or {}).values():
            target = (root / info.relative_path).resolve()
            if target == root or not target.is_relative_to(root):
                raise CheckpointError(
                    f"sharded checkpoint {str(root)!r} names the data file {str(info.relative_path)!r} outside its "
                    "folder: fp8lm did not write it; resume from another checkpoint"
                )
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: FP8ZeroOptimizer) -> None:
    """Write ``model`` and every rank's optimizer shard to the directory ``path`` (all ranks call it)."""
    _check(optimizer)
    state = {_MODEL + k: v for k, v in model.state_dict().items()}
    state.update({_OPTIM + k: v for k, v in optimizer.state_dict().items()})
    dcp.save(state, checkpoint_id=os.fspath(path))


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: FP8ZeroOptimizer) -> None:
    """Load a `save_checkpoint` directory written at any world size (all ranks call it). Raises
    `CheckpointError` for untrusted content (see the module docstring) or inf/NaN values, before
    the model or the optimizer changes."""
    _check(optimizer)
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path!r}")
    metadata = CheckpointReader(path).read_metadata().state_dict_metadata
    owned = set(optimizer.owned_names())
    # Fresh buffers: DCP reads in place, and plain parameters' state_dict entries are the parameters.
    state = {_MODEL + k: torch.empty_like(v) for k, v in model.state_dict().items()}
    missing = [k for k in state if k not in metadata]
    if missing:
        raise ValueError(f"checkpoint at {path!r} lacks model entries {missing[:5]}: it is from another model")
    for key, meta in metadata.items():
        owner = key[len(_OPTIM) :].rpartition("/")[0]  # "": the optimizer's own entries (skipped_steps)
        if key.startswith(_OPTIM) and (owner in owned or not owner):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if _is_tensor(meta) else None
    not_tensors = [k for k in state if not _is_tensor(metadata[k])]
    if not_tensors:
        raise CheckpointError(
            f"sharded checkpoint {path!r} stores {not_tensors[0]!r} as pickled bytes, not a tensor: fp8lm did "
            "not write it; resume from another checkpoint"
        )
    _read(state, path)
    check_finite(state, path)
    model.load_state_dict({k[len(_MODEL) :]: v for k, v in state.items() if k.startswith(_MODEL)})
    optimizer.load_state_dict({k[len(_OPTIM) :]: v for k, v in state.items() if k.startswith(_OPTIM)})


def check_finite(tensors: dict, where: str) -> None:
    """Refuse (`CheckpointError`) a checkpoint whose floating-point tensors hold inf or NaN: loaded,
    every later step would be skipped. ``tensors`` maps names to values; non-tensors are ignored."""
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            wide = value.float() if value.element_size() == 1 else value  # isfinite has no float8 kernel
            if not bool(torch.isfinite(wide).all()):
                raise CheckpointError(
                    f"checkpoint {where!r} holds inf or NaN in {name!r}; it cannot resume training: "
                    "resume from an older checkpoint"
                )


def _read(state: dict, path: str) -> None:
    """``dcp.load`` into ``state``, raising a `CheckpointError` of any rank as itself (DCP wraps
    every rank's failure in one multi-line CheckpointException)."""
    try:
        dcp.load(state, storage_reader=CheckpointReader(path))
    except CheckpointException as e:
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


def _is_tensor(meta) -> bool:
    return isinstance(meta, TensorStorageMetadata)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _check(optimizer) -> None:
    if not isinstance(optimizer, FP8ZeroOptimizer):
        raise TypeError(
            f"sharded checkpoints are for FP8ZeroOptimizer (opt_level O3), got {type(optimizer).__name__}; "
            "save other levels with the model's and optimizer's own state_dict()"
        )
