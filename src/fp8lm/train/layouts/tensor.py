"""Tensor + sequence parallelism on the mesh's ``tp`` dimension (``--tp N``), optionally with
FSDP2 over the data-parallel ranks (``--tp N --fsdp``: 2-D).

The GPT's plan (`fp8lm.train.gpt_parallel`): FP8 styles at O1/O2, torch's own styles with BF16
activations at bf16, FP32 at fp32. Forward and backward run under torch's ``loss_parallel``
(vocabulary-sharded logits) with torch's functional collectives counted while `comm_stats` is on
(`CountedFunctionalCollectives`, while `accounting.counting()`); after backward `GradientSync`
sums the norms' partial gradients over ``tp`` and, without FSDP2, averages every gradient over the
data-parallel replicas (FP8 or FP32, as the level's data parallelism). A ``--model`` folder is
split by the plan its ``transformers`` architecture declares (`fp8lm.train.hf_parallel`: no
sequence parallelism).

A mixture of experts is a `SequenceParallelMoE` on every rank (each routes its slice of the
sequence through all the experts); with ``--ep N`` its experts are first spread over groups of N
data-parallel ranks at each ``tp`` place (`expert.split_experts`), its tokens sent to their
experts' ranks (`SequenceExpertParallelMoE`), the experts kept out of FSDP2 and of the replicas'
average and averaged over their own replicas instead (`GradientSync`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from ...amp import initialize
from ...distributed import precompute_fp8_scales
from ...distributed.comm import counted_functional_collectives
from ...distributed.expert_parallel import expert_parameters
from ...distributed.sequence_moe import sequence_parallel_experts
from ..gpt_parallel import tensor_parallel_plan, torch_tensor_parallel_plan
from ..hf_model import HFCausalLM
from ..hf_parallel import hf_tensor_parallel_plan
from .base import Layout, LayoutSpec, ShardedCheckpoints, gradient_sync, point_optimizer_at
from .expert import split_experts
from .fsdp import shard_blocks_and_model

__all__ = ["TensorParallelLayout", "apply_tensor_parallel", "replicated_value"]


def apply_tensor_parallel(model: nn.Module, spec: LayoutSpec, mesh) -> None:
    """The GPT's tensor + sequence parallel plan on ``mesh["tp"]``, for the level: FP8 styles
    (after `fp8lm.initialize`), else torch's with the level's activations on the wire; a mixture
    of experts as `SequenceParallelMoE`s. A ``--model`` folder: the plan its ``transformers``
    architecture declares (`fp8lm.train.hf_parallel`)."""
    if isinstance(model, HFCausalLM):  # a --model folder: the plan its architecture declares
        parallelize_module(model, mesh["tp"], hf_tensor_parallel_plan(model, spec.fp8))
        return
    activations = torch.bfloat16 if spec.opt_level == "bf16" else None
    sequence_parallel_experts(model, mesh.group("tp"))  # each rank routes its slice of the sequence
    plan = tensor_parallel_plan(model.config) if spec.fp8 else torch_tensor_parallel_plan(model.config, activations)
    parallelize_module(model, mesh["tp"], plan)


def replicated_value(value: torch.Tensor) -> torch.Tensor:
    """A loss computed under ``loss_parallel`` (a replicated DTensor) as a plain tensor."""
    return value.to_local() if isinstance(value, DTensor) else value


class TensorParallelLayout(ShardedCheckpoints, Layout):
    name = "tensor parallel"
    collective_forward = True

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return ranks.tp > 1 and ranks.pp == 1

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        # with --ep: the experts spread over the data-parallel ranks at each tp place
        ep_groups = split_experts(model, optimizer, spec, mesh) if spec.ep > 1 else None
        if spec.fp8:
            model, optimizer = initialize(model, optimizer, spec.opt_level, **spec.initialize_options)
        names = {id(p): name for name, p in model.named_parameters()}
        apply_tensor_parallel(model, spec, mesh)
        experts = {"experts": expert_parameters(model), "ep_groups": ep_groups} if ep_groups else {}
        sync = gradient_sync(spec, ranks, mesh, **experts)
        if spec.fsdp:
            shard_blocks_and_model(model, spec, sync)
        point_optimizer_at(optimizer, names, dict(model.named_parameters()))
        if spec.fsdp:
            precompute_fp8_scales(model)
        return model, optimizer, cls(ranks, mesh, sync)

    def forward_backward(self, model: nn.Module, batches: list, loss: Callable) -> torch.Tensor:
        with loss_parallel(), counted_functional_collectives():
            return replicated_value(super().forward_backward(model, batches, loss))

    def eval_loss(self, model: nn.Module, batch, loss: Callable) -> torch.Tensor:
        with loss_parallel(), counted_functional_collectives():
            return replicated_value(loss(model, batch))

    def after_step(self, model: nn.Module) -> None:
        if self.sync.plan.dp_shard == "fsdp":
            precompute_fp8_scales(model)
