"""This process's place in a run launched by ``torchrun``: joining the process group once, and the
few collectives of the loop itself (the loss's mean, rank 0's decisions, gathered per-rank state).

Every tensor handed to a collective here lives on the run's compute device (NCCL has no CPU
backend); objects go through torch's object collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..distributed import comm, setup
from ..distributed.mesh import ParallelDims
from .config import RunError

__all__ = [
    "Ranks",
    "join",
    "restarts_allowed",
    "mean_over_ranks",
    "gather_to_main",
    "broadcast_from_main",
    "barrier",
    "COLLECTIVE_TIMEOUT_S",
]

# Bounds every collective: a rank that stops answering makes the others fail instead of hang.
COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` and the run's `ParallelDims` (how the ``world`` splits)."""

    rank: int = 0
    dims: ParallelDims = field(default_factory=ParallelDims)
    # Launched by torchrun: the distributed code path runs, at world size 1 too (a one-GPU NCCL
    # run checks it end to end).
    launched: bool = False

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def main(self) -> bool:
        """Rank 0 writes the run's files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether the run takes the distributed code path (process groups, a mesh, collectives)."""
        return self.launched or self.world > 1

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        """Data-parallel replicas or shards: each draws its own batches."""
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def model_spread(self) -> bool:
        """Whether one copy of the model (its layers, weights, gradients or optimizer state) is
        spread over several ranks: pipeline stages, tensor-parallel or data-parallel shards."""
        return self.dims.pp * self.dims.dp_shard * self.dims.tp > 1

    @property
    def first_copy(self) -> bool:
        """Whether this rank holds part of the first copy of the model (data-parallel replica 0)."""
        return self.dims.coordinates(self.rank)["dp_replicate"] == 0


def join(tp: int = 1, pp: int = 1, shard: bool = False) -> Ranks:
    """This process's place in the run: the process group torchrun describes (``WORLD_SIZE`` in the
    environment) is joined once; without torchrun, a single process. ``tp`` x ``pp`` ranks hold
    one model replica; the world size must be a multiple of it, and the rest is data-parallel,
    sharding the model state when ``shard`` (FSDP2, FP8 ZeRO)."""
    if "WORLD_SIZE" not in os.environ:
        if tp * pp > 1:
            raise RunError(
                f"--tp {tp} --pp {pp} split the model over torchrun's ranks: launch with torchrun --nproc-per-node "
                f"N (a multiple of {tp * pp}), or drop --tp/--pp"
            )
        return Ranks()
    rank, world = setup(timeout_s=COLLECTIVE_TIMEOUT_S)
    if world % (tp * pp):
        raise RunError(
            f"{world} ranks cannot be split into model replicas of --tp {tp} x --pp {pp} = {tp * pp} ranks: launch a "
            f"multiple of {tp * pp} ranks (world size = dp x tp x pp)"
        )
    return Ranks(rank, ParallelDims.for_world(world, tp=tp, pp=pp, shard=shard), launched=True)


def restarts_allowed() -> bool:
    """True in a worker that ``torchrun --max-restarts N`` (N >= 1) may start again."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def mean_over_ranks(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The mean of a scalar over ranks (the global batch's loss), on ``value``'s device; itself in
    one process."""
    if not ranks.distributed:
        return value
    out = value.detach().float().reshape(1).clone()
    comm.all_reduce(out)
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
