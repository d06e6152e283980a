"""The GPT's tensor / sequence parallel plan and its pipeline stages (FP8 on every wire).

**Tensor + sequence parallel plan** (`tensor_parallel_plan`, for ``parallelize_module`` on a 1-D
TP mesh, after ``fp8lm.initialize``): the residual stream between blocks is sharded on the
sequence, ``Shard(1)``.

=====================  =============================================================================
module                 style
=====================  =============================================================================
``blocks.0``           `PrepareFP8ModuleInput` ``Replicate() -> Shard(1)`` (the embeddings' output:
                       a local slice; backward all-gathers its gradient in E5M2)
``blocks.*.ln_1/2``    torch's ``SequenceParallel``
``blocks.*.attn``      `PrepareFP8ModuleInput` ``Shard(1) -> Replicate()`` (E4M3 all-gather; in
                       the layers' blocks under rowwise, blockwise, mxfp8)
``...attn.c_attn``     `FP8ColwiseParallel` ``chunks=3`` (each rank keeps its heads' q, k and v)
``...attn.c_q/c_kv``   llama: `FP8ColwiseParallel`, and ``chunks=2`` for k and v (each rank keeps
                       its query heads and the key/value heads they share; ``n_kv_head`` divides
                       by the TP size)
``...attn.c_proj``     `FP8RowwiseParallel` ``output_layouts=Shard(1)`` (FP8 reduce-scatter)
``blocks.*.mlp``       `PrepareFP8ModuleInput` ``Shard(1) -> Replicate()``
``...mlp.c_fc``        `FP8ColwiseParallel` (``chunks=2`` for SwiGLU's gate and up halves)
``...mlp.c_proj``      `FP8RowwiseParallel` ``output_layouts=Shard(1)``
``blocks.*.mlp`` (MoE) `local_slice`: this rank's slice of the sequence, through its whole router
                       and experts (`fp8lm.distributed.SequenceParallelMoE`; no collective but the
                       tokens per expert for the load-balancing loss)
``ln_f``               torch's ``SequenceParallel``
``lm_head``            `FP8ColwiseParallel` ``input_layouts=Shard(1)``, ``use_local_output=False``:
                       vocabulary-sharded logits as a DTensor; compute the loss under torch's
                       ``loss_parallel()`` (the logits are never gathered)
=====================  =============================================================================

The embeddings stay replicated (every rank embeds the whole sequence). After backward,
`fp8lm.distributed.grad_sync.GradientSync` sums the norms' and the mixtures' partial gradients
over the TP group and averages every gradient over the data-parallel group in FP8.

**Pipeline stages** (`PipelineStageModule`): stage ``s`` of ``n`` holds a contiguous run of
blocks; the first also the embeddings, the last also ``ln_f`` and ``lm_head`` (and returns the
logits). Every boundary is an FP8 carrier (`fp8lm.distributed.pipeline`), or a plain one in a
higher precision (the baselines; precision annealing's BF16 steps: `PipelineStageModule.set_wire`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from ..distributed.pipeline import FP8StageInput, FP8StageOutput, carrier_numel
from ..distributed.tensor_parallel import (
    CastPrepareModuleInput,
    ChunkedColwiseParallel,
    FP8ColwiseParallel,
    FP8RowwiseParallel,
    PrepareFP8ModuleInput,
)
from ..nn.moe import MoE
from .model import GPT, GPTConfig, embed

__all__ = [
    "block_plan",
    "local_slice",
    "tensor_parallel_plan",
    "torch_tensor_parallel_plan",
    "PipelineStageModule",
    "stage_blocks",
]


def block_plan(config: GPTConfig) -> dict[str, ParallelStyle]:
    """The plan of one block of a GPT of ``config`` (module docstring, ``blocks.*``), by names
    inside the block: what `tensor_parallel_plan` applies to every block."""
    gather = PrepareFP8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    if config.arch == "llama":  # q, and k with v: each rank keeps its query heads and their key/value heads
        attention = {"c_q": FP8ColwiseParallel(), "c_kv": FP8ColwiseParallel(chunks=2)}
    else:
        attention = {"c_attn": FP8ColwiseParallel(chunks=3)}
    mlp = {
        "mlp": gather,
        "mlp.c_fc": FP8ColwiseParallel(chunks=2 if config.mlp == "swiglu" else 1),
        "mlp.c_proj": FP8RowwiseParallel(output_layouts=Shard(1)),
    }
    return {
        "ln_1": SequenceParallel(),
        "ln_2": SequenceParallel(),
        "attn": gather,
        **{f"attn.{name}": style for name, style in attention.items()},
        "attn.c_proj": FP8RowwiseParallel(output_layouts=Shard(1)),
        **({"mlp": local_slice()} if config.moe_experts else mlp),
    }


def local_slice() -> ParallelStyle:
    """A mixture of experts' input style: this rank's slice of the sequence as a plain tensor (a
    `SequenceParallelMoE` routes it through its whole router and experts; its output is the slice's)."""
    return PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1), use_local_output=True)


def tensor_parallel_plan(config: GPTConfig) -> dict[str, ParallelStyle]:
    """The plan of the module docstring for a GPT of ``config``."""
    return {
        "blocks.0": PrepareFP8ModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
        ),
        **{f"blocks.*.{name}": style for name, style in block_plan(config).items()},
        "ln_f": SequenceParallel(),
        "lm_head": FP8ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }


def torch_tensor_parallel_plan(
    config: GPTConfig, activation_dtype: torch.dtype | None = None
) -> dict[str, ParallelStyle]:
    """The same plan with torch's own styles and collectives, for a plain (not FP8) GPT: the
    higher-precision baseline. Each column-wise layer gathers its sequence-sharded input itself,
    cast to ``activation_dtype`` first (bf16: what BF16 tensor parallelism sends; the norms'
    outputs are FP32 under CPU autocast), except llama's q and k/v layers, whose shared input the
    attention gathers once; the row-wise layers reduce-scatter their outputs in their own dtype
    (BF16 under autocast)."""
    mlp = {
        "blocks.*.mlp.c_fc": ChunkedColwiseParallel(
            input_layouts=Shard(1), chunks=2 if config.mlp == "swiglu" else 1, input_dtype=activation_dtype
        ),
        "blocks.*.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if config.arch == "llama":
        attention = {
            "blocks.*.attn": CastPrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), input_dtype=activation_dtype
            ),
            "blocks.*.attn.c_q": ChunkedColwiseParallel(),
            "blocks.*.attn.c_kv": ChunkedColwiseParallel(chunks=2),
        }
    else:
        attention = {
            "blocks.*.attn.c_attn": ChunkedColwiseParallel(
                input_layouts=Shard(1), chunks=3, input_dtype=activation_dtype
            )
        }
    return {
        "blocks.0": PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
        ),
        "blocks.*.ln_1": SequenceParallel(),
        "blocks.*.ln_2": SequenceParallel(),
        **attention,
        "blocks.*.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        **({"blocks.*.mlp": local_slice()} if config.moe_experts else mlp),
        "ln_f": SequenceParallel(),
        "lm_head": ChunkedColwiseParallel(input_layouts=Shard(1), use_local_output=False, input_dtype=activation_dtype),
    }


def stage_blocks(n_layer: int, stage: int, n_stages: int) -> range:
    """The blocks stage ``stage`` of ``n_stages`` holds: equal contiguous runs."""
    if n_layer % n_stages:
        raise ValueError(f"{n_layer} layers cannot be split into {n_stages} equal pipeline stages: pick a divisor")
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


class _Cast(nn.Module):
    """A plain stage boundary: the activation (and so its gradient) crosses in ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


class _WithAuxLoss(torch.autograd.Function):
    """``x`` as it is; its backward also starts ``aux``'s, with gradient ``weight``. So a stage's
    load-balancing losses reach their routers in the stage's own backward: the schedule's loss is
    the last stage's alone (Megatron-LM attaches its MoE auxiliary loss the same way)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux = weight, (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


class PipelineStageModule(nn.Module):
    """Stage ``stage`` of ``n_stages`` of ``model`` (module docstring); ``micro_batch`` x
    ``block_size`` tokens per micro-batch fix the boundary's shape. ``wire_dtype``: None for FP8
    carriers, else a plain boundary in that dtype (the higher-precision baseline; the receiving
    stage computes in float32 again)."""

    def __init__(
        self,
        model: GPT,
        stage: int,
        n_stages: int,
        micro_batch: int,
        wire_dtype: torch.dtype | None = None,
        seq_shards: int = 1,
    ) -> None:
        super().__init__()
        cfg = model.config
        self.first, self.last = stage == 0, stage == n_stages - 1
        # under sequence parallelism (``seq_shards`` tensor-parallel ranks) a boundary carries this
        # rank's slice of the sequence, to the same tensor-parallel rank of the next stage
        self.boundary = (micro_batch, cfg.block_size // seq_shards, cfg.n_embd)
        self.wte, self.wpe = (model.wte, model.wpe) if self.first else (None, None)
        # keyed by the blocks' indices in the whole model, so the stage's parameter names are the
        # model's (its checkpoints load into any other layout)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in stage_blocks(cfg.n_layer, stage, n_stages)})
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if self.last else (None, None)
        self.set_wire(wire_dtype)
        # a mixture of experts: each block's load-balancing loss weighs coef / n_layer in the
        # training loss (GPT.forward's: coef times their mean over the model's blocks)
        self.moe_aux_weight = cfg.moe_aux_loss_coef / cfg.n_layer
        self.moe_aux_loss: torch.Tensor | None = None  # the last training forward's, mean over this stage's blocks
        self._aux_added: list[torch.Tensor] = []  # what this stage added to the loss, per micro-batch

    def set_wire(self, wire_dtype: torch.dtype | None) -> None:
        """Make the stage's boundaries FP8 carriers (None) or plain ones in ``wire_dtype``: precision
        annealing's BF16 steps send BF16. Every stage must switch at the same step (the receive
        buffers are `boundary_example`'s)."""
        self.wire_dtype = wire_dtype
        entry = FP8StageInput(self.boundary) if wire_dtype is None else _Cast(torch.float32)
        self.entry = None if self.first else entry
        self.exit = None if self.last else (FP8StageOutput() if wire_dtype is None else _Cast(wire_dtype))

    def boundary_example(self, device: torch.device | None = None) -> torch.Tensor:
        """What crosses a boundary of this model, for ``PipelineStage``'s ``input_args`` /
        ``output_args``: an FP8 carrier, or the activation in ``wire_dtype``."""
        if self.wire_dtype is None:
            return torch.empty(carrier_numel(math.prod(self.boundary)), dtype=torch.float32, device=device)
        return torch.empty(self.boundary, dtype=self.wire_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry is None:
            x = embed(self.wte, self.wpe, x)
        else:
            x = self.entry(x)
        for block in self.blocks.values():
            x = block(x)
        if self.training:
            x = self._with_aux_loss(x)
        if self.exit is not None:
            return self.exit(x.to_local() if isinstance(x, DTensor) else x)
        return self.lm_head(self.ln_f(x))

    def _with_aux_loss(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` carrying this stage's blocks' load-balancing losses into its backward (a dense
        stage: ``x``)."""
        taken = [b.mlp.take_aux_loss() for b in self.blocks.values() if isinstance(b.mlp, MoE)]
        losses = [a for a in taken if a is not None]
        if not losses:
            return x
        aux = torch.stack(losses).sum()
        self.moe_aux_loss = aux.detach() / len(losses)
        self._aux_added.append(self.moe_aux_weight * aux.detach().float())
        return _WithAuxLoss.apply(x, aux, self.moe_aux_weight)

    def take_aux_added(self) -> torch.Tensor | None:
        """The mean over the step's micro-batches of what this stage's load-balancing losses added
        to the training loss (None: a dense stage); cleared."""
        added, self._aux_added = self._aux_added, []
        return torch.stack(added).mean() if added else None
