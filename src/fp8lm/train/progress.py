"""What the app prints while it trains, and its optional pieces: the progress bar (tqdm, or plain
lines without it), one bar across the runs of a comparison (`overall`), and plots (matplotlib, or
none, said once). ``pip install 'fp8lm[train]'`` brings tqdm and matplotlib."""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["bar", "write", "write_once", "say", "naming", "run_name", "overall", "skipped", "pyplot", "EXTRA"]

EXTRA = "pip install 'fp8lm[train]'"
_said: set[str] = set()  # what was said once already


def _tqdm() -> Any:
    try:
        return importlib.import_module("tqdm").tqdm
    except ImportError:
        return None


def write(line: str) -> None:
    """Print ``line`` above the progress bar (tqdm's) or as a plain line; flushed."""
    tqdm = _tqdm()
    if tqdm is not None:
        tqdm.write(line)
    else:
        print(line)
    sys.stdout.flush()


def write_once(line: str) -> None:
    """`write` ``line`` unless this process wrote it already (the runs of a comparison share data)."""
    if line not in _said:
        _said.add(line)
        write(line)


def pyplot() -> Any:
    """matplotlib's pyplot writing files (the Agg backend), or None when matplotlib is not
    installed: then one line says so, once per process, and no plot is written."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        if "matplotlib" not in _said:
            _said.add("matplotlib")
            write(f"no plots: matplotlib is not installed ({EXTRA} installs it)")
        return None
    matplotlib.use("Agg")  # files only, no display needed
    return importlib.import_module("matplotlib.pyplot")


class _Plain:
    """A progress bar as plain lines (no tqdm): one every tenth of the run and at its end."""

    def __init__(self, total: int, initial: int, desc: str) -> None:
        self.total, self.n, self.desc, self.postfix = total, initial, desc, ""
        self.start, self.start_n = time.perf_counter(), initial
        self.every = max(1, total // 10)

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            write(f"{self.desc}: {self.n}/{self.total} steps{_eta(self)}{', ' + self.postfix if self.postfix else ''}")

    def close(self) -> None:
        pass


def _eta(b: _Plain) -> str:
    done, elapsed = b.n - b.start_n, time.perf_counter() - b.start
    if done <= 0 or b.n >= b.total:
        return f", {elapsed:.0f} s"
    return f", {elapsed:.0f} s, ETA {elapsed / done * (b.total - b.n):.0f} s"


class _Quiet:
    def set_postfix(self, refresh: bool = False, **values) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _Share:
    """One run's view of the `overall` bar: it advances the shared bar and names the run; the
    steps the run took before (``done``: it resumes) leave the bar's total, which counts what
    trains now and so times the ETA."""

    def __init__(self, shared: Any, desc: str, done: int = 0) -> None:
        self.shared = shared
        _drop(shared, done)
        shared.set_description(desc)

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.shared.set_postfix(refresh=False, **values)

    def update(self, n: int = 1) -> None:
        self.shared.update(n)

    def close(self) -> None:
        pass


_overall: list[Any] = []  # the bar of the comparison running now, if any
_names: list[str] = []  # the name of the comparison's run training now, if any


@contextlib.contextmanager
def naming(name: str) -> Iterator[None]:
    """Within it, `say` prefixes lines with ``name`` (a comparison's level, and seed): the runs of
    a comparison print the same kinds of lines, each must say whose it is."""
    _names.append(name)
    try:
        yield
    finally:
        _names.pop()


def run_name() -> str | None:
    """The name `naming` gave the run training now, or None outside a comparison."""
    return _names[-1] if _names else None


def say(line: str) -> None:
    """`write` a line about the run training now: prefixed with its `naming` in a comparison."""
    write(f"{_names[-1]}: {line}" if _names else line)


def _drop(shared: Any, steps: int) -> None:
    if steps > 0:
        shared.total = max(shared.n, shared.total - steps)
        if hasattr(shared, "refresh"):  # tqdm's: show the new total now
            shared.refresh()


def skipped(steps: int) -> None:
    """A run of the comparison in progress that has nothing left to train (it finished before a
    ``--resume``): its ``steps`` leave the `overall` bar's total."""
    if _overall:
        _drop(_overall[-1], steps)


def bar(total: int, initial: int, desc: str, enabled: bool) -> Any:
    """The progress of one run: tqdm's bar, plain lines without tqdm, or a share of the `overall`
    bar of the comparison it is part of; nothing when not ``enabled``."""
    if not enabled:
        return _Quiet()
    if _overall:
        return _Share(_overall[-1], desc, initial)
    return _new_bar(total, initial, desc)


def _new_bar(total: int, initial: int, desc: str) -> Any:
    tqdm = _tqdm()
    if tqdm is None:
        if "tqdm" not in _said:
            _said.add("tqdm")
            write(f"progress as plain lines: tqdm is not installed ({EXTRA} installs it)")
        return _Plain(total, initial, desc)
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


@contextlib.contextmanager
def overall(total: int, initial: int, desc: str, enabled: bool) -> Iterator[None]:
    """Within it, every run's `bar` advances one bar of ``total`` steps (with its ETA), named by
    the run that trains: a comparison's levels and seeds as one progress line."""
    if not enabled:
        yield
        return
    shared = _new_bar(total, initial, desc)
    _overall.append(shared)
    try:
        yield
    finally:
        _overall.pop()
        shared.close()
