"""Pipeline parallelism on the mesh's ``pp`` dimension (``--pp N``): this rank holds one stage of
the GPT (`PipelineStageModule`; a ``--model`` folder's `fp8lm.train.hf_parallel.HFPipelineStage`:
FP8 carriers at the FP8 levels, plain boundaries in BF16 at bf16
and in precision annealing's BF16 steps, FP32 at fp32) and its optimizer state; a step is one ``ScheduleGPipe`` step over the shape's
micro-batches (sends and receives counted by `FP8PipelineStage`), then `GradientSync` sums the
norms' partial gradients over ``tp`` (3-D) and averages every gradient over the data-parallel
replicas (FP8 or FP32), or, with ``--fsdp``, the stage sharded with FSDP2 over the data-parallel
ranks reduce-scatters them during the schedule's backward. The loss, the last stage's, is broadcast to the other stages;
validation runs the stages one after another, micro-batch by micro-batch.

A mixture of experts keeps each block's experts in its stage; with ``--ep N`` they are spread over
groups of N of the stage's data-parallel ranks (at each ``tp`` place under 3-D;
`fp8lm.distributed.ExpertParallelMoE`, as `expert.ExpertParallelLayout` spreads them over all
ranks), kept out of the replicas' average (and of FSDP2) and averaged over their own replicas
instead (`GradientSync`). Each stage's load-balancing losses enter
its own backward (`PipelineStageModule`), and the step's loss adds them to the last stage's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.tensor.parallel import loss_parallel

from ...amp import initialize
from ...distributed import comm, precompute_fp8_scales
from ...distributed.comm import counted_functional_collectives
from ...distributed.expert_parallel import expert_parameters
from ...distributed.pipeline import FP8PipelineStage
from ..gpt_parallel import PipelineStageModule
from ..hf_model import HFCausalLM
from ..hf_parallel import HFPipelineStage
from .base import Layout, LayoutSpec, PipelineShape, ShardedCheckpoints, gradient_sync, point_optimizer_at
from .expert import split_experts
from .fsdp import shard_blocks_and_model
from .tensor import apply_tensor_parallel, replicated_value

__all__ = ["PipelineLayout", "token_loss"]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss from the last stage's logits (`GPT.forward`'s)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class PipelineLayout(ShardedCheckpoints, Layout):
    name = "pipeline parallel"
    collective_forward = True

    @classmethod
    def applies(cls, spec: LayoutSpec, ranks) -> bool:
        return ranks.pp > 1

    @classmethod
    def parallelize(cls, model, optimizer, spec: LayoutSpec, ranks, mesh):
        if spec.pipeline is None:
            raise ValueError("a pipeline layout needs the pipeline's shape (micro-batches, autocast)")
        # each expert group of a stage's data-parallel ranks (at a tp place) spreads its experts
        ep_groups = split_experts(model, optimizer, spec, mesh) if spec.ep > 1 else None
        if spec.fp8:
            model, optimizer = initialize(model, optimizer, spec.opt_level, **spec.initialize_options)
        names = {id(p): name for name, p in model.named_parameters()}
        if ranks.tp > 1:  # 3-D: tensor parallel within each stage first
            apply_tensor_parallel(model, spec, mesh)
        wire = None if spec.fp8 else (torch.bfloat16 if spec.opt_level == "bf16" else torch.float32)
        micro = spec.pipeline.local_batch // spec.pipeline.micro_batches
        if isinstance(model, HFCausalLM):  # a --model folder: whole sequences on every tp rank
            stage = HFPipelineStage(model, mesh["pp"].get_local_rank(), ranks.pp, micro, wire)
        else:
            stage = PipelineStageModule(model, mesh["pp"].get_local_rank(), ranks.pp, micro, wire, seq_shards=ranks.tp)
        experts = {"experts": expert_parameters(stage), "ep_groups": ep_groups} if ep_groups else {}
        sync = gradient_sync(spec, ranks, mesh, **experts)
        if spec.fsdp:
            shard_blocks_and_model(stage, spec, sync)
        params = dict(stage.named_parameters())
        point_optimizer_at(optimizer, names, params)
        if spec.fsdp:
            precompute_fp8_scales(stage)
        return stage, optimizer, cls(ranks, mesh, sync, spec.pipeline, stage)

    def __init__(self, ranks, mesh, sync, shape: PipelineShape, stage: PipelineStageModule) -> None:
        super().__init__(ranks, mesh, sync)
        self.stage, self.shape = stage, shape
        self.pp_group, self.tensor_parallel_loss = mesh.group("pp"), ranks.tp > 1
        self.index, self.n_stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
        self.device = next(stage.parameters()).device
        self.fp8_wire = stage.wire_dtype is None
        self.schedule = self._schedule()

    def _schedule(self) -> ScheduleGPipe:
        """A ``ScheduleGPipe`` over this rank's stage, its receive buffers the stage's boundaries."""
        stage = self.stage
        example = stage.boundary_example(self.device)
        micro, block_size = stage.boundary[:2]
        if stage.first:
            inputs = torch.zeros(micro, block_size, dtype=torch.long, device=self.device)
        else:
            inputs = example.requires_grad_()
        if stage.last:
            outputs = torch.zeros(micro, block_size, stage.lm_head.out_features, device=self.device)
        else:
            outputs = example.clone()
        pipe = FP8PipelineStage(
            stage,
            self.index,
            self.n_stages,
            self.device,
            input_args=inputs,
            output_args=outputs.requires_grad_(),
            group=self.pp_group,
        )
        return ScheduleGPipe(pipe, n_microbatches=self.shape.micro_batches, loss_fn=token_loss)

    def set_final_bf16(self, bf16: bool) -> None:
        """Precision annealing's BF16 steps send the boundaries in BF16, as the bf16 level does, and
        its FP8 steps as FP8 carriers. Every stage switches at the same step, from the step number."""
        if not self.fp8_wire or (self.stage.wire_dtype is not None) == bf16:
            return
        self.stage.set_wire(torch.bfloat16 if bf16 else None)
        self.schedule = self._schedule()

    def forward_backward(self, model: nn.Module, batches: list, loss: Callable) -> torch.Tensor:
        (x, y), losses = batches[0], []  # one micro-batch per step: the schedule splits it (checked)
        with self.shape.autocast, self.tensor_parallel():
            if self.stage.first:
                self.schedule.step(x.to(self.device))
            elif self.stage.last:
                self.schedule.step(target=y.to(self.device), losses=losses)
            else:
                self.schedule.step()
            self.sync.finish(model)
        if losses:
            mean = torch.stack([replicated_value(v).detach().float() for v in losses]).mean().reshape(1)
        else:
            mean = torch.zeros(1, device=self.device)
        aux = self.stage.take_aux_added()
        if aux is None:
            return comm.broadcast(mean, src=self.n_stages - 1, group=self.pp_group)[0]
        # a mixture of experts: the loss is the last stage's plus every stage's load-balancing part
        total = mean + aux.to(mean.device).reshape(1)
        comm.all_reduce(total, dist.ReduceOp.SUM, self.pp_group)
        return total[0]

    def gather_stages(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` of every stage, stacked in stage order (all-gathered over ``pp``)."""
        out = torch.empty(self.n_stages * values.numel(), dtype=values.dtype, device=values.device)
        comm.all_gather(out, values.contiguous().reshape(-1), self.pp_group)
        return out.view(self.n_stages, *values.shape)

    def eval_loss(self, model: nn.Module, batch, loss: Callable) -> torch.Tensor:
        x, y = batch
        pieces = x.shape[0] // self.stage.boundary[0]
        total = torch.zeros(1, device=self.device)
        for mx, my in zip(x.chunk(pieces), y.chunk(pieces), strict=True):
            if self.stage.first:
                h = mx.to(self.device)
            else:
                h = comm.recv(self.stage.boundary_example(self.device), self.index - 1, self.pp_group)
            with self.shape.autocast, self.tensor_parallel():
                h = model(h)
                if self.stage.last:
                    total += replicated_value(token_loss(h, my.to(self.device))) / pieces
            if not self.stage.last:
                comm.send(h.detach(), self.index + 1, self.pp_group)
        return comm.broadcast(total, src=self.n_stages - 1, group=self.pp_group)[0]

    def tensor_parallel(self) -> contextlib.AbstractContextManager:
        """Under 3-D: torch's ``loss_parallel`` (the last stage's logits are vocabulary-sharded)
        with torch's functional collectives counted."""
        if not self.tensor_parallel_loss:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(loss_parallel())
        stack.enter_context(counted_functional_collectives())
        return stack

    def after_step(self, model: nn.Module) -> None:
        if self.sync.plan.dp_shard == "fsdp":
            precompute_fp8_scales(model)
