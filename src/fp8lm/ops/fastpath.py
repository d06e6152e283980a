"""Fast paths that may be unavailable on a machine, and the settings that turn them off.

fp8lm has four fast paths: its C kernels (`fp8lm.ops.native`), the `torch.compile`-d casts
(`fp8lm.ops.cast`), the compiled scale arithmetic of `fp8lm.nn.FP8Linear` and the
`torch.compile`-d optimizer step (`fp8lm.optim.fused`). Each gives the same results as its plain
path, so a fallback changes speed, never numbers.

A path falls back only when it cannot be built: its C compiler or torch.compile's backend fails,
or its library does not load (`BUILD_ERRORS`). It then warns once, in one line naming the path,
its fallback and the error, and stays off for the rest of the process (failing once usually
means failing always: no C compiler, say); the other paths are not affected. An error of
torch.compile's tracing itself (`TRACE_ERRORS`: it could not run the function on fake tensors,
or failed inside) may be the arguments' fault or torch.compile's: the plain path then runs on
the same arguments, and only if it succeeds is the fast path turned off (with its warning);
otherwise the plain path's own error propagates and the fast path stays on. Any other error (out
of memory, a wrong argument, a numerical check) propagates as it would from the plain path.

Each environment variable is one `Switch`, read once at import and settable from code:
``FP8LM_NATIVE=0`` (`NATIVE`) turns the C kernels off, ``FP8LM_FUSED_CAST=0`` (`COMPILED_CASTS`)
the compiled casts and scale arithmetic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = [
    "FastPath",
    "Switch",
    "NativeBuildError",
    "BUILD_ERRORS",
    "TRACE_ERRORS",
    "is_build_error",
    "NATIVE",
    "COMPILED_CASTS",
]

T = TypeVar("T")


class NativeBuildError(RuntimeError):
    """The C compiler could not build fp8lm's kernels."""


# What "cannot be built" means: a compiler that fails or is missing (OSError), a library that
# does not load (OSError), and torch.compile's tracing or backend failing (`_COMPILE_ERRORS`).
BUILD_ERRORS: tuple[type[BaseException], ...] = (NativeBuildError, OSError, subprocess.SubprocessError)
# torch.compile's errors, by module and name: importing torch._dynamo to name them would add
# seconds to importing fp8lm, and where one is raised the module is loaded. Unsupported: tracing
# with fullgraph; BackendCompilerFailed wraps inductor's errors (CppCompileError among them).
_COMPILE_ERRORS = {
    "torch._dynamo.exc": ("BackendCompilerFailed", "Unsupported"),
    "torch._inductor.exc": ("CppCompileError", "InvalidCxxCompiler"),
}
_MEMORY_ERRORS = (MemoryError, torch.OutOfMemoryError)
# torch.compile failing while it traces: running the function on fake tensors (TorchRuntimeError)
# or inside itself (InternalTorchDynamoError).
TRACE_ERRORS = {"torch._dynamo.exc": ("TorchRuntimeError", "InternalTorchDynamoError")}


def _compile_error_types(errors: dict = _COMPILE_ERRORS) -> tuple[type[BaseException], ...]:
    loaded = ((sys.modules.get(module), names) for module, names in errors.items())
    return tuple(getattr(module, name) for module, names in loaded if module is not None for name in names)


class Switch:
    """One user setting that turns a family of fast paths off: the environment variable ``env``
    (``0`` means off), read once; ``on`` may also be set from code."""

    def __init__(self, env: str):
        self.env = env
        self.on = os.environ.get(env, "1") != "0"

    def __repr__(self) -> str:
        return f"Switch({self.env}, on={self.on})"


NATIVE = Switch("FP8LM_NATIVE")
COMPILED_CASTS = Switch("FP8LM_FUSED_CAST")


def is_build_error(err: BaseException) -> bool:
    """Whether ``err`` says a fast path cannot be built (see `BUILD_ERRORS`); an out-of-memory
    error, even one raised while compiling, is not one."""
    if not isinstance(err, BUILD_ERRORS + _compile_error_types()) or isinstance(err, _MEMORY_ERRORS):
        return False
    inner = getattr(err, "inner_exception", None) or err.__cause__
    return not isinstance(inner, _MEMORY_ERRORS)


class FastPath:
    """One optional fast path: ``enabled`` while its `Switch` (if any) is on and it has not failed
    to build. ``name`` and ``fallback`` describe it and its plain path in the warning."""

    def __init__(self, name: str, fallback: str, switch: Switch | None = None):
        self.name = name
        self.fallback = fallback
        self.switch = switch
        self.failed: str | None = None  # why it fell back, once it did

    @property
    def enabled(self) -> bool:
        return (self.switch is None or self.switch.on) and self.failed is None

    def disable(self, err: BaseException) -> None:
        """Turn the path off for the rest of the process, with one warning line the first time."""
        if self.failed is None:
            first_line = (str(err).strip().splitlines() or [""])[0][:300]
            self.failed = f"{type(err).__name__}: {first_line}"
            warnings.warn(f"fp8lm: {self.name} unavailable ({self.failed}); using {self.fallback}", stacklevel=3)

    def run(self, fast: Callable[[], T], plain: Callable[[], T]) -> T:
        """``fast()`` while the path is enabled; ``plain()`` when it is off or ``fast`` cannot be
        built (which turns it off), or when torch.compile could not trace it and ``plain()``
        succeeds (which turns it off too; see the module doc). Any other error from ``fast``
        propagates."""
        if self.enabled:
            try:
                return fast()
            except Exception as err:
                if is_build_error(err):
                    self.disable(err)
                elif isinstance(err, _compile_error_types(TRACE_ERRORS)):
                    result = plain()  # raises where the arguments are at fault: the path stays on
                    self.disable(err)
                    return result
                else:
                    raise
        return plain()
