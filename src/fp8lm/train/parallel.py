"""The data-parallel side of a training run launched by ``torchrun``: joining the process group,
wrapping the model and optimizer for the level, and the few collectives the loop itself needs.

Levels map to wrappers as follows (one process, or ``WORLD_SIZE`` unset, wraps nothing):

- ``O1``, ``O2``, ``O3``: `fp8lm.distributed.wrap` (FP8 gradient all-reduce through
  `FP8DataParallel`; at O3 the `FP8ZeroOptimizer`'s FP8 reduce-scatter and weight all-gather);
- ``fp32``, ``bf16``: ``torch.nn.parallel.DistributedDataParallel`` (FP32 gradient all-reduce),
  the baseline FP8-LM compares with.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import FP8DataParallel, FP8ZeroOptimizer, comm_stats, ddp_bytes, setup, wrap

__all__ = ["Ranks", "join", "wrap_for_level", "unwrap", "is_sharded", "accumulating", "mean_over_ranks",
           "gather_to_main", "broadcast_from_main", "barrier", "comm_bytes", "restarts_allowed"]

# Bounds every collective: a rank that stops answering makes the others fail instead of hang.
COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0 writes the run's files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def join() -> Ranks:
    """This process's place in the run: the process group torchrun describes (``WORLD_SIZE`` in the
    environment) is joined once; without torchrun, a single process."""
    if "WORLD_SIZE" not in os.environ:
        return Ranks()
    rank, world = setup(timeout_s=COLLECTIVE_TIMEOUT_S)
    return Ranks(rank, world)


def restarts_allowed() -> bool:
    """True in a worker that ``torchrun --max-restarts N`` (N >= 1) may start again."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def wrap_for_level(model: nn.Module, optimizer: torch.optim.Optimizer, opt_level: str, fp8_levels,
                   ranks: Ranks, initialize_options: dict, grad_sync_scaling: str = "local",
                   ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Convert and parallelize ``model``/``optimizer`` for ``opt_level`` (see the module docstring);
    ``grad_sync_scaling`` is `FP8DataParallel`'s ``scaling``."""
    if opt_level in fp8_levels:
        return wrap(model, optimizer, opt_level, scaling=grad_sync_scaling, **initialize_options)
    if ranks.distributed:
        return nn.parallel.DistributedDataParallel(model), optimizer
    return model, optimizer


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a data-parallel wrapper (state dicts, evaluation, memory, telemetry)."""
    return model.module if isinstance(model, (FP8DataParallel, nn.parallel.DistributedDataParallel)) else model


def is_sharded(optimizer) -> bool:
    return isinstance(optimizer, FP8ZeroOptimizer)


def accumulating(model: nn.Module, last_micro_batch: bool):
    """Context for one micro-batch's backward: gradients sync only on the last one of a step
    (O3 accumulates locally until its optimizer step anyway)."""
    if last_micro_batch or not isinstance(model, (FP8DataParallel, nn.parallel.DistributedDataParallel)):
        return contextlib.nullcontext()
    return model.no_sync()


def mean_over_ranks(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The mean of a scalar over ranks (the global batch's loss); itself in one process."""
    if not ranks.distributed:
        return value
    out = value.detach().float().reshape(1).cpu()
    dist.all_reduce(out)
    return out[0] / ranks.world


def gather_to_main(obj, ranks: Ranks) -> list | None:
    """Every rank's ``obj`` as a list on rank 0 (None elsewhere); ``[obj]`` in one process."""
    if not ranks.distributed:
        return [obj]
    out = [None] * ranks.world if ranks.main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_from_main(obj, ranks: Ranks):
    """Rank 0's ``obj`` on every rank."""
    if not ranks.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier()


def comm_bytes(model: nn.Module, num_params: int, ranks: Ranks) -> float:
    """Bytes this rank sent for the step just taken. fp8lm's collectives count themselves
    (`fp8lm.distributed.comm_stats`); torch's DDP (fp32/bf16 levels) sends its FP32 gradients by
    the standard all-reduce cost, `ddp_bytes`."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return ddp_bytes(num_params, 4, ranks.world)
    return comm_stats()["total_bytes"]
