"""`wrap`: `fp8lm.initialize` plus the distributed part of an optimization level."""

from __future__ import annotations

import torch
from torch import nn

from .data_parallel import FP8DataParallel
from .runtime import is_distributed
from .zero import FP8ZeroOptimizer

__all__ = ["wrap"]


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    opt_level: str = "O2",
    *,
    process_group=None,
    bucket_mb: float = 25,
    scaling: str = "local",
    **initialize_options,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Convert ``model``/``optimizer`` with ``fp8lm.initialize(model, optimizer, opt_level)`` and
    make them data parallel over ``process_group`` (when there is more than one rank):

    - O1, O2: the model is wrapped in `FP8DataParallel` (FP8 gradient all-reduce);
    - O3: the optimizer becomes an `FP8ZeroOptimizer` (FP8 weights, master weights and moments
      sharded, FP8 reduce-scatter of gradients and all-gather of weights); the model stays as is.

    Without a process group of 2+ ranks it returns what ``initialize`` returns.
    """
    if opt_level == "O3" and optimizer is None:
        raise ValueError("opt_level O3 shards the optimizer: pass the optimizer to wrap()")
    from ..amp import initialize  # imported on use: `import fp8lm.distributed` stays light

    model, optimizer = initialize(model, optimizer, opt_level, **initialize_options)
    if not is_distributed():
        return model, optimizer
    if opt_level == "O3":
        return model, FP8ZeroOptimizer(model, optimizer, process_group)
    return FP8DataParallel(model, process_group, bucket_mb, scaling=scaling), optimizer
