"""The data-parallel side of a training run launched by ``torchrun``: joining the process group,
wrapping the model and optimizer for the level, and the few collectives the loop itself needs.

Levels map to wrappers as follows (one process, or ``WORLD_SIZE`` unset, wraps nothing):

- ``O1``, ``O2``, ``O3``: `fp8lm.distributed.wrap` (FP8 gradient all-reduce through
  `FP8DataParallel`; at O3 the `FP8ZeroOptimizer`'s FP8 reduce-scatter and weight all-gather);
- ``fp32``, ``bf16``: ``torch.nn.parallel.DistributedDataParallel`` (FP32 gradient all-reduce),
  the baseline FP8-LM compares with.

With ``--fsdp`` every level but O3 shards the model with FSDP2 instead (`shard_for_level`), and
the run's state is an `FSDPState`.

With ``--tp N`` or ``--pp N`` (FP8-LM's Level 3) the ranks form a ``DeviceMesh`` of
``(dp, tp)`` or ``(dp, pp)`` (``dp = world / (tp x pp)``): the GPT's tensor + sequence parallel
plan (`fp8lm.train.gpt_parallel`: FP8 styles at O1/O2, torch's own styles with BF16 activations
at bf16, FP32 at fp32) on the ``tp`` dimension, optionally FSDP2 on the ``dp`` dimension
(``--tp N --fsdp``: 2-D), else the gradients averaged over ``dp`` (FP8 all-reduce at the FP8
levels, FP32 like DDP otherwise); or the GPT cut into ``pp`` stages run by torch's
``ScheduleGPipe`` (FP8 carriers at the FP8 levels, plain activations in the level's dtype
otherwise), data-parallel over ``dp``. Their states are `TensorParallelState` and
`PipelineState`; neither writes checkpoints.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from ..amp import initialize
from ..distributed import (
    FP8DataParallel,
    FP8ZeroOptimizer,
    comm,
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
from ..distributed.accounting import KINDS
from ..distributed.comm import CountedFunctionalCollectives
from ..distributed.pipeline import FP8PipelineStage
from ..grad import clip_grad_norm_
from ..optim import SkipsNonFiniteSteps
from .checkpoint import CheckpointError, shards_name
from .config import RunError
from .gpt_parallel import (
    PipelineStageModule,
    clip_grads_over_,
    finish_tensor_parallel_grads,
    tensor_parallel_plan,
    torch_tensor_parallel_plan,
)

__all__ = [
    "Ranks",
    "join",
    "wrap_for_level",
    "unwrap",
    "ReplicatedState",
    "ShardedState",
    "FSDPState",
    "TensorParallelState",
    "PipelineState",
    "shard_for_level",
    "tensor_parallel_for_level",
    "pipeline_for_level",
    "state_layout",
    "accumulating",
    "mean_over_ranks",
    "gather_to_main",
    "broadcast_from_main",
    "barrier",
    "comm_bytes",
    "counted_comm",
    "restarts_allowed",
]

# Bounds every collective: a rank that stops answering makes the others fail instead of hang.
COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Ranks:
    """This process's place: ``rank`` of ``world``, the ranks grouped ``tp`` x ``pp`` per model
    replica (consecutive ranks), ``dp`` replicas."""

    rank: int = 0
    world: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def main(self) -> bool:
        """Rank 0 writes the run's files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def dp(self) -> int:
        """Data-parallel replicas: each draws its own batches."""
        return self.world // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.pp)


def join(tp: int = 1, pp: int = 1) -> Ranks:
    """This process's place in the run: the process group torchrun describes (``WORLD_SIZE`` in the
    environment) is joined once; without torchrun, a single process. ``tp`` x ``pp`` ranks hold
    one model replica: the world size must be a multiple of it."""
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
    return Ranks(rank, world, tp, pp)


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
    pipeline: PipelineShape | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, ReplicatedState]:
    """Convert and parallelize ``model``/``optimizer`` for ``opt_level`` (see the module docstring);
    ``grad_sync_scaling`` is `FP8DataParallel`'s ``scaling``; ``fsdp``: FSDP2 (`shard_for_level`);
    ``ranks.tp`` / ``ranks.pp`` > 1: `tensor_parallel_for_level` / `pipeline_for_level` (which
    needs ``pipeline``). Returns the model, the optimizer and the layout of their state."""
    if ranks.tp > 1:
        return tensor_parallel_for_level(model, optimizer, opt_level, fp8_levels, ranks, initialize_options, fsdp)
    if ranks.pp > 1:
        if pipeline is None:
            raise ValueError("pipeline_for_level needs the pipeline's shape (micro-batches, autocast, device)")
        return pipeline_for_level(model, optimizer, opt_level, fp8_levels, ranks, initialize_options, pipeline)
    if fsdp:
        model, optimizer = shard_for_level(model, optimizer, opt_level, fp8_levels, ranks, initialize_options)
    elif opt_level in fp8_levels:
        model, optimizer = wrap(model, optimizer, opt_level, scaling=grad_sync_scaling, **initialize_options)
    elif ranks.distributed:
        model = nn.parallel.DistributedDataParallel(model)
    return model, optimizer, state_layout(optimizer)


def _fsdp_options(opt_level: str, fp8_levels) -> dict:
    """`fully_shard`'s options for a level: FP8 reduce-scatter at the FP8 levels, torch's BF16
    ``MixedPrecisionPolicy`` at bf16, plain at fp32."""
    options: dict = {"fp8_reduce_scatter": opt_level in fp8_levels}
    if opt_level == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return options


def _point_optimizer_at(optimizer: torch.optim.Optimizer, names: dict[int, str], params: dict[str, nn.Parameter]):
    """The optimizer's parameters replaced by those of the same name in ``params`` (the model's
    after parallelizing; ``names``: the old parameters' names by id), dropping those not there
    (another pipeline stage's)."""
    for group in optimizer.param_groups:
        group["params"] = [params[names[id(p)]] for p in group["params"] if names[id(p)] in params]


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
    if opt_level in fp8_levels:
        model, optimizer = initialize(model, optimizer, opt_level, **initialize_options)
    names = {id(p): name for name, p in model.named_parameters()}
    _shard_blocks_and_model(model, _fsdp_options(opt_level, fp8_levels))
    _point_optimizer_at(optimizer, names, dict(model.named_parameters()))
    precompute_fp8_scales(model)
    return model, optimizer


def _shard_blocks_and_model(model: nn.Module, options: dict) -> None:
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)


def tensor_parallel_for_level(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_level: str,
    fp8_levels,
    ranks: Ranks,
    initialize_options: dict,
    fsdp: bool = False,
) -> tuple[nn.Module, torch.optim.Optimizer, TensorParallelState]:
    """The GPT's tensor + sequence parallel plan on the ``tp`` dimension of a ``(dp, tp)`` mesh:
    `tensor_parallel_plan` (FP8 styles) after `fp8lm.initialize` at the FP8 levels, else
    `torch_tensor_parallel_plan` (BF16 activations at bf16). With ``fsdp``, FSDP2 over the ``dp``
    dimension on top (2-D)."""
    fp8 = opt_level in fp8_levels
    if fp8:
        model, optimizer = initialize(model, optimizer, opt_level, **initialize_options)
    mesh = init_device_mesh(_device_type(model), (ranks.dp, ranks.tp), mesh_dim_names=("dp", "tp"))
    names = {id(p): name for name, p in model.named_parameters()}
    activations = torch.bfloat16 if opt_level == "bf16" else None
    plan = tensor_parallel_plan(model.config) if fp8 else torch_tensor_parallel_plan(model.config, activations)
    parallelize_module(model, mesh["tp"], plan)
    if fsdp:
        _shard_blocks_and_model(model, {**_fsdp_options(opt_level, fp8_levels), "mesh": mesh["dp"]})
    _point_optimizer_at(optimizer, names, dict(model.named_parameters()))
    if fsdp:
        precompute_fp8_scales(model)
    return model, optimizer, TensorParallelState(mesh, fp8, fsdp)


@dataclass(frozen=True)
class PipelineShape:
    """How a pipeline-parallel step runs: ``micro_batches`` per step of ``local_batch`` sequences
    (this replica's), the forward in ``autocast`` (a reusable context manager)."""

    local_batch: int
    micro_batches: int
    autocast: contextlib.AbstractContextManager


def pipeline_for_level(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_level: str,
    fp8_levels,
    ranks: Ranks,
    initialize_options: dict,
    shape: PipelineShape,
) -> tuple[nn.Module, torch.optim.Optimizer, PipelineState]:
    """This rank's stage of the GPT cut into ``pp`` stages on a ``(dp, pp)`` mesh
    (`PipelineStageModule`: FP8 carriers at the FP8 levels, after `fp8lm.initialize`; plain
    boundaries in BF16 at bf16, FP32 at fp32); the optimizer keeps the stage's parameters."""
    fp8 = opt_level in fp8_levels
    if fp8:
        model, optimizer = initialize(model, optimizer, opt_level, **initialize_options)
    mesh = init_device_mesh(_device_type(model), (ranks.dp, ranks.pp), mesh_dim_names=("dp", "pp"))
    names = {id(p): name for name, p in model.named_parameters()}
    wire = None if fp8 else (torch.bfloat16 if opt_level == "bf16" else torch.float32)
    micro = shape.local_batch // shape.micro_batches
    stage = PipelineStageModule(model, mesh["pp"].get_local_rank(), ranks.pp, micro, wire)
    _point_optimizer_at(optimizer, names, {names[id(p)]: p for p in stage.parameters()})
    return stage, optimizer, PipelineState(stage, mesh, shape, fp8)


def _device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a data-parallel wrapper (state dicts, evaluation, memory, telemetry)."""
    return model.module if isinstance(model, (FP8DataParallel, nn.parallel.DistributedDataParallel)) else model


class ReplicatedState:
    """Every rank holds the whole model and optimizer state (one process, `FP8DataParallel`, DDP).
    A state layout answers where the optimizer state lives, how a step is clipped and taken, and
    how the state goes to and from a checkpoint; a new kind of parallelism is a new layout."""

    # Whether a forward pass needs every rank (then all ranks evaluate, not rank 0 alone).
    collective_forward = False
    # Whether the run writes checkpoints (a layout that cannot is refused --resume and --save-every).
    checkpoints = True

    def forward_backward(self, model: nn.Module, batches: list, loss: Callable) -> torch.Tensor:
        """Forward and backward of a step's micro-batches, ``loss(model, batch)`` each (gradients
        sync on the last one); returns the sum of their losses."""
        loss_sum = torch.zeros(())
        for micro, batch in enumerate(batches):
            value = loss(model, batch)
            with accumulating(model, micro == len(batches) - 1):
                (value / len(batches)).backward()
            loss_sum = loss_sum + value.detach().float().cpu()
        return loss_sum

    def eval_loss(self, model: nn.Module, batch, loss: Callable) -> torch.Tensor:
        """The loss of the whole model on ``batch`` (every rank that takes part calls it)."""
        return loss(model, batch)

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


class TensorParallelState(ReplicatedState):
    """Tensor + sequence parallelism on ``mesh["tp"]``: each rank holds its shards of the weights
    (DTensors) and their optimizer state. Forward and backward run under torch's
    ``loss_parallel`` (vocabulary-sharded logits) with torch's own functional collectives counted
    (`CountedFunctionalCollectives`); after backward the norms' partial gradients are summed over
    ``tp`` and, without FSDP2, every gradient averaged over ``dp`` (FP8 or FP32, as the level's
    data parallelism). Clipping is by the global norm (`clip_grads_over_`). No checkpoints."""

    collective_forward = True
    checkpoints = False

    def __init__(self, mesh: DeviceMesh, fp8: bool, fsdp: bool) -> None:
        self.tp_group = mesh["tp"].get_group()
        self.dp_group = mesh["dp"].get_group() if mesh["dp"].size() > 1 and not fsdp else None
        self.fp8, self.fsdp = fp8, fsdp
        self.norm_group = None if fsdp else self.tp_group  # FSDP2 shards over dp too: the whole world

    def forward_backward(self, model: nn.Module, batches: list, loss: Callable) -> torch.Tensor:
        with loss_parallel(), CountedFunctionalCollectives():
            loss_sum = super().forward_backward(model, batches, loss)
            finish_tensor_parallel_grads(model, self.tp_group, self.dp_group, fp8=self.fp8)
        return _replicated_value(loss_sum)

    def eval_loss(self, model: nn.Module, batch, loss: Callable) -> torch.Tensor:
        with loss_parallel(), CountedFunctionalCollectives():
            return _replicated_value(loss(model, batch))

    def clip(self, model: nn.Module, max_norm: float) -> float:
        return float(clip_grads_over_(list(model.parameters()), max_norm, self.norm_group, plain_replicated=True))

    def clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[float, bool]:
        result = super().clip_and_step(model, optimizer, max_norm)
        if self.fsdp:
            precompute_fp8_scales(model)
        return result


def _replicated_value(value: torch.Tensor) -> torch.Tensor:
    """A loss computed under ``loss_parallel`` (a replicated DTensor) as a plain tensor."""
    return value.to_local() if isinstance(value, DTensor) else value


class PipelineState(ReplicatedState):
    """Pipeline parallelism on ``mesh["pp"]``: this rank holds one stage (`PipelineStageModule`)
    and its optimizer state; a step is one ``ScheduleGPipe`` step over the shape's micro-batches
    (sends and receives counted by `FP8PipelineStage`), then every gradient averaged over ``dp``
    (FP8 or FP32). The loss, the last stage's, is broadcast to the other stages; validation runs
    the stages one after another, micro-batch by micro-batch. Clipping is by the global norm over
    the stages. No checkpoints."""

    collective_forward = True
    checkpoints = False

    def __init__(self, stage: PipelineStageModule, mesh: DeviceMesh, shape: PipelineShape, fp8: bool) -> None:
        self.stage, self.shape, self.fp8 = stage, shape, fp8
        self.pp_group = mesh["pp"].get_group()
        self.dp_group = mesh["dp"].get_group() if mesh["dp"].size() > 1 else None
        self.index, self.n_stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
        example = stage.boundary_example()
        micro, block_size = stage.boundary[:2]
        inputs = torch.zeros(micro, block_size, dtype=torch.long) if stage.first else example.requires_grad_()
        outputs = torch.zeros(micro, block_size, stage.lm_head.out_features) if stage.last else example.clone()
        pipe = FP8PipelineStage(
            stage,
            self.index,
            self.n_stages,
            example.device,
            input_args=inputs,
            output_args=outputs.requires_grad_(),
            group=self.pp_group,
        )
        self.schedule = ScheduleGPipe(pipe, n_microbatches=shape.micro_batches, loss_fn=_token_loss)

    def forward_backward(self, model: nn.Module, batches: list, loss: Callable) -> torch.Tensor:
        (x, y), losses = batches[0], []  # one micro-batch per step: the schedule splits it (checked)
        with self.shape.autocast:
            if self.stage.first:
                self.schedule.step(x)
            elif self.stage.last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        if self.dp_group is not None:
            finish_tensor_parallel_grads(model, dp_group=self.dp_group, fp8=self.fp8)
        mean = torch.tensor([sum(float(v.detach()) for v in losses) / len(losses) if losses else 0.0])
        return comm.broadcast(mean, src=self.n_stages - 1, group=self.pp_group)[0]

    def eval_loss(self, model: nn.Module, batch, loss: Callable) -> torch.Tensor:
        x, y = batch
        pieces = x.shape[0] // self.stage.boundary[0]
        total = torch.zeros(1)
        for mx, my in zip(x.chunk(pieces), y.chunk(pieces), strict=True):
            h = mx if self.stage.first else comm.recv(self.stage.boundary_example(), self.index - 1, self.pp_group)
            with self.shape.autocast:
                h = model(h)
            if self.stage.last:
                total += _token_loss(h, my) / pieces
            else:
                comm.send(h.detach(), self.index + 1, self.pp_group)
        return comm.broadcast(total, src=self.n_stages - 1, group=self.pp_group)[0]

    def clip(self, model: nn.Module, max_norm: float) -> float:
        return float(clip_grads_over_(list(model.parameters()), max_norm, self.pp_group))


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss from the last stage's logits (`GPT.forward`'s)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


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


def counted_comm(model: nn.Module) -> dict | None:
    """The step's counted bytes (`comm_stats`) beyond their total: ``comm_handed_bytes`` (what
    this rank handed to the process group) and ``comm_bytes_by_kind`` (the kinds it used); None
    under torch's DDP, whose all-reduce is not counted but computed (`comm_bytes`)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    stats = comm_stats()
    by_kind = {kind: stats[f"{kind}_bytes"] for kind in KINDS if stats[f"{kind}_calls"]}
    return {"comm_handed_bytes": stats["handed_bytes"], "comm_bytes_by_kind": by_kind}
