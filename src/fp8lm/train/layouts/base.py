"""The protocol every layout follows (`Layout`) and what it is built from (`LayoutSpec`).

A layout answers, for one way of spreading a model and its optimizer over the ranks: how the
model is parallelized, how a step's micro-batches run forward and backward and sync their
gradients, how a validation loss is computed, how the gradients are clipped and the step taken,
what the communication cost, and how the state goes to and from a checkpoint. The training loop
calls only these, so it does not know which layout runs. The base class is the one-process layout.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ...amp import initialize
from ...distributed import comm_stats, load_checkpoint, save_checkpoint
from ...distributed.accounting import KINDS
from ...distributed.grad_sync import GradientSync, SyncPlan
from ...distributed.mesh import ParallelMesh
from ...grad import clip_grad_norm_
from ...optim import SkipsNonFiniteSteps
from ..checkpoint import CheckpointError, shards_name
from ..ranks import Ranks

__all__ = ["Layout", "LayoutSpec", "PipelineShape", "ShardedCheckpoints", "point_optimizer_at", "gradient_sync"]


@dataclass(frozen=True)
class PipelineShape:
    """How a pipeline-parallel step runs: ``micro_batches`` per step of ``local_batch`` sequences
    (this replica's), the forward in ``autocast`` (a reusable context manager)."""

    local_batch: int
    micro_batches: int
    autocast: contextlib.AbstractContextManager


@dataclass(frozen=True)
class LayoutSpec:
    """What a run asks of its layout: the precision level (``fp8``: one of fp8lm's), the options
    of `fp8lm.initialize`, FP8 data parallelism's gradient scaling, FSDP2, the pipeline's shape
    (with ``--pp``) and the expert-parallel ranks (``--ep``)."""

    opt_level: str
    fp8: bool
    initialize_options: dict = field(default_factory=dict)
    grad_sync_scaling: str = "local"
    fsdp: bool = False
    pipeline: PipelineShape | None = None
    ep: int = 1  # expert parallelism over this many ranks (`expert.ExpertParallelLayout`)
    autocast_dtype: torch.dtype | None = None  # the torch.autocast every forward runs under (None: none)


def gradient_sync(spec: LayoutSpec, ranks: Ranks, mesh: ParallelMesh, **options) -> GradientSync:
    """The run's `GradientSync` on ``mesh`` for ``spec``'s level, sharding and experts (``options``:
    `GradientSync`'s ``experts`` and ``ep_groups``)."""
    plan = SyncPlan.for_run(ranks.dims, fsdp=spec.fsdp, zero=spec.opt_level == "O3", ep=spec.ep)
    return GradientSync(plan, mesh, fp8=spec.fp8, scaling=spec.grad_sync_scaling, **options)


class Layout:
    """One process: the whole model and optimizer state on this rank, nothing to sync."""

    # What the run prints and records as its layout.
    name = "one process"
    # Whether a forward pass needs every rank (then all ranks evaluate, not rank 0 alone).
    collective_forward = False

    def __init__(self, ranks: Ranks, mesh: ParallelMesh | None = None, sync: GradientSync | None = None) -> None:
        self.ranks, self.mesh = ranks, mesh
        # every gradient sync of the layout, dimension by dimension of the mesh
        self.sync = sync if sync is not None else GradientSync.none()

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks: Ranks) -> bool:
        """Whether this layout is the one for ``spec`` on ``ranks`` (`fp8lm.train.layouts.LAYOUTS`
        are asked in order)."""
        return not ranks.distributed

    @classmethod
    def parallelize(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, spec: LayoutSpec, ranks: Ranks, mesh
    ) -> tuple[nn.Module, torch.optim.Optimizer, Layout]:
        """Convert ``model``/``optimizer`` for the level and spread them as this layout does;
        returns the model to train, the optimizer and the layout."""
        if spec.fp8:
            model, optimizer = initialize(model, optimizer, spec.opt_level, **spec.initialize_options)
        return model, optimizer, cls(ranks, mesh)

    # -- a step ---------------------------------------------------------------------------------

    def core(self, model: nn.Module) -> nn.Module:
        """The model inside any wrapper (this rank's stage): state dicts, evaluation, telemetry."""
        return model

    def forward_backward(self, model: nn.Module, batches: list, loss: Callable) -> torch.Tensor:
        """Forward and backward of a step's micro-batches, ``loss(model, batch)`` each (gradients
        sync on the last one, `GradientSync`); returns the sum of their losses, on the device (no
        host sync)."""
        loss_sum: torch.Tensor | None = None
        for micro, batch in enumerate(batches):
            value = loss(model, batch)
            with self.sync.micro_batch(model, micro == len(batches) - 1):
                (value / len(batches)).backward()
            value = value.detach().float()
            loss_sum = value if loss_sum is None else loss_sum + value
        self.sync.finish(model)
        assert loss_sum is not None
        return loss_sum

    def eval_loss(self, model: nn.Module, batch, loss: Callable) -> torch.Tensor:
        """The loss of the whole model on ``batch`` (every rank that takes part calls it)."""
        return loss(model, batch)

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds (memory reports, telemetry)."""
        return optimizer

    def clip(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` (`fp8lm.clip_grad_norm_`, over the ranks that hold
        parts of them: `GradientSync.clip_options`); returns their norm before clipping."""
        # model.parameters(), not the optimizer's group order: the norm's float sum stays as it was
        return float(clip_grad_norm_(model.parameters(), max_norm, **self.sync.clip_options()))

    def clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[float, bool]:
        """Clip the gradients to ``max_norm`` and step; returns the norm before clipping and whether
        the step was skipped: an inf/NaN gradient skips the update rather than poison the weights."""
        grad_norm = self.clip(model, optimizer, max_norm)
        if isinstance(optimizer, SkipsNonFiniteSteps):  # fp8lm's optimizers skip and count on their own
            optimizer.step()
            skipped = bool(optimizer.last_step_skipped)
        elif math.isfinite(grad_norm):
            optimizer.step()
            skipped = False
        else:
            skipped = True
        self.after_step(model)
        return grad_norm, skipped

    # -- communication ----------------------------------------------------------------------------

    def comm_bytes(self, model: nn.Module, num_params: int) -> float:
        """Bytes this rank sent for the step just taken: fp8lm's collectives count themselves;
        torch's DDP is computed (`GradientSync.uncounted_bytes`)."""
        return comm_stats()["total_bytes"] + self.sync.uncounted_bytes(model, num_params, self.ranks.world)

    def counted_comm(self, model: nn.Module) -> dict | None:
        """The step's counted bytes beyond their total: ``comm_handed_bytes`` (what this rank
        handed to the process group) and ``comm_bytes_by_kind`` (the kinds it used)."""
        stats = comm_stats()
        by_kind = {kind: stats[f"{kind}_bytes"] for kind in KINDS if stats[f"{kind}_calls"]}
        return {"comm_handed_bytes": stats["handed_bytes"], "comm_bytes_by_kind": by_kind}

    # -- checkpoints ------------------------------------------------------------------------------

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
        if state["optimizer"] is None:  # unreachable through fp8lm.train.reshard.plan_reshard
            raise CheckpointError(
                f"checkpoint {state['path']!r} keeps its state in a shard folder (trained under torchrun): load it "
                "with fp8lm.distributed.load_checkpoint"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def data_parallel_state(self, model: nn.Module) -> dict | None:
        """The data-parallel wrapper's own state for the checkpoint (`FP8DataParallel`'s scaling)."""
        return None

    def load_data_parallel_state(self, model: nn.Module, state: dict | None) -> None:
        """Restore what `data_parallel_state` returned."""

    def after_step(self, model: nn.Module) -> None:
        """What the layout does after each optimizer step (FSDP2: agree the FP8 all-gather scales)."""

    def gather_stages(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` of every pipeline stage, stacked in stage order (every rank calls it; one
        stage: ``values[None]``)."""
        return values[None]

    def set_final_bf16(self, bf16: bool) -> None:
        """What the layout changes for ``--final-bf16-fraction``'s BF16 steps (``bf16``) beyond the
        FP8 layers' own switch (pipeline: BF16 stage boundaries); called before every step."""


class ShardedCheckpoints:
    """Checkpoints of every distributed layout: the model and the optimizer in a
    ``step_<step>.dcp/`` folder (`fp8lm.distributed.save_checkpoint`: Distributed Checkpoint,
    parameter names as in the whole model, each rank writing what it alone holds), and no weights
    or optimizer state in the checkpoint file (``model`` and ``optimizer`` are None there)."""

    def save_shards(self, directory: Path, step: int, model: nn.Module, optimizer) -> str:
        name = shards_name(step)
        save_checkpoint(directory / name, model, optimizer)
        return name

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def model_state(self, model: nn.Module) -> None:
        return None

    def load(self, directory: Path, state: dict, model: nn.Module, optimizer) -> None:
        if state.get("optimizer_shards") is None:
            raise CheckpointError(
                f"checkpoint {state['path']!r} holds no sharded state: resume it in the layout that wrote it"
            )
        load_checkpoint(directory / state["optimizer_shards"], model, optimizer)
        self.after_step(model)  # type: ignore[attr-defined]


def point_optimizer_at(optimizer: torch.optim.Optimizer, names: dict[int, str], params: dict[str, nn.Parameter]):
    """The optimizer's parameters replaced by those of the same name in ``params`` (the model's
    after parallelizing; ``names``: the old parameters' names by id), dropping those not there
    (another pipeline stage's)."""
    for group in optimizer.param_groups:
        group["params"] = [params[names[id(p)]] for p in group["params"] if names[id(p)] in params]
