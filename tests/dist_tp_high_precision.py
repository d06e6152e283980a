"""Worker for tests/test_tp_high_precision.py: a GPT block under FP8 tensor + sequence parallelism
(gloo ranks) with its FP8 layers switched to high precision (as a fallback or precision annealing
switches them), next to the same block in one process switched alike; then switched back; then
with only its column-wise layers switched. Saves
each phase's outputs, input and weight gradients, and the collectives' bytes."""

import copy
import sys

import torch

from dist_launch import worker_main
from dist_tp import BATCH, EMBD, HEADS, SEQ, block_plan, local_value


def run(block, x, grad_y, rank=None, world=None) -> dict:
    """Forward and backward of ``block`` (this rank's sequence shard when ``rank`` is given): the
    whole output, input gradient and weight gradients, and the bytes handed to each collective."""
    import torch.distributed as dist

    from fp8lm.distributed import comm_stats, reset_comm_stats

    if rank is not None:
        x, grad_y = x.chunk(world, 1)[rank], grad_y.chunk(world, 1)[rank]
    x = x.clone().requires_grad_()
    reset_comm_stats()
    y = block(x)
    y.backward(grad_y)
    stats = comm_stats()
    out, grad_x = y.detach(), x.grad
    if rank is not None:  # the whole sequence, in rank order
        parts = [[torch.empty_like(t) for _ in range(world)] for t in (out, grad_x)]
        for gathered, t in zip(parts, (out, grad_x)):
            dist.all_gather(gathered, t.contiguous())
        out, grad_x = (torch.cat(p, 1) for p in parts)
    grads = {n: model_order(block, n, local_value(p.grad)) for n, p in block.named_parameters() if "c_" in n}
    block.zero_grad(set_to_none=True)
    kinds = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")
    return {"out": out, "grad_x": grad_x, "grads": grads, "bytes": {k: stats[f"{k}_handed_bytes"] for k in kinds}}


def model_order(block, name: str, t: torch.Tensor) -> torch.Tensor:
    """A whole gradient in the model's row order: a fused layer's rows (``row_chunks``: ``k``
    blocks sharded separately) are gathered rank by rank."""
    module_name, _, param = name.rpartition(".")
    chunks, world = getattr(block.get_submodule(module_name), "row_chunks", {}).get(param, (1, 1))
    if chunks == 1:
        return t
    per_rank = [r.chunk(chunks) for r in t.chunk(world)]
    return torch.cat([per_rank[r][c] for c in range(chunks) for r in range(world)])


def switch(blocks, high: bool, names: tuple[str, ...] | None = None) -> None:
    """Every FP8 layer of ``blocks`` (or those whose names end with one of ``names``)."""
    for block in blocks:
        for name, m in block.named_modules():
            if hasattr(m, "high_precision") and (names is None or name.endswith(names)):
                m.high_precision = high


def checks(rank, world) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8lm.nn.convert import convert_linears
    from fp8lm.train.model import Block, GPTConfig

    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=EMBD, n_head=HEADS))
    convert_linears(block)
    reference = copy.deepcopy(block)
    parallelize_module(block, init_device_mesh("cpu", (world,)), block_plan())
    g = torch.Generator().manual_seed(5)
    x, grad_y = torch.randn(BATCH, SEQ, EMBD, generator=g), torch.randn(BATCH, SEQ, EMBD, generator=g)
    res = {}
    for phase, high in (("fp8", False), ("high", True), ("back", False)):
        switch((block, reference), high)
        res[phase] = run(block, x, grad_y, rank, world)
        res[phase]["ref"] = run(reference, x, grad_y)
    # the column-wise layers alone (c_attn, c_fc), the row-wise c_proj left in FP8
    switch((block,), True, names=("c_attn", "c_fc"))
    res["column_wise"] = run(block, x, grad_y, rank, world)
    switch((block,), False)
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
