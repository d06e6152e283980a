"""Collectives counted inside graphs that torch.compile traces: each run of a compiled forward and
backward counts what it issues, once, in the pass that issues it (no process group needed: the
counting alone)."""

import pytest
import torch

from fp8lm.distributed import accounting


class _Counted(torch.autograd.Function):
    """Counts an all-gather of its input forward and an all-reduce of its gradient backward, as the
    tensor-parallel styles' Functions do."""

    @staticmethod
    def forward(ctx, x):
        y = x * 2
        accounting.record("all_gather", 4 * y.numel(), 2, 2 * y.numel(), y)
        ctx.save_for_backward(y)  # saved: the forward's count must not move to the backward
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        g = grad * y
        accounting.record("all_reduce", 4 * g.numel(), 2, 4 * g.numel(), g)
        return g


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _Counted.apply(self.linear(x)).sin()


@pytest.mark.parametrize("backend", ["aot_eager", "aot_eager_decomp_partition"])
def test_compiled_blocks_count_each_collective_once_per_run(backend):
    torch._dynamo.reset()
    blocks = torch.nn.Sequential(_Block(), _Block())  # two graphs: each counts only its own
    for block in blocks:
        block.compile(fullgraph=True, backend=backend)
    accounting.reset_comm_stats()
    try:
        for _ in range(3):
            blocks(torch.randn(2, 8, requires_grad=True)).sum().backward()
        with torch.no_grad():  # a forward alone counts its forward's collectives
            blocks(torch.randn(2, 8))
        stats = accounting.comm_stats()
    finally:
        accounting.reset_comm_stats()
    assert stats["all_gather_calls"] == 2 * 4 and stats["all_reduce_calls"] == 2 * 3
    assert stats["all_gather_handed_bytes"] == 8 * 2 * 16 and stats["all_reduce_handed_bytes"] == 6 * 4 * 16
    assert stats["all_reduce_bytes"] == 6 * accounting.collective_bytes("all_reduce", 4 * 16, 2)


def test_a_compiled_count_needs_the_tensor_it_sends():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def count(x):
        accounting.record("all_reduce", 64, 2, 64)
        return x + 1

    with pytest.raises(Exception, match="needs the tensor it sends"):
        count(torch.ones(2))
    accounting.reset_comm_stats()
