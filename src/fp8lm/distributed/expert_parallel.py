"""Expert parallelism: a mixture's experts spread over the ranks of a group, each token sent to
the rank of its expert and its output sent back, with all-to-alls in FP8.

`ExpertParallelMoE` is an `fp8lm.nn.MoE` of which this rank holds the experts
``[rank * E / N, (rank + 1) * E / N)`` (router and shared expert whole, on every rank). Its forward
routes as the MoE does, then:

- **dispatch**: the routed token rows, sorted by expert, go to their experts' ranks in E4M3 with a
  power-of-two scale per row and 128 features (`fp8lm.nn.saved.quantize_groups`), the scale sent
  as its exponent in one byte next to the row's payload (one all-to-all);
- the local experts run on the rows they received (their FP8 GEMMs with a scale per expert);
- **combine**: the outputs go back to the tokens' ranks the same way, E4M3; there they are
  weighted and summed per token in FP32, as in one process.

Backward, each all-to-all's gradient travels the other way in E5M2 with the same per-row scales.
How many rows go where is exchanged first (a small int64 all-to-all); the split sizes of the row
all-to-alls are then read on the host, the layer's one host synchronization (a collective's split
sizes are host integers; every other count stays on the device). Every call goes through
`fp8lm.distributed.comm` and is counted under ``expert_all_to_all`` in `comm_stats`. With ``fp8=False``
the rows travel as they are (BF16 under autocast): the baseline the FP8 bytes compare with. So do
the rows of the dispatch while the experts' c_fc is switched to high precision (a fallback,
precision annealing: ``high_precision``), and those of the combine while c_proj is, so that a
switched layer takes and gives one process's values.

Gradients: an expert's weight gradient sums the contributions of every rank's tokens. Where each
rank's loss is the mean over its own batch and the other parameters' gradients are averaged over
the ranks (data parallelism over the same group), divide the experts' gradients by the group size
too: the result is then that of one process on all ranks' batches.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import E4M3, E5M2, Format
from ..nn.grouped import ExpertWeights, GroupedLinear
from ..nn.moe import MoE, replace_mixtures
from ..nn.saved import GROUP_SIZE, dequantize_groups, quantize_groups
from ..tensor import switched_to_high_precision
from . import comm

__all__ = [
    "ExpertParallelMoE",
    "expert_parallel",
    "expert_parameters",
    "pack_rows",
    "unpack_rows",
    "fp8_all_to_all",
    "TOKEN_FORMAT",
    "GRADIENT_FORMAT",
]

TOKEN_FORMAT: Format = E4M3
GRADIENT_FORMAT: Format = E5M2
KIND = "expert_all_to_all"  # what comm_stats counts the exchanges under
_NAN_EXPONENT = -128  # the exponent byte of a non-finite group's scale (read back as NaN)


def pack_rows(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Rows of ``x`` (T, C) as bytes (T, C + G): each row's ``fmt`` payload and, per group of
    `GROUP_SIZE` features (G groups; the whole row where 128 does not divide C), the exponent of
    its power-of-two scale as an int8 (-128: a group holding inf or NaN)."""
    payload, scale = quantize_groups(x, fmt, GROUP_SIZE)
    exponent = torch.log2(torch.nan_to_num(scale, nan=1.0)).round().to(torch.int8)
    exponent = torch.where(torch.isnan(scale), _NAN_EXPONENT, exponent).to(torch.int8)
    return torch.cat([payload.view(torch.uint8), exponent.view(torch.uint8)], dim=1)


def unpack_rows(wire: torch.Tensor, columns: int, fmt: Format, dtype: torch.dtype) -> torch.Tensor:
    """The values `pack_rows` packed, as ``dtype`` (exact: FP8 values times powers of two)."""
    payload = wire[:, :columns].contiguous().view(fmt.dtype)
    exponent = wire[:, columns:].contiguous().view(torch.int8).float()
    scale = torch.where(exponent == _NAN_EXPONENT, torch.nan, torch.exp2(exponent))
    return dequantize_groups(payload, scale, dtype)


def fp8_all_to_all(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], fmt: Format, group=None
) -> torch.Tensor:
    """Rows ``x`` (T, C) sent to the ranks of ``group`` (``send_splits[j]`` rows to rank ``j``, in
    rank order) as `pack_rows` bytes; the rows received (``recv_splits[i]`` from rank ``i``), in
    ``x``'s dtype."""
    columns = x.shape[1]
    wire = pack_rows(x.detach(), fmt)
    out = torch.empty((sum(recv_splits), wire.shape[1]), dtype=torch.uint8, device=x.device)
    comm.all_to_all(out, wire, group, output_splits=recv_splits, input_splits=send_splits, kind=KIND)
    return unpack_rows(out, columns, fmt, x.dtype)


class _FP8AllToAll(torch.autograd.Function):
    """`fp8_all_to_all` in ``fmt``; its gradient goes back in ``grad_fmt``."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], fmt: Format, grad_fmt: Format, group):
        ctx.splits, ctx.grad_fmt, ctx.group = (send_splits, recv_splits), grad_fmt, group
        return fp8_all_to_all(x, send_splits, recv_splits, fmt, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return fp8_all_to_all(grad.contiguous(), recv_splits, send_splits, ctx.grad_fmt, ctx.group), *([None] * 5)


class _AllToAll(torch.autograd.Function):
    """The rows sent as they are (no FP8: the bf16 and fp32 baselines); the gradient goes back alike."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _plain_all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _plain_all_to_all(grad.contiguous(), recv_splits, send_splits, ctx.group), None, None, None


def _plain_all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = torch.empty((sum(recv_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_to_all(out, x.detach().contiguous(), group, output_splits=recv_splits, input_splits=send_splits, kind=KIND)
    return out


class ExpertParallelMoE(MoE):
    """The `MoE` ``moe`` with only this rank's experts of those spread over ``group`` (module
    docstring); its router, activation and shared expert are ``moe``'s own modules, its expert
    weights ``moe``'s parameters (``moe`` itself is left whole). Build it from a plain MoE, before
    `fp8lm.initialize` (or use `expert_parallel` for a whole model)."""

    def __init__(self, moe: MoE, group=None, fp8: bool = True) -> None:
        rank, size = comm.check_group(group)
        if moe.num_experts % size:
            raise ValueError(
                f"{moe.num_experts} experts do not divide over {size} expert-parallel ranks: pick a divisor"
            )
        if type(moe.c_fc) is not GroupedLinear or type(moe.c_proj) is not GroupedLinear:
            raise TypeError("ExpertParallelMoE splits a plain MoE's experts: apply it before fp8lm.initialize")
        nn.Module.__init__(self)
        self._share_state_of(moe)
        self.group, self.ep_rank, self.ep_size, self.fp8 = group, rank, size, fp8
        local = range(rank * moe.num_experts // size, (rank + 1) * moe.num_experts // size)
        self.c_fc = _local_experts(moe.c_fc, local)
        self.c_proj = _local_experts(moe.c_proj, local)

    @classmethod
    def from_moe(cls, moe: MoE, group=None, fp8: bool = True) -> ExpertParallelMoE:
        """``cls(moe, group, fp8)``."""
        return cls(moe, group, fp8)

    @property
    def local_experts(self) -> range:
        """The (global) indices of the experts this rank holds."""
        local = self.num_experts // self.ep_size
        return range(self.ep_rank * local, (self.ep_rank + 1) * local)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        size, local = self.ep_size, self.num_experts // self.ep_size
        send_counts = counts.reshape(size, local)  # row j: the rows for rank j's experts
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all(recv_counts, send_counts.contiguous(), self.group, kind=KIND)  # row i: from rank i
        # the one host read of the layer: the all-to-all's split sizes (both ways at once)
        send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        # A layer switched to high precision (a fallback, precision annealing) takes and gives its
        # rows as they are, not FP8-rounded: the dispatch feeds c_fc, the combine carries c_proj's.
        received = self._exchange(x, send_splits, recv_splits, not switched_to_high_precision(self.c_fc))
        # rows arrive by (source rank, expert): regroup them by expert for the grouped GEMMs
        expert_of_row = torch.arange(local, device=x.device).repeat(size)
        expert_of_row = expert_of_row.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_splits))
        order = expert_of_row.argsort(stable=True)
        counts_here = torch.zeros_like(counts)  # the experts held elsewhere get no rows
        counts_here[self.local_experts.start : self.local_experts.stop] = recv_counts.sum(0)
        y = super().run_experts(received[order], counts_here)
        back = torch.empty_like(y).index_copy(0, order, y)
        return self._exchange(back, recv_splits, send_splits, not switched_to_high_precision(self.c_proj))

    def _exchange(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], fp8: bool) -> torch.Tensor:
        """An all-to-all of rows: FP8 (``self.fp8`` and ``fp8``), else as they are."""
        if self.fp8 and fp8:
            return _FP8AllToAll.apply(x, send_splits, recv_splits, TOKEN_FORMAT, GRADIENT_FORMAT, self.group)
        return _AllToAll.apply(x, send_splits, recv_splits, self.group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, experts={self.local_experts.start}..{self.local_experts.stop - 1} of {self.ep_size} ranks"


def _local_experts(layer: GroupedLinear, experts: range) -> GroupedLinear:
    """A GroupedLinear holding ``layer``'s weights of ``experts`` (the same parameters, under the
    same names ``weight.<expert>``) and None for the others."""
    local = GroupedLinear(layer.num_experts, layer.in_features, layer.out_features, device="meta")
    local.weight = ExpertWeights(local, (w if e in experts else None for e, w in enumerate(layer.weight)))
    return local


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights this rank holds in ``model``'s `ExpertParallelMoE` layers (no other rank
    holds them: not to be synchronized as data-parallel replicas)."""
    return [
        w
        for m in model.modules()
        if isinstance(m, ExpertParallelMoE)
        for layer in (m.c_fc, m.c_proj)
        for _, w in layer.held_weights()
    ]


def expert_parallel(model: nn.Module, group=None, fp8: bool = True) -> nn.Module:
    """Every `MoE` of ``model`` replaced, in place, by its `ExpertParallelMoE` over ``group``
    (``fp8``: FP8 all-to-alls; False: the rows as they are, a baseline); returns ``model``. Call
    it on the plain model, before `fp8lm.initialize`."""
    return replace_mixtures(model, lambda moe: ExpertParallelMoE(moe, group, fp8))
