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
``blocks.*.attn``      `PrepareFP8ModuleInput` ``Shard(1) -> Replicate()`` (E4M3 all-gather)
``...attn.c_attn``     `FP8ColwiseParallel` ``chunks=3`` (each rank keeps its heads' q, k and v)
``...attn.c_proj``     `FP8RowwiseParallel` ``output_layouts=Shard(1)`` (FP8 reduce-scatter)
``blocks.*.mlp``       `PrepareFP8ModuleInput` ``Shard(1) -> Replicate()``
``...mlp.c_fc``        `FP8ColwiseParallel` (``chunks=2`` for SwiGLU's gate and up halves)
``...mlp.c_proj``      `FP8RowwiseParallel` ``output_layouts=Shard(1)``
``ln_f``               torch's ``SequenceParallel``
``lm_head``            `FP8ColwiseParallel` ``input_layouts=Shard(1)``, ``use_local_output=False``:
                       vocabulary-sharded logits as a DTensor; compute the loss under torch's
                       ``loss_parallel()`` (the logits are never gathered)
=====================  =============================================================================

The embeddings stay replicated (every rank embeds the whole sequence). After backward,
`finish_tensor_parallel_grads` sums the norms' partial gradients over the TP group and averages
every gradient over the data-parallel group in FP8.

**Pipeline stages** (`PipelineStageModule`): stage ``s`` of ``n`` holds a contiguous run of
blocks; the first also the embeddings, the last also ``ln_f`` and ``lm_head`` (and returns the
logits). Every boundary is an FP8 carrier (`fp8lm.distributed.pipeline`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from ..distributed import comm
from ..distributed.collectives import fp8_all_reduce
from ..distributed.pipeline import FP8StageInput, FP8StageOutput
from ..distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput
from .model import GPT, GPTConfig

__all__ = [
    "tensor_parallel_plan",
    "finish_tensor_parallel_grads",
    "clip_grads_over_",
    "PipelineStageModule",
    "stage_blocks",
]


def tensor_parallel_plan(config: GPTConfig) -> dict[str, ParallelStyle]:
    """The plan of the module docstring for a GPT of ``config``."""
    gather = PrepareFP8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    return {
        "blocks.0": PrepareFP8ModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
        ),
        "blocks.*.ln_1": SequenceParallel(),
        "blocks.*.ln_2": SequenceParallel(),
        "blocks.*.attn": gather,
        "blocks.*.attn.c_attn": FP8ColwiseParallel(chunks=3),
        "blocks.*.attn.c_proj": FP8RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.mlp": gather,
        "blocks.*.mlp.c_fc": FP8ColwiseParallel(chunks=2 if config.mlp == "swiglu" else 1),
        "blocks.*.mlp.c_proj": FP8RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "lm_head": FP8ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }


def finish_tensor_parallel_grads(model: nn.Module, tp_group=None, dp_group=None) -> None:
    """After backward: partial gradients (the sequence-parallel norms') summed over ``tp_group``
    (a plain FP32 all-reduce: they are small), then, with a ``dp_group``, every gradient's local
    tensor averaged over it with the FP8 all-reduce."""
    for p in model.parameters():
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
            local = comm.all_reduce(grad.to_local().contiguous(), group=tp_group)
            grad = DTensor.from_local(local, grad.device_mesh, (Replicate(),), run_check=False)
        if dp_group is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            averaged = fp8_all_reduce(local, dp_group, average=True).to(local.dtype)
            grad = (
                DTensor.from_local(averaged, grad.device_mesh, grad.placements, run_check=False)
                if isinstance(grad, DTensor)
                else averaged
            )
        p.grad = grad


def clip_grads_over_(parameters, max_norm: float, group=None, plain_replicated: bool = False) -> torch.Tensor:
    """``clip_grad_norm_`` for parameters spread over ``group`` (tensor- or pipeline-parallel
    ranks): sharded DTensor gradients count their squares on every rank and sum over the group;
    replicated ones, the same on every rank, count once. Plain gradients are this rank's own (a
    pipeline stage's) or, with ``plain_replicated`` (the embeddings under tensor parallelism), the
    same on every rank. Scales the gradients in place; returns the norm before clipping."""
    summed, replicated = torch.zeros(1), torch.zeros(1)
    grads = [p.grad for p in parameters if p.grad is not None]
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        square = local.float().square().sum().reshape(1)
        if all(isinstance(pl, Replicate) for pl in g.placements) if isinstance(g, DTensor) else plain_replicated:
            replicated += square
        else:
            summed += square
    norm = (comm.all_reduce(summed, group=group) + replicated).sqrt()[0]
    factor = max_norm / (float(norm) + 1e-6)
    if factor < 1.0:
        for g in grads:
            g.mul_(factor)
    return norm


def stage_blocks(n_layer: int, stage: int, n_stages: int) -> range:
    """The blocks stage ``stage`` of ``n_stages`` holds: equal contiguous runs."""
    if n_layer % n_stages:
        raise ValueError(f"{n_layer} layers cannot be split into {n_stages} equal pipeline stages: pick a divisor")
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


class PipelineStageModule(nn.Module):
    """Stage ``stage`` of ``n_stages`` of ``model`` (module docstring); ``micro_batch`` x
    ``block_size`` tokens per micro-batch fix the boundary's shape."""

    def __init__(self, model: GPT, stage: int, n_stages: int, micro_batch: int) -> None:
        super().__init__()
        cfg = model.config
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.wte, self.wpe = (model.wte, model.wpe) if self.first else (None, None)
        self.entry = None if self.first else FP8StageInput((micro_batch, cfg.block_size, cfg.n_embd))
        self.blocks = nn.ModuleList(model.blocks[i] for i in stage_blocks(cfg.n_layer, stage, n_stages))
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if self.last else (None, None)
        self.exit = None if self.last else FP8StageOutput()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry is None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        else:
            x = self.entry(x)
        for block in self.blocks:
            x = block(x)
        if self.exit is not None:
            return self.exit(x)
        return self.lm_head(self.ln_f(x))
