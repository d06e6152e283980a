"""Worker for tests/test_tensor_parallel.py: the "tiny" GPT under its FP8 tensor-parallel plan with
each block compiled (``block.compile()``, graph breaks allowed), one forward and backward next
to the same model in eager mode (gloo ranks): the loss and every local gradient, or the error the
compiled model stopped with. Backend ``aot_eager_decomp_partition`` (tests/dist_fsdp_compile.py
says why)."""

import sys

import torch

from dist_fsdp_compile import BACKEND
from dist_launch import worker_main

CASES = (("O2", "tensorwise-delayed"), ("O1", "blockwise"))  # blockwise: its block gathers, O1's plain weights


def forward_backward(level: str, recipe: str, compiled: bool) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    import fp8lm
    from fp8lm.distributed import ParallelDims
    from fp8lm.train.gpt_parallel import tensor_parallel_plan
    from fp8lm.train.model import GPT, preset

    torch.manual_seed(0)
    cfg = preset("tiny")
    model, _ = fp8lm.initialize(GPT(cfg), opt_level=level, recipe=recipe)
    parallelize_module(model, ParallelDims(tp=2).build_mesh("cpu")["tp"], tensor_parallel_plan(cfg))
    if compiled:
        for block in model.blocks:
            block.compile(backend=BACKEND)
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g) for _ in range(2))
    with loss_parallel():
        _, loss = model(x, y)
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads[name] = g.dequantize() if isinstance(g, fp8lm.ScalingTensor) else g.clone()
    return {"loss": float(loss.detach()), "grads": grads}


def checks(rank, world):
    res = {}
    for level, recipe in CASES:
        torch._dynamo.reset()
        try:
            compiled = forward_backward(level, recipe, compiled=True)
        except Exception as error:  # reported per case: one failure does not hide the other
            compiled = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
        res[level, recipe] = {"compiled": compiled, "eager": forward_backward(level, recipe, compiled=False)}
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
