"""Worker for tests/test_tensor_parallel.py: the "tiny" GPT under its FP8 tensor-parallel plan with
each block compiled as torchtitan-style trainers compile them (``block.compile(fullgraph=True)``),
two forward and backward passes next to the same model in eager mode (gloo ranks): the losses,
every local gradient of the first pass, the scaling state the passes left, and the bytes each
run handed to the process group, or the error the compiled model stopped with. Backend
``aot_eager_decomp_partition`` (tests/dist_fsdp_compile.py says why)."""

import sys

import torch

from dist_fsdp_compile import BACKEND
from dist_launch import worker_main

# tensorwise-delayed: its amax histories in the graph; rowwise, blockwise, mxfp8: their block
# gathers (blockwise at O1: plain weights); nvfp4: its agreed-scale gathers and stochastic rounding
CASES = (
    ("O2", "tensorwise-delayed"),
    ("O2", "rowwise"),
    ("O1", "blockwise"),
    ("O2", "mxfp8"),
    ("O2", "nvfp4"),
)
PASSES = 2


def forward_backward(level: str, recipe: str, compiled: bool) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    import fp8lm
    from fp8lm.distributed import ParallelDims, comm_stats, reset_comm_stats
    from fp8lm.train.gpt_parallel import tensor_parallel_plan
    from fp8lm.train.model import GPT, preset

    torch.manual_seed(0)
    cfg = preset("tiny")
    model, _ = fp8lm.initialize(GPT(cfg), opt_level=level, recipe=recipe)
    parallelize_module(model, ParallelDims(tp=2).build_mesh("cpu")["tp"], tensor_parallel_plan(cfg))
    if compiled:
        for block in model.blocks:
            block.compile(fullgraph=True, backend=BACKEND)
    data = torch.Generator().manual_seed(3)
    losses = []
    reset_comm_stats()
    for step in range(PASSES):
        x, y = (torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=data) for _ in range(2))
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)  # nvfp4's stochastic rounding: the same draws in both runs
        with loss_parallel():
            _, loss = model(x, y)
            loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grads[name] = g.dequantize() if isinstance(g, fp8lm.ScalingTensor) else g.clone()
    sent = comm_stats()
    buffers = {name: b.clone() for name, b in model.named_buffers() if b.is_floating_point()}
    return {"losses": losses, "grads": grads, "buffers": buffers, "comm": sent}


def checks(rank, world):
    res = {}
    for level, recipe in CASES:
        torch._dynamo.reset()
        try:
            compiled = forward_backward(level, recipe, compiled=True)
        except Exception as error:  # reported per case: one failure does not hide the others
            compiled = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
        res[level, recipe] = {"compiled": compiled, "eager": forward_backward(level, recipe, compiled=False)}
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
