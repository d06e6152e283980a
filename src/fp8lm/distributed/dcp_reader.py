"""Reading a Distributed Checkpoint folder while trusting nothing in it.

DCP's ``.metadata`` file is a pickle: `CheckpointReader` reads it with an unpickler that builds
only DCP's metadata classes, and refuses data files named outside the folder (symlinks resolved).
Non-tensor entries (param groups, counters) are read by `PlainDataLoadPlanner` with
``torch.load(weights_only=True)`` instead of DCP's plain pickle. `check_finite` refuses inf/NaN.
Every refusal is a `CheckpointError`, raised by `read_dcp` as itself on every rank.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "PlainDataLoadPlanner",
    "alone_quietly",
    "check_finite",
    "read_dcp",
    "is_tensor",
]

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


@contextlib.contextmanager
def alone_quietly() -> Iterator[None]:
    """Silence DCP's warning that it reads or writes in one process ("torch.distributed is
    disabled, unavailable or uninitialized, assuming the intent is to ..."), which it gives even
    when asked to (``no_dist=True``): fp8lm reads a sharded folder alone on purpose (an export,
    `fp8lm generate`, a reshard), and a user would take the warning for a fault."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        yield


def read_dcp(state: dict, path: str, planner: DefaultLoadPlanner, coordinated: bool = True) -> None:
    """``dcp.load`` of ``state`` from ``path`` through the trusting-nothing reader, raising a
    `CheckpointError` of any rank as itself (DCP wraps every rank's failure in one multi-line
    exception). ``coordinated=False``: this rank reads alone (no collective). An entry ``state``
    expects as a tensor that the folder stores as pickled bytes is refused before any read."""
    _refuse_bytes_for_tensors(state, path)
    try:
        with alone_quietly():
            dcp.load(state, storage_reader=CheckpointReader(path), planner=planner, no_dist=not coordinated)
    except CheckpointException as e:
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


def _refuse_bytes_for_tensors(state: dict, path: str) -> None:
    metadata = CheckpointReader(path).read_metadata().state_dict_metadata
    flat = {}
    for part, value in state.items():
        entries = value.items() if isinstance(value, dict) else [("", value)]
        flat.update({f"{part}.{name}" if name else part: v for name, v in entries})
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and key in metadata and not is_tensor(metadata[key]):
            raise CheckpointError(
                f"sharded checkpoint {path!r} stores {key!r} as pickled bytes, not a tensor: fp8lm did not write it; "
                "resume from another checkpoint"
            )


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


def is_tensor(meta) -> bool:
    """Whether a DCP metadata entry is a tensor (not pickled bytes)."""
    return isinstance(meta, TensorStorageMetadata)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
