"""A mixture of experts under sequence parallelism: each tensor-parallel rank routes its own slice
of the sequence through the whole router and all the experts.

Under tensor + sequence parallelism the residual stream between blocks is sharded on the sequence.
`SequenceParallelMoE` is an `fp8lm.nn.MoE` that takes this rank's slice as it is (no all-gather,
no reduce-scatter: an expert's tokens are whole rows, there is nothing to split in its GEMMs) and
holds every parameter of ``moe`` whole, as the sequence-parallel norms do. What makes the step
that of one process:

- **Gradients**: each rank's gradient of the router and the experts is its tokens' part; after
  backward `fp8lm.distributed.grad_sync.GradientSync` sums them over the group (the experts' FP8
  GEMM weights in FP8, the router in FP32), as it sums the norms'.
- **Load-balancing loss**: Switch's ``E * sum_e f_e * P_e`` is not a sum over tokens (a product
  of two means), so a slice's own loss is not its part of the whole. The tokens routed to each
  expert are summed over the group first (a small int64 all-reduce, on the device), so ``f_e`` is
  the whole sequences'; each rank's part is ``E * sum_e f_e * (its probabilities' sum / all
  tokens)``, and the parts add up to the whole loss, whose value every rank reports (its
  gradient: the part's). Megatron-LM sums the tokens per expert over its tensor-parallel ranks the
  same way. The routed counts (``routed``) are the whole sequences' too.

A ``capacity_factor`` applies to each rank's slice (its first tokens first), as it applies to each
data-parallel rank's batch; the dropped slots are counted over the whole sequences.

With expert parallelism too (``--ep`` with ``--tp``), a mixture that is an
`fp8lm.distributed.ExpertParallelMoE` becomes a `SequenceExpertParallelMoE`: its slice is routed
as above, and its tokens travel to their experts' ranks within its expert group (the data-parallel
ranks at its tensor-parallel place, which hold the same slice of their own sequences). An expert's
gradient is then the sum of its group's tokens at this ``tp`` place: summed over ``tp`` like the
router's, divided by the group's size and averaged over the expert's replicas as under ``--ep``
alone (`fp8lm.distributed.grad_sync`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.checkpoint import is_recomputing
from ..nn.moe import MoE, replace_mixtures
from . import comm
from .expert_parallel import ExpertParallelMoE

__all__ = [
    "SequenceParallelMoE",
    "SequenceExpertParallelMoE",
    "sequence_parallel_experts",
    "sequence_parallel_parameters",
]


class SequenceParallelMoE(MoE):
    """The `MoE` ``moe`` taking this rank's slice of each sequence, the slices spread over
    ``group`` (module docstring); its router, experts and shared expert are ``moe``'s own modules
    (converted or not), so its parameters and their names are ``moe``'s."""

    def __init__(self, moe: MoE, group=None) -> None:
        nn.Module.__init__(self)
        self._share_state_of(moe)
        self.tp_group, self.tp_size = group, comm.check_group(group)[1]

    def balance(self, probs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor):
        """The whole sequences' load-balancing loss (this slice's part as its gradient) and tokens
        routed to each expert (module docstring); every rank's slice holds as many tokens."""
        n = self.tp_size
        counts = counts.clone()
        comm.all_reduce(counts, group=self.tp_group)
        share = counts.to(probs.dtype) / max(experts.numel() * n, 1)
        part = self.num_experts * (share * probs.sum(0) / max(probs.shape[0] * n, 1)).sum()
        whole = part.detach().clone()
        comm.all_reduce(whole, group=self.tp_group)
        return part + (whole - part.detach()), counts

    def _within_capacity(self, flat: torch.Tensor, order: torch.Tensor, counts: torch.Tensor):
        """`MoE`'s capacity on this slice, the dropped slots counted over the whole sequences (as
        ``routed`` is)."""
        before = self.dropped.clone()
        kept = super()._within_capacity(flat, order, counts)
        if self.training and not is_recomputing():  # as MoE counts them: every rank alike
            added = self.dropped - before
            comm.all_reduce(added, group=self.tp_group)
            self.dropped.copy_(before + added)
        return kept

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sequence slices over {self.tp_size} ranks"


class SequenceExpertParallelMoE(SequenceParallelMoE, ExpertParallelMoE):
    """The `ExpertParallelMoE` ``moe`` taking this rank's slice of each sequence, the slices spread
    over ``group`` (the tensor-parallel ranks): routed and balanced as `SequenceParallelMoE` does,
    its tokens exchanged with ``moe``'s expert group as `ExpertParallelMoE` does (module
    docstring). Its parameters are ``moe``'s: the router, the shared expert and this rank's experts."""

    def __init__(self, moe: ExpertParallelMoE, group=None) -> None:
        super().__init__(moe, group)  # SequenceParallelMoE's: shares moe's modules
        self.group, self.ep_rank, self.ep_size, self.fp8 = moe.group, moe.ep_rank, moe.ep_size, moe.fp8

    @classmethod
    def from_moe(cls, moe: MoE, group=None, fp8: bool | None = None) -> SequenceExpertParallelMoE:
        """``cls(moe, group)``: ``moe`` is already an `ExpertParallelMoE`, whose token exchange (its
        expert group, its ``fp8``) this keeps; ``group`` is the tensor-parallel ranks. An ``fp8``
        other than ``moe``'s is refused."""
        if not isinstance(moe, ExpertParallelMoE):
            raise TypeError(
                f"SequenceExpertParallelMoE.from_moe takes an ExpertParallelMoE, got {type(moe).__name__}: "
                "spread its experts with ExpertParallelMoE first"
            )
        if fp8 is not None and fp8 != moe.fp8:
            raise ValueError(f"fp8={fp8} differs from the ExpertParallelMoE's own fp8={moe.fp8}: leave it out")
        return cls(moe, group)


def sequence_parallel_experts(model: nn.Module, group=None) -> nn.Module:
    """Every `MoE` of ``model`` replaced, in place, by its `SequenceParallelMoE` over ``group`` (the
    tensor-parallel ranks; an `ExpertParallelMoE` by its `SequenceExpertParallelMoE`); returns
    ``model``. Before or after `fp8lm.initialize`."""

    def make(moe: MoE) -> SequenceParallelMoE:
        if isinstance(moe, ExpertParallelMoE):
            return SequenceExpertParallelMoE(moe, group)
        return SequenceParallelMoE(moe, group)

    return replace_mixtures(model, make, kinds=(ExpertParallelMoE,))


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model``'s `SequenceParallelMoE` layers: whole on every rank of their
    group, each rank's gradient its slice's part (to be summed over the group)."""
    return [p for m in model.modules() if isinstance(m, SequenceParallelMoE) for p in m.parameters()]
