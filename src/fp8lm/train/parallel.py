"""The data-parallel side of a training run launched by ``torchrun``: joining the process group,
wrapping the model and optimizer for the level, and the few collectives the loop itself needs.

Levels map to wrappers as follows (one process, or ``WORLD_SIZE`` unset, wraps nothing):

- ``O1``, ``O2``, ``O3``: `fp8lm.distributed.wrap` (FP8 gradient all-reduce through
  `FP8DataParallel`; at O3 the `FP8ZeroOptimizer`'s FP8 reduce-scatter and weight all-gather);
- ``fp32``, ``bf16``: ``torch.nn.parallel.DistributedDataParallel`` (FP32 gradient all-reduce),
  the baseline FP8-LM compares with.

With ``--fsdp`` every level but O3 shards the model with FSDP2 instead (`shard_for_level`), and
the run's state is an `FSDPState`.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ..amp import initialize
from ..distributed import (
    FP8DataParallel,
    FP8ZeroOptimizer,
    comm_stats,
    ddp_bytes,
    fully_shard,
    load_fsdp_checkpoint,
    precompute_fp8_scales,
    save_fsdp_checkpoint,
    setup,
    wrap,
)
from ..distributed import load_checkpoint as load_sharded
from ..distributed import save_checkpoint as save_sharded
from ..grad import clip_grad_norm_
from ..optim import SkipsNonFiniteSteps
from .checkpoint import CheckpointError, shards_name
from .config import RunError

__all__ = [
    "Ranks",
    "join",
    "wrap_for_level",
    "unwrap",
    "ReplicatedState",
    "ShardedState",
    "FSDPState",
    "shard_for_level",
    "state_layout",
    "accumulating",
    "mean_over_ranks",
    "gather_to_main",
    "broadcast_from_main",
    "barrier",
    "comm_bytes",
    "restarts_allowed",
]

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


def wrap_for_level(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_level: str,
    fp8_levels,
    ranks: Ranks,
    initialize_options: dict,
    grad_sync_scaling: str = "local",
    fsdp: bool = False,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Convert and parallelize ``model``/``optimizer`` for ``opt_level`` (see the module docstring);
    ``grad_sync_scaling`` is `FP8DataParallel`'s ``scaling``; ``fsdp``: FSDP2 (`shard_for_level`)."""
    if fsdp:
        return shard_for_level(model, optimizer, opt_level, fp8_levels, ranks, initialize_options)
    if opt_level in fp8_levels:
        return wrap(model, optimizer, opt_level, scaling=grad_sync_scaling, **initialize_options)
    if ranks.distributed:
        return nn.parallel.DistributedDataParallel(model), optimizer
    return model, optimizer


def shard_for_level(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_level: str,
    fp8_levels,
    ranks: Ranks,
    initialize_options: dict,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 over each of the GPT's blocks and the whole model: O1/O2 after `fp8lm.initialize`
    (FP8 weight all-gather, FP8 gradient reduce-scatter); bf16 with torch's BF16
    ``MixedPrecisionPolicy`` (BF16 all-gather and reduce-scatter); fp32 plain. All through
    `fp8lm.distributed.fully_shard`, so `comm_stats` counts every collective. The optimizer is
    pointed at the sharded parameters."""
    if not ranks.distributed:
        raise RunError("--fsdp shards over torchrun's ranks: launch with torchrun --nproc_per_node N, or drop --fsdp")
    options: dict = {"fp8_reduce_scatter": opt_level in fp8_levels}
    if opt_level in fp8_levels:
        model, optimizer = initialize(model, optimizer, opt_level, **initialize_options)
    elif opt_level == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    names = {id(p): name for name, p in model.named_parameters()}
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    precompute_fp8_scales(model)
    return model, optimizer


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a data-parallel wrapper (state dicts, evaluation, memory, telemetry)."""
    return model.module if isinstance(model, (FP8DataParallel, nn.parallel.DistributedDataParallel)) else model


class ReplicatedState:
    """Every rank holds the whole model and optimizer state (one process, `FP8DataParallel`, DDP).
    A state layout answers where the optimizer state lives, how a step is clipped and taken, and
    how the state goes to and from a checkpoint; a new kind of parallelism is a new layout."""

    # Whether a forward pass needs every rank (then all ranks evaluate, not rank 0 alone).
    collective_forward = False

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds (memory reports, telemetry)."""
        return optimizer

    def clip(self, model: nn.Module, max_norm: float) -> float:
        """Clip the gradients to ``max_norm``; returns their norm before clipping."""
        # model.parameters(), not the optimizer's group order: the norm's float sum stays as it was
        return float(clip_grad_norm_(model.parameters(), max_norm))

    def clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[float, bool]:
        """Clip the gradients to ``max_norm`` and step; returns the norm before clipping and whether
        the step was skipped: an inf/NaN gradient skips the update rather than poison the weights."""
        grad_norm = self.clip(model, max_norm)
        if isinstance(optimizer, SkipsNonFiniteSteps):  # fp8lm's optimizers skip and count on their own
            optimizer.step()
            return grad_norm, optimizer.last_step_skipped
        if not math.isfinite(grad_norm):
            return grad_norm, True
        optimizer.step()
        return grad_norm, False

    def save_shards(self, directory: Path, step: int, model: nn.Module, optimizer) -> str | None:
        """Write what each rank holds alone (a collective); returns its name in ``directory``."""
        return None

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The optimizer state rank 0 puts into the checkpoint file itself."""
        return optimizer.state_dict()

    def model_state(self, model: nn.Module) -> dict:
        """The model's full weights for the checkpoint file (all ranks call it; rank 0 writes it)."""
        return model.state_dict()

    def load(self, directory: Path, state: dict, model: nn.Module, optimizer) -> None:
        """Load the model's weights and the optimizer state of checkpoint ``state`` (in ``directory``)."""
        if state["optimizer"] is None:
            raise CheckpointError(
                f"checkpoint {state['path']!r} keeps its optimizer state sharded (trained with --fsdp): resume with "
                "--fsdp under the same torchrun"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


class ShardedState(ReplicatedState):
    """FP8 ZeRO (`FP8ZeroOptimizer`): each rank holds its shard of the optimizer state, clips by the
    global norm of the reduced gradients and skips a non-finite step itself; checkpoints keep the
    shards in a ``step_<step>.dcp/`` folder next to the checkpoint file."""

    def local_optimizer(self, optimizer: FP8ZeroOptimizer) -> torch.optim.Optimizer:
        return optimizer.shard

    def clip_and_step(self, model: nn.Module, optimizer: FP8ZeroOptimizer, max_norm: float) -> tuple[float, bool]:
        grad_norm = float(optimizer.clip_grad_norm_(max_norm))
        optimizer.step()
        return grad_norm, bool(optimizer.last_step_skipped)

    def save_shards(self, directory: Path, step: int, model: nn.Module, optimizer: FP8ZeroOptimizer) -> str:
        name = shards_name(step)
        save_sharded(directory / name, model, optimizer)
        return name

    def optimizer_state(self, optimizer: FP8ZeroOptimizer) -> None:
        return None

    def load(self, directory: Path, state: dict, model: nn.Module, optimizer: FP8ZeroOptimizer) -> None:
        load_sharded(directory / state["optimizer_shards"], model, optimizer)


class FSDPState(ReplicatedState):
    """FSDP2 (``--fsdp``): each rank holds its shards of the weights, gradients and optimizer state
    (DTensors). Clipping is by the norm of the whole gradients; after each step the FP8 all-gather
    scales are agreed for the next forward (`precompute_fp8_scales`). Checkpoints keep the sharded
    model and optimizer in a ``step_<step>.dcp/`` folder (Distributed Checkpoint), and the
    checkpoint file the full weights (for ``--init-from`` and inspection)."""

    collective_forward = True

    def clip(self, model: nn.Module, max_norm: float) -> float:
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # DTensor gradients: reduced over the mesh
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[float, bool]:
        result = super().clip_and_step(model, optimizer, max_norm)
        precompute_fp8_scales(model)
        return result

    def save_shards(self, directory: Path, step: int, model: nn.Module, optimizer) -> str:
        name = shards_name(step)
        save_fsdp_checkpoint(directory / name, model, optimizer)
        return name

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def model_state(self, model: nn.Module) -> dict:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0
        return get_model_state_dict(model, options=options)

    def load(self, directory: Path, state: dict, model: nn.Module, optimizer) -> None:
        if state.get("optimizer_shards") is None:
            raise CheckpointError(
                f"checkpoint {state['path']!r} was trained without --fsdp: resume without --fsdp, at the same world size"
            )
        load_fsdp_checkpoint(directory / state["optimizer_shards"], model, optimizer)
        precompute_fp8_scales(model)


def state_layout(optimizer: torch.optim.Optimizer) -> ReplicatedState:
    """The layout of the state of a model and ``optimizer`` that `wrap_for_level` returned."""
    if isinstance(optimizer, FP8ZeroOptimizer):
        return ShardedState()
    if any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
        return FSDPState()
    return ReplicatedState()


def accumulating(model: nn.Module, last_micro_batch: bool):
    """Context for one micro-batch's backward: gradients sync only on the last one of a step
    (O3 accumulates locally until its optimizer step anyway)."""
    if isinstance(model, FSDPModule):
        return _fsdp_gradient_sync(model, last_micro_batch)
    if last_micro_batch or not isinstance(model, (FP8DataParallel, nn.parallel.DistributedDataParallel)):
        return contextlib.nullcontext()
    return model.no_sync()


@contextlib.contextmanager
def _fsdp_gradient_sync(model: FSDPModule, enabled: bool):
    """FSDP2 reduce-scatters only when ``enabled``; otherwise it accumulates unsharded gradients."""
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


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
