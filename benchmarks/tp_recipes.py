"""Tensor + sequence parallelism under the fine-grained recipes: the sequence-parallel all-gathers
in the consuming layers' blocks (`fp8lm.distributed.activation_comm.block_all_gather`) against
one E4M3 scale per tensor (the gathers before them), on gloo ranks.

A GPT block (``--width``, 4 heads, ``--tokens`` tokens in 4 sequences, one token 50x the others)
under the GPT's FP8 tensor-parallel plan, next to the same FP8 block in one process and a float64
copy, for each recipe and both gathers: the relative L2 error against float64 of the output, the
input gradient and the weight gradients (those of ``attn.c_proj``, ``mlp.c_fc`` and
``mlp.c_proj``: ``c_attn``'s rows are ordered rank by rank), for tensor parallelism and for one
process, and the distance between the two; and what each rank hands to the collectives in one
step. Mean of ``--seeds`` seeds. ``mxfp8-rceil``: mxfp8 with ``mx_rounding="rceil"`` (nvfp4
gathers per tensor either way). The per-tensor gather is today's
code with `gathers_in_blocks` answering no::

    torchrun --standalone --nproc_per_node 2 benchmarks/tp_recipes.py \\
        --results benchmarks/results/tp_recipes_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, machine  # noqa: E402

import fp8lm  # noqa: E402
import fp8lm.distributed.activation_comm as activation_comm  # noqa: E402
from fp8lm.distributed import comm_stats, reset_comm_stats, setup  # noqa: E402

HEADS, SEQUENCES, OUTLIER = 4, 4, 50.0
WEIGHTS = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def named_recipe(name: str) -> fp8lm.Recipe:
    """A named recipe, or ``mxfp8-rceil``: mxfp8 with cuBLAS's round-up scales."""
    if name == "mxfp8-rceil":
        return fp8lm.Recipe.from_name("mxfp8").replace(mx_rounding="rceil")
    return fp8lm.Recipe.from_name(name)


def values(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.dequantize() if hasattr(t, "dequantize") else t.detach()


def relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact.double()).norm() / exact.double().norm())


def gathered(local: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, 1)


def one_seed(recipe: fp8lm.Recipe, seed: int, width: int, tokens: int, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8lm.nn.convert import convert_linears
    from fp8lm.train.gpt_parallel import block_plan
    from fp8lm.train.model import Block, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig(n_embd=width, n_head=HEADS)
    block = Block(cfg)
    convert_linears(block, recipe=recipe)
    one = copy.deepcopy(block)
    exact = Block(cfg).double()
    exact.load_state_dict({k: v.double() for k, v in one.state_dict().items()})
    parallelize_module(block, init_device_mesh("cpu", (world,)), block_plan(cfg))
    g = torch.Generator().manual_seed(1000 + seed)
    shape = (SEQUENCES, tokens // SEQUENCES, width)
    x, grad_y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    x[:, 3] *= OUTLIER
    x_local = x.chunk(world, 1)[rank].clone().requires_grad_()
    reset_comm_stats()
    y = block(x_local)
    y.backward(grad_y.chunk(world, 1)[rank])
    stats = comm_stats()
    tp = {"out": gathered(y.detach(), world), "grad_x": gathered(x_local.grad, world)}
    tp |= {n: values(p.grad) for n, p in block.named_parameters() if n in WEIGHTS}
    ref = {}
    for name, model, inp in (("one", one, x), ("exact", exact, x.double())):
        inp = inp.clone().requires_grad_()
        out = model(inp)
        out.backward(grad_y.to(out.dtype))
        ref[name] = {"out": out.detach(), "grad_x": inp.grad}
        ref[name] |= {n: values(p.grad) for n, p in model.named_parameters() if n in WEIGHTS}
    result = {}
    for key in ("out", "grad_x"):
        result[f"{key}_tp"] = relative(tp[key], ref["exact"][key])
        result[f"{key}_one"] = relative(ref["one"][key], ref["exact"][key])
        result[f"{key}_tp_vs_one"] = relative(tp[key], ref["one"][key])
    for where, got in (("tp", tp), ("one", ref["one"])):
        result[f"weight_grad_{where}"] = sum(relative(got[n], ref["exact"][n]) for n in WEIGHTS) / len(WEIGHTS)
    for kind in ("all_gather", "all_reduce"):
        result[f"{kind}_handed_bytes"] = stats[f"{kind}_handed_bytes"]
        result[f"{kind}_calls"] = stats[f"{kind}_calls"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="rowwise,blockwise,mxfp8-rceil,mxfp8,nvfp4,tensorwise-delayed")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--results", type=Path, help="write the JSON here too")
    args = ap.parse_args()
    rank, world = setup(timeout_s=600)
    in_blocks = activation_comm.gathers_in_blocks
    out: dict = {"machine": machine(), "world_size": world, "width": args.width, "tokens": args.tokens}
    out["seeds"] = args.seeds
    for name in args.recipes.split(","):
        recipe = named_recipe(name)
        out[name] = {}
        for gather in ("per_tensor", "blocks"):
            # the per-tensor gather: today's code told that no recipe gathers in blocks
            activation_comm.gathers_in_blocks = in_blocks if gather == "blocks" else (lambda *_: False)
            runs = [one_seed(recipe, s, args.width, args.tokens, rank, world) for s in range(args.seeds)]
            out[name][gather] = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        activation_comm.gathers_in_blocks = in_blocks
    if rank == 0:
        emit(out, args.results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
