"""Activation checkpointing that recomputes FP8 casts bit for bit.

`checkpoint` is ``torch.utils.checkpoint.checkpoint`` (non-reentrant: it composes with FSDP2,
DTensor and ``torch.compile``) for regions holding `FP8Linear` layers. A delayed-scaled layer
updates its `ScalingMeta` state (the scale, the amax history) in every forward, so a plain
recomputation during backward would cast with the next step's scale, giving other FP8 tensors
than the forward saved, and record a second amax for the same step. Here the forward takes a
copy of the region's scaling states as they were before it (`scaling_contexts`); the
recomputation runs from that copy, so every cast, amax and outlier decision repeats exactly,
and afterwards the states are put back to what they were when it began: each stream records
one amax per forward, as without checkpointing. `is_recomputing` tells hooks (FP8 telemetry)
that a forward is a recomputation.

Under ``torch.compile`` (``fullgraph=True`` traces a checkpointed model in one graph) the
compiler's partitioner decides what to recompute, and it recomputes a delayed-scaled cast from
the scaling state as the forward left it (the next step's scale): `checkpoint` refuses that in
one line. With current scaling (``recipe="tensorwise-current"``), whose scales come from the
tensors themselves, compiled and eager checkpointed training are the same (tested).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..scaling import ScalingMeta

__all__ = ["checkpoint", "scaling_contexts", "is_recomputing"]

_recomputing = 0  # recomputations under way (they do not nest in practice; a count is safe if they do)


def is_recomputing() -> bool:
    """Whether a `checkpoint` region is being recomputed (during backward) right now."""
    return _recomputing > 0


_Snapshot = list[tuple[tuple[torch.Tensor, ...], bool]]


def _take(metas: list[ScalingMeta]) -> _Snapshot:
    return [(tuple(b.clone() for b in m.state), m._has_history) for m in metas]


def _put(metas: list[ScalingMeta], snapshot: _Snapshot) -> None:
    for meta, (buffers, has_history) in zip(metas, snapshot):
        for buf, value in zip(meta.state, buffers):
            buf.copy_(value)
        meta._has_history = has_history


def _metas(modules: nn.Module | Iterable[nn.Module]) -> list[ScalingMeta]:
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    return list({id(m): m for root in roots for m in root.modules() if isinstance(m, ScalingMeta)}.values())


def scaling_contexts(modules: nn.Module | Iterable[nn.Module]) -> Callable[[], tuple]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``), e.g.
    through torch's ``checkpoint_wrapper``: the recomputation of the region sees the
    `ScalingMeta` states of ``modules`` (all their submodules') as the forward saw them, and
    leaves them as it found them (module docstring)."""
    metas = _metas(modules)

    def context_fn() -> tuple:
        before: _Snapshot = []

        @contextlib.contextmanager
        def forward():
            before.extend(_take(metas))
            yield

        @contextlib.contextmanager
        def recompute():
            global _recomputing
            now = _take(metas)
            _put(metas, before)
            _recomputing += 1
            try:
                yield
            finally:
                _recomputing -= 1
                _put(metas, now)

        return forward(), recompute()

    return context_fn


def checkpoint(function: Callable, *args, scaling: nn.Module | Iterable[nn.Module] | None = None, **kwargs):
    """``function(*args, **kwargs)`` under non-reentrant activation checkpointing: only the
    inputs are kept for backward, which recomputes the rest; FP8 layers in ``scaling`` (default:
    ``function`` itself when it is a module) recompute with the scales the forward used (module
    docstring). Keyword arguments go to ``torch.utils.checkpoint.checkpoint``: its own options
    (``preserve_rng_state``, ``determinism_check``) and the function's."""
    if scaling is None:
        if not isinstance(function, nn.Module):
            raise TypeError(
                "fp8lm.nn.checkpoint: pass scaling=<the module(s) whose FP8 layers the function runs> "
                f"(function is a {type(function).__name__}, not a module)"
            )
        scaling = function
    if torch.compiler.is_compiling():
        if any(meta.delayed for meta in _metas(scaling)):
            raise RuntimeError(
                "fp8lm.nn.checkpoint under torch.compile recomputes delayed-scaled FP8 layers with the next "
                "step's scale; use current scaling (recipe='tensorwise-current') or run the checkpointed model eagerly"
            )
        return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
    return torch_checkpoint(function, *args, use_reentrant=False, context_fn=scaling_contexts(scaling), **kwargs)
