"""Training checkpoints: atomic writes (temporary file, fsync, rename), keep the last k, and
loading with ``torch.load(weights_only=True)`` (a checkpoint holds only plain tensors, numbers,
strings, lists and dicts). A loaded checkpoint is refused when a tensor holds inf or NaN, or when
the shard folder it names is not its own sibling ``step_<n>.dcp``."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from ..distributed.checkpoint import CheckpointError, check_finite

__all__ = [
    "atomic_write_bytes",
    "atomic_torch_save",
    "save_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "shards_name",
    "remove_stale_temporaries",
    "CheckpointError",
]

_NAME = re.compile(r"^step_(\d+)\.pt$")
_SHARDS = re.compile(r"^step_(\d+)\.dcp$")
_TEMPORARY = re.compile(r"^\..+\.tmp(\d+)$")  # what _atomic writes before its rename


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
        old.unlink()
    kept = {p.name.replace(".pt", ".dcp") for p in list_checkpoints(d)}
    for p in d.iterdir():
        m = _SHARDS.match(p.name)
        if m and p.name not in kept and int(m.group(1)) < step:
            shutil.rmtree(p, ignore_errors=True)
    return path


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files (``.<name>.tmp<pid>``) that writers killed mid-save left in
    ``directory``; those of live processes stay. Returns the deleted paths."""
    d = Path(directory)
    stale = [
        p for p in (d.iterdir() if d.is_dir() else []) if (m := _TEMPORARY.match(p.name)) and not _alive(int(m[1]))
    ]
    for p in stale:
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
    if not p.is_file():
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
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for corrupt, empty or foreign files
        first = (str(e).splitlines() or ["(no message)"])[0]
        raise CheckpointError(f"cannot read checkpoint {str(p)!r}: {type(e).__name__}: {first}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{str(p)!r} is not an fp8lm training checkpoint (no 'model' entry)")
    check_finite(dict(_named_values(state)), str(p))
    _check_shards(state.get("optimizer_shards"), p)
    state["path"] = str(p)
    return state


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
