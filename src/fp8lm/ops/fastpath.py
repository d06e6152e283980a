"""A fast path that may be unavailable on a machine: tried first, turned off for the whole process at
its first failure (with one warning), after which the plain path runs.

fp8lm has three: its C kernels (`fp8lm.ops.native`), the `torch.compile`-d casts (`fp8lm.ops.cast`)
and the `torch.compile`-d optimizer step (`fp8lm.optim.fused`). Each gives the same results as its
plain path, so a fallback changes speed, never numbers. Failing once usually means failing always
(no C compiler, say), so a failed path is not retried.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TypeVar

__all__ = ["FastPath"]

T = TypeVar("T")


class FastPath:
    """One optional fast path: ``enabled`` until it fails (or its environment switch says ``0``).

    ``name`` and ``fallback`` describe it and its plain path in the warning; ``env_switch`` names an
    environment variable that turns it off when set to ``0``.
    """

    def __init__(self, name: str, fallback: str, env_switch: str | None = None):
        self.name = name
        self.fallback = fallback
        self.enabled = env_switch is None or os.environ.get(env_switch, "1") != "0"

    def disable(self, err: BaseException) -> None:
        """Turn the path off for the rest of the process; warns the first time only."""
        if self.enabled:
            self.enabled = False
            warnings.warn(
                f"fp8lm: {self.name} unavailable ({type(err).__name__}: {err}); using {self.fallback}", stacklevel=3
            )

    def run(self, fast: Callable[[], T], plain: Callable[[], T]) -> T:
        """``fast()`` while the path is enabled; ``plain()`` when it is off or ``fast`` raises (which
        turns it off)."""
        if self.enabled:
            try:
                return fast()
            except Exception as err:  # the fast path is an optimization: any failure falls back
                self.disable(err)
        return plain()
