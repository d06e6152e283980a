"""Training checkpoints: atomic writes (temporary file, fsync, rename), keep the last k, and
loading with ``torch.load(weights_only=True)`` (a checkpoint holds only plain tensors, numbers,
strings, lists and dicts).

A loaded checkpoint is trusted for nothing: it is refused, as one `CheckpointError` line, when a
file is not a regular one (a FIFO would block the read forever), when a tensor or a number holds
inf or NaN or a hyper-parameter is out of its range (`check_numbers`), or when the shard folder it
names is not its own sibling ``step_<n>.dcp`` or cannot load (`check_shard_folder`: missing, a
non-regular file in it, unreadable metadata, a data file shorter than the metadata says). What
torch's Distributed Checkpoint raises while reading shards is the same error (`reading_shards`).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ..distributed.checkpoint import CheckpointError, CheckpointReader, check_finite
from ..distributed.reshard import read_full_weights

__all__ = [
    "atomic_write_bytes",
    "atomic_torch_save",
    "save_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "shards_name",
    "remove_stale_temporaries",
    "check_regular_file",
    "check_numbers",
    "check_shard_folder",
    "checkpoint_weights",
    "reading_shards",
    "CheckpointError",
]

_NAME = re.compile(r"^step_(\d+)\.pt$")
_SHARDS = re.compile(r"^step_(\d+)\.dcp$")
_TEMPORARY = re.compile(r"^\..+\.tmp(\d+)$")  # what _atomic writes before its rename
# optimizer hyper-parameter -> (low, high, whether each end is allowed); a value outside is refused
_HYPERPARAMETERS = {
    "lr": (0.0, math.inf, (True, False)),
    "initial_lr": (0.0, math.inf, (True, False)),
    "betas": (0.0, 1.0, (True, False)),
    "eps": (0.0, math.inf, (False, False)),
    "weight_decay": (0.0, math.inf, (True, False)),
}
# counters a training checkpoint holds: whole numbers >= 0
_COUNTERS = ("step", "skipped_steps", "batches_drawn", "tokens_drawn", "timed_steps")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: Path, write) -> None:
    """Write through ``write(file)`` so that ``path`` is either the old file or the complete new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    _atomic(Path(path), lambda f: f.write(data))


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    _atomic(Path(path), lambda f: torch.save(obj, f))


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest step first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def shards_name(step: int) -> str:
    """The folder, next to ``step_<step>.pt``, of a sharded (FP8 ZeRO) checkpoint's optimizer state.
    It is written first; the ``.pt`` file, written last, makes the checkpoint complete."""
    return f"step_{step:08d}.dcp"


def save_checkpoint(state: dict, directory: str | os.PathLike, step: int, keep: int) -> Path:
    """Write ``state`` as ``directory/step_<step>.pt`` atomically, then delete all but the newest
    ``keep`` (with their shard folders, and the shard folders of saves that never completed)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:08d}.pt"
    atomic_torch_save(state, path)
    for old in list_checkpoints(d)[:-keep]:
        old.unlink()  # first: the checkpoint is no longer complete, its shards no longer needed
    _fsync_dir(d)
    kept = {p.name.replace(".pt", ".dcp") for p in list_checkpoints(d)}
    for p in d.iterdir():
        m = _SHARDS.match(p.name)
        if m and p.name not in kept and int(m.group(1)) < step:
            _remove_folder(p)
    return path


def _remove_folder(folder: Path) -> None:
    """Delete a shard folder so that a kill midway leaves no ``step_<n>.dcp`` behind, empty or
    partial: it is renamed to a temporary name first (one atomic step), which the next start's
    `remove_stale_temporaries` deletes if this process dies before it does."""
    doomed = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    os.replace(folder, doomed)
    _fsync_dir(folder.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporaries (``.<name>.tmp<pid>``: files of saves, shard folders being removed)
    that processes killed midway left in ``directory``; those of live processes stay. Returns the
    deleted paths."""
    d = Path(directory)
    stale = [
        p for p in (d.iterdir() if d.is_dir() else []) if (m := _TEMPORARY.match(p.name)) and not _alive(int(m[1]))
    ]
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Load a checkpoint file, or the newest checkpoint of a checkpoint folder or run folder. When
    the newest of a folder cannot be used, the refusal names the newest older one that can."""
    p, older = Path(path), []
    if p.is_dir():
        found = list_checkpoints(p) or list_checkpoints(p / "checkpoints")
        if not found:
            raise CheckpointError(
                f"no checkpoint (step_*.pt) in {str(p)!r}; pass a checkpoint file or a run folder that has one"
            )
        p, older = found[-1], found[:-1]
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist; pass a checkpoint file or a run folder")
    try:
        return _read_checkpoint(p, map_location)
    except CheckpointError as e:
        valid = next((o for o in reversed(older) if _readable(o)), None)
        if valid is None:
            raise
        raise CheckpointError(
            f"{e} (to continue from the newest valid checkpoint, {valid.name!r}, move {p.name!r} out of the folder)"
        ) from None


def _readable(path: Path) -> bool:
    try:
        _read_checkpoint(path, "cpu")
    except CheckpointError:
        return False
    return True


def _read_checkpoint(p: Path, map_location) -> dict:
    check_regular_file(p, "checkpoint")
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for corrupt, empty or foreign files
        raise CheckpointError(f"cannot read checkpoint {str(p)!r}: {_first_line(e)}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{str(p)!r} is not an fp8lm training checkpoint (no 'model' entry)")
    check_finite(dict(_named_values(state)), str(p))
    check_numbers(state, str(p))
    _check_shards(state.get("optimizer_shards"), p)
    if state.get("optimizer_shards") is not None:
        check_shard_folder(p.parent / state["optimizer_shards"])
    state["path"] = str(p)
    return state


def check_regular_file(path: Path, what: str) -> None:
    """Refuse, before reading it, a ``path`` that is not a regular file: a FIFO would block the
    read forever, a device might never end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{what} {str(path)!r} does not exist; resume from another checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {str(path)!r}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(
            f"{what} {str(path)!r} is not a regular file (a FIFO, device, socket or folder): fp8lm did not "
            "write it; move it out of the run and resume from another checkpoint"
        )


def check_numbers(tree, where: str) -> None:
    """Refuse (`CheckpointError`) a checkpoint entry that is a number it cannot resume with: a
    non-finite float anywhere, an optimizer hyper-parameter (``lr``, ``betas``, ``eps``,
    ``weight_decay`` in any dict, i.e. a param group) outside its range, a negative counter. Tensors
    are `check_finite`'s."""
    for name, value in _named_values(tree):
        key = name.rpartition(".")[2]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            _refuse_number(where, name, value, "a finite number")
        owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        limits = _HYPERPARAMETERS.get(key) or (_HYPERPARAMETERS["betas"] if owner == "betas" else None)
        if limits is not None and not _within(value, limits):
            low, high, closed = limits
            interval = f"{'[' if closed[0] else '('}{low}, {high}{']' if closed[1] else ')'}"
            _refuse_number(where, name, value, f"in {interval}")
        if key in _COUNTERS and value < 0:
            _refuse_number(where, name, value, "a count >= 0")


def _within(value: float, limits: tuple) -> bool:
    low, high, closed = limits
    above = value >= low if closed[0] else value > low
    below = value <= high if closed[1] else value < high
    return math.isfinite(value) and above and below


def _refuse_number(where: str, name: str, value, needed: str) -> None:
    raise CheckpointError(
        f"checkpoint {where!r} holds {name} = {value!r}, not {needed}: fp8lm did not write it; "
        "resume from an older checkpoint"
    )


def check_shard_folder(folder: Path) -> None:
    """Refuse a shard folder (``step_<n>.dcp``) that cannot load, before any rank reads a shard:
    missing, a non-regular file in it, unreadable ``.metadata`` (read by fp8lm's safe unpickler),
    a data file missing or shorter than the metadata says, a non-tensor entry that does not
    unpickle as plain data or whose numbers `check_numbers` refuses (FSDP2's param groups). Every
    rank checks the same folder, so every rank refuses alike, without a collective."""
    if not folder.is_dir():
        raise CheckpointError(
            f"shard folder {str(folder)!r} of the checkpoint next to it is missing; move "
            f"{folder.with_suffix('.pt').name!r} out of the run to resume from an older checkpoint"
        )
    for entry in folder.iterdir():
        check_regular_file(entry, "shard file")
    metadata = CheckpointReader(str(folder)).read_metadata()
    root = folder.resolve()
    for info in (metadata.storage_data or {}).values():
        data = (folder / info.relative_path).resolve()
        if not data.is_relative_to(root):
            continue  # refused by CheckpointReader before DCP reads anything
        check_regular_file(data, "shard file")
        size = data.stat().st_size
        if size < info.offset + info.length:
            raise CheckpointError(
                f"shard file {str(data)!r} is truncated ({size} bytes, its metadata needs "
                f"{info.offset + info.length}); move {folder.with_suffix('.pt').name!r} out of the run to resume "
                "from an older checkpoint"
            )
    _check_plain_entries(folder, metadata)


def _check_plain_entries(folder: Path, metadata: Metadata) -> None:
    """Read the non-tensor entries of a shard folder (small: param groups, counters) as plain data
    and check their numbers."""
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if info.transform_descriptors:  # not written by fp8lm's save: DCP's own read checks it
            continue
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        try:
            value = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"cannot read entry {index.fqn!r} of shard folder {str(folder)!r}: {_first_line(e)}; resume from "
                "an older checkpoint"
            ) from None
        check_finite(dict(_named_values(value, index.fqn)), str(folder))
        check_numbers({index.fqn: value}, str(folder))


def checkpoint_weights(state: dict) -> dict[str, torch.Tensor]:
    """The whole model's weights of checkpoint ``state`` (as `load_checkpoint` returns it): from
    the file (one process), or read from its shard folder (every distributed layout writes one)."""
    if state.get("model") is not None:
        return state["model"]
    shards = state.get("optimizer_shards")
    if shards is None:
        raise CheckpointError(f"checkpoint {state['path']!r} holds no weights; pass one written by fp8lm train")
    with reading_shards(state):
        return read_full_weights(Path(state["path"]).parent / shards)


@contextlib.contextmanager
def reading_shards(state: dict) -> Iterator[None]:
    """Whatever loading checkpoint ``state``'s weights and optimizer state raises (torch's
    `CheckpointException`, a BaseException that wraps every rank's failure in many lines; a state
    dict that does not fit) as one `CheckpointError` line."""
    try:
        yield
    except CheckpointError:
        raise
    except CheckpointException as e:
        failures = [exc for exc, _ in e.failures.values()]
        ours = [exc for exc in failures if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        cause = _first_line(failures[0]) if failures else _first_line(e)
        raise CheckpointError(
            f"cannot read the shards of checkpoint {state['path']!r}: {cause}; move it out of the run to resume "
            "from an older checkpoint"
        ) from None
    except (ValueError, RuntimeError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(
            f"cannot load checkpoint {state['path']!r}: {_first_line(e)}; move it out of the run to resume from an "
            "older checkpoint"
        ) from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else "(no message)"
    if len(first) > 160:  # torch's messages can run on for a paragraph
        first = first[:160].rstrip() + " ..."
    return f"{type(e).__name__}: {first}"


def _named_values(tree, prefix: str = ""):
    """The leaves of nested dicts and lists, named by their dotted keys."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else None
    if items is None:
        yield prefix, tree
        return
    for key, value in items:
        yield from _named_values(value, f"{prefix}.{key}" if prefix else str(key))


def _check_shards(name, checkpoint: Path) -> None:
    """The shard folder a checkpoint names must be a ``step_<n>.dcp`` folder next to it (no other
    path, no symlink leading elsewhere)."""
    if name is None:
        return
    folder = checkpoint.parent.resolve()
    if not (isinstance(name, str) and _SHARDS.match(name) and (folder / name).resolve().parent == folder):
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r} names the shard folder {name!r}, not a step_<n>.dcp folder next to "
            "it: fp8lm did not write it; resume from another checkpoint"
        )
