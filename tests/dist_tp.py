"""Worker for tests/test_tensor_parallel.py: a GPT block under FP8 tensor + sequence parallelism
(gloo ranks), next to the same FP8 block in one process and a float64 copy; saves what the test
compares."""

import contextlib
import copy
import sys

import torch

from dist_fsdp_compile import BACKEND
from dist_launch import worker_main

BATCH, SEQ, EMBD, HEADS = 2, 16, 64, 4


def block_plan():
    from fp8lm.train.gpt_parallel import block_plan
    from fp8lm.train.model import GPTConfig

    return block_plan(GPTConfig(n_embd=EMBD, n_head=HEADS))


def local_value(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.dequantize() if hasattr(t, "dequantize") else t.detach().clone()


def storage(p: torch.Tensor) -> tuple:
    local = p.to_local()
    return type(local).__name__, getattr(local, "payload", local).dtype


def block_checks(rank, world) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8lm.distributed import comm_stats, reset_comm_stats
    from fp8lm.nn.convert import convert_linears
    from fp8lm.train.model import Block, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=EMBD, n_head=HEADS)
    block = Block(cfg)
    convert_linears(block)
    reference = copy.deepcopy(block)
    exact = Block(cfg).double()
    exact.load_state_dict({k: v.double() for k, v in reference.state_dict().items()})
    parallelize_module(block, init_device_mesh("cpu", (world,)), block_plan())

    g = torch.Generator().manual_seed(5)
    x, grad_y = torch.randn(BATCH, SEQ, EMBD, generator=g), torch.randn(BATCH, SEQ, EMBD, generator=g)
    x_local = x.chunk(world, 1)[rank].clone().requires_grad_()
    reset_comm_stats()
    y = block(x_local)
    y.backward(grad_y.chunk(world, 1)[rank])
    res = {"stats": comm_stats(), "out": y.detach(), "grad_x": x_local.grad.clone()}
    res["storage"] = {n: storage(p) for n, p in block.named_parameters() if "c_" in n}
    res["grad_storage"] = {n: storage(p.grad) for n, p in block.named_parameters() if "c_" in n}
    for name, model, inp in (("ref", reference, x), ("exact", exact, x.double())):
        inp = inp.clone().requires_grad_()
        out = model(inp)
        out.backward(grad_y.to(out.dtype))
        res[f"{name}_out"], res[f"{name}_grad_x"] = out.detach(), inp.grad
    return res


def named_recipe(name: str):
    """A named recipe, or ``mxfp8-rceil``: mxfp8 with cuBLAS's round-up scales."""
    import fp8lm

    if name == "mxfp8-rceil":
        return fp8lm.Recipe.from_name("mxfp8").replace(mx_rounding="rceil")
    return fp8lm.Recipe.from_name(name)


def recipe_block_checks(rank, world, recipe_name) -> dict:
    """The GPT block of `block_checks` with FP8 layers of a fine-grained recipe: what the first
    column-wise layer takes as its input and what the last row-wise layer's output receives as its
    gradient, after their gathers, next to the same block's in one process; and the gathers'
    bytes and calls."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8lm.distributed import comm_stats, reset_comm_stats
    from fp8lm.nn.convert import convert_linears
    from fp8lm.train.model import Block, GPTConfig

    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=EMBD, n_head=HEADS))
    convert_linears(block, recipe=named_recipe(recipe_name))
    reference = copy.deepcopy(block)
    parallelize_module(block, init_device_mesh("cpu", (world,)), block_plan())
    seen: dict = {}

    def watch(model, tag):
        model.attn.c_attn.register_forward_pre_hook(lambda m, args: seen.__setitem__(f"{tag}_input", args[0].detach()))

        def on_output(m, args, out):  # before the style's reduce-scatter (prepend)
            out.register_hook(lambda g: seen.__setitem__(f"{tag}_grad", g.detach().clone()))

        model.mlp.c_proj.register_forward_hook(on_output, prepend=True)

    watch(block, "tp")
    watch(reference, "one")
    g = torch.Generator().manual_seed(5)
    x, grad_y = torch.randn(BATCH, SEQ, EMBD, generator=g), torch.randn(BATCH, SEQ, EMBD, generator=g)
    x[:, 3] *= 300.0  # an outlier token: one scale per tensor would flatten the others
    reset_comm_stats()
    block(x.chunk(world, 1)[rank].clone().requires_grad_()).backward(grad_y.chunk(world, 1)[rank])
    stats = comm_stats()
    reference(x.clone().requires_grad_()).backward(grad_y)
    return {**seen, "stats": stats, "grad_y": grad_y}


def indivisible_checks(rank, world) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8lm.distributed.tensor_parallel import FP8ColwiseParallel
    from fp8lm.nn import FP8Linear

    try:
        parallelize_module(FP8Linear(16, 3 * world + 1), init_device_mesh("cpu", (world,)), FP8ColwiseParallel())
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def handed_checks(rank, world) -> dict:
    """One call of each `comm` function on tensors of known sizes; what each rank handed over."""
    import torch.distributed as dist

    from fp8lm.distributed import comm, comm_stats, reset_comm_stats

    sent = {"all_reduce": torch.ones(10), "all_gather": torch.ones(3, dtype=torch.float8_e4m3fn)}
    sent |= {"reduce_scatter": torch.ones(4 * world, dtype=torch.bfloat16), "all_to_all": torch.ones(2 * world)}
    reset_comm_stats()
    comm.all_reduce(sent["all_reduce"])
    comm.all_gather(torch.empty(3 * world, dtype=torch.float8_e4m3fn), sent["all_gather"])
    comm.reduce_scatter(torch.empty(4, dtype=torch.bfloat16), sent["reduce_scatter"])
    comm.all_to_all(torch.empty(2 * world), sent["all_to_all"])
    comm.broadcast(torch.ones(5, dtype=torch.int64), src=1)
    if rank == 0:
        comm.send(torch.ones(7, dtype=torch.float16), dst=1)
    elif rank == 1:
        comm.recv(torch.empty(7, dtype=torch.float16), src=0)
    dist.barrier()
    nbytes = {kind: t.nbytes for kind, t in sent.items()}
    nbytes |= {"broadcast": 40 if rank == 1 else 0, "send": 14 if rank == 0 else 0, "recv": 0}
    return {"stats": comm_stats(), "nbytes": nbytes}


def functional_checks(rank, world) -> dict:
    """DTensor's own collectives (a gather, a reduction, a reduce-scatter) and one fp8lm
    collective under `CountedFunctionalCollectives`; then a DTensor gather outside it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from fp8lm.distributed import comm, comm_stats, reset_comm_stats
    from fp8lm.distributed.comm import CountedFunctionalCollectives

    mesh = init_device_mesh("cpu", (world,))
    sharded = DTensor.from_local(torch.ones(3, 5), mesh, (Shard(0),))  # 60 bytes per rank
    partial = DTensor.from_local(torch.ones(4, 5, dtype=torch.bfloat16), mesh, (Partial(),))  # 40 bytes
    to_scatter = DTensor.from_local(torch.ones(2 * world, 3), mesh, (Partial(),))  # 24 * world bytes
    reset_comm_stats()
    with CountedFunctionalCollectives():
        gathered = sharded.redistribute(mesh, (Replicate(),)).to_local()
        reduced = partial.redistribute(mesh, (Replicate(),)).to_local()
        scattered = to_scatter.redistribute(mesh, (Shard(0),)).to_local()
        comm.all_reduce(torch.ones(6))  # 24 bytes, counted once
    inside = comm_stats()
    sharded.redistribute(mesh, (Replicate(),)).to_local()
    outside = comm_stats()
    return {
        "inside": inside,
        "outside": outside,
        "values": (float(gathered.sum()), float(reduced.float().sum()), float(scattered.sum())),
    }


def shared_checks(rank, world) -> dict:
    """Two column-wise projections of one input, each summing its own input gradient (FP8), and
    under `SharedReplicatedInput` (FP8, called by keyword; and torch's fp32 styles, positionally)
    and `PrepareFP8ModuleInput` handing on a replicated DTensor (positionally); with q and k
    switched to high precision, per layer and shared; compiled with ``fullgraph=True``, per layer
    and shared; the input gradients and what each sent, next to the same projections in one
    process."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fp8lm.distributed import (
        FP8ColwiseParallel,
        PrepareFP8ModuleInput,
        SharedReplicatedInput,
        comm_stats,
        reset_comm_stats,
    )
    from fp8lm.distributed.comm import counted_functional_collectives
    from fp8lm.nn.convert import convert_linears

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(EMBD, EMBD), nn.Linear(EMBD, EMBD)
            self.o = nn.Linear(EMBD, EMBD)  # an FP8 layer beside them that does not read the input

        def forward(self, hidden_states):
            return self.q(hidden_states), self.k(hidden_states)

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    x, gq, gk = (torch.randn(BATCH, SEQ, EMBD, generator=g) for _ in range(3))
    cols = slice(rank * EMBD // world, (rank + 1) * EMBD // world)

    def run(model, keyword: bool, compiled: bool = False) -> tuple[torch.Tensor, dict]:
        inp = x.clone().requires_grad_()
        reset_comm_stats()
        # torch's collectives (DTensor's) counted by a dispatch mode, which dynamo does not trace;
        # fp8lm's count themselves in a compiled graph
        with contextlib.nullcontext() if compiled else counted_functional_collectives():
            q, k = model(hidden_states=inp) if keyword else model(inp)
            if q.shape[-1] != EMBD:  # a rank's columns
                gq_, gk_ = gq[..., cols], gk[..., cols]
            else:
                gq_, gk_ = gq, gk
            ((q * gq_).sum() + (k * gk_).sum()).backward()
        return inp.grad.clone(), comm_stats()

    torch.manual_seed(0)
    plain = Pair()
    fp8 = copy.deepcopy(plain)
    convert_linears(fp8)
    res = {}
    res["fp8_ref_grad"], _ = run(copy.deepcopy(fp8), keyword=True)
    res["fp32_grad"], _ = run(copy.deepcopy(plain), keyword=True)
    per_layer = parallelize_module(copy.deepcopy(fp8), mesh, {"q": FP8ColwiseParallel(), "k": FP8ColwiseParallel()})
    res["per_layer_grad"], res["per_layer_stats"] = run(per_layer, keyword=True)
    shared = parallelize_module(copy.deepcopy(fp8), mesh, {"q": FP8ColwiseParallel(), "k": FP8ColwiseParallel()})
    parallelize_module(shared, mesh, SharedReplicatedInput(fp8=True))
    res["shared_grad"], res["shared_stats"] = run(shared, keyword=True)
    prepared = parallelize_module(copy.deepcopy(fp8), mesh, {"q": FP8ColwiseParallel(), "k": FP8ColwiseParallel()})
    keep = PrepareFP8ModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    parallelize_module(prepared, mesh, keep)
    res["prepared_grad"], res["prepared_stats"] = run(prepared, keyword=False)
    for shared_style in (False, True):  # q and k switched to high precision, o not
        switched = parallelize_module(copy.deepcopy(fp8), mesh, {"q": FP8ColwiseParallel(), "k": FP8ColwiseParallel()})
        if shared_style:
            parallelize_module(switched, mesh, SharedReplicatedInput(fp8=True))
        switched.q.high_precision = switched.k.high_precision = True
        key = "switched_shared" if shared_style else "switched_per_layer"
        res[f"{key}_grad"], res[f"{key}_stats"] = run(switched, keyword=True)
    for shared_style in (False, True):  # compiled whole: the FP8 all-reduce traced in the backward
        compiled = parallelize_module(copy.deepcopy(fp8), mesh, {"q": FP8ColwiseParallel(), "k": FP8ColwiseParallel()})
        if shared_style:
            parallelize_module(compiled, mesh, SharedReplicatedInput(fp8=True))
        compiled.compile(fullgraph=True, backend=BACKEND)
        key = "compiled_shared" if shared_style else "compiled_per_layer"
        res[f"{key}_grad"], res[f"{key}_stats"] = run(compiled, keyword=True, compiled=True)
    torch_styles = parallelize_module(copy.deepcopy(plain), mesh, {"q": ColwiseParallel(), "k": ColwiseParallel()})
    parallelize_module(torch_styles, mesh, SharedReplicatedInput(fp8=False))
    res["torch_grad"], res["torch_stats"] = run(torch_styles, keyword=False)
    return res


def checks(rank, world, mode, *args):
    modes = {
        "shared": shared_checks,
        "block": block_checks,
        "recipe_block": recipe_block_checks,
        "indivisible": indivisible_checks,
        "handed": handed_checks,
        "functional": functional_checks,
    }
    return modes[mode](rank, world, *args)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
