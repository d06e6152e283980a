"""Writing a whole folder at once: into a temporary folder next to the destination, renamed to it
when complete, so a failure or a kill midway leaves the destination as it was (absent, empty, or
the previous export when overwriting)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ExportError", "check_destination", "atomic_folder"]


class ExportError(ValueError):
    """An export that cannot be written as asked (one line saying what to change)."""


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, an ``out`` that is a file, a non-empty folder (unless
    ``overwrite``), or inside a folder this process cannot write to."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a file; pass a new or empty folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {str(out)!r} is not empty; pass --overwrite to replace it or choose another folder")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise ExportError(f"--out {str(out)!r}: its parent folder {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--out {str(out)!r}: cannot write in {str(parent)!r}; pass a folder you can write to")


@contextlib.contextmanager
def atomic_folder(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder to fill; on success it becomes ``out`` (replacing an empty ``out``,
    or a non-empty one when ``overwrite``); on failure it is removed and ``out`` is untouched."""
    check_destination(out, overwrite)
    tmp = out.absolute().parent / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first and deleted after, so
    at every moment ``out`` is the old folder or the new one (or briefly absent), never partial."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.absolute().parent / f".{out.name}.old{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)  # an empty folder at ``out`` is replaced by the rename itself
    _fsync(out.absolute().parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
