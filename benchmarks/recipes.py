"""Fine-grained recipes against tensorwise scaling: SQNR of each GEMM operand, bits per element,
and the O2 training step time per recipe, as JSON.

Real tensors: a GPT (``--preset``, the main job's ``small`` by default) trains ``--steps`` steps
in BF16 autocast on the default corpus (the Python standard library's bytes), then one more batch
is run with hooks on every linear layer, which keep its input, weight and output gradient. Each
operand is quantized as each recipe's GEMMs read it (`fp8lm.ops.finegrained.quantize_operand`):

- ``input`` and ``weight`` as the forward GEMM reads them, ``grad_output`` as the input-gradient
  GEMM does (along the features);
- ``input_wgrad`` and ``grad_output_wgrad`` as the weight-gradient GEMM does (along the tokens;
  nvfp4 after its random Hadamard transform, which keeps norms, so the SQNR is that of the GEMM's
  operand).

``sqnr_db`` = 10 log10(sum x^2 / sum (x - q(x))^2) per layer; reported are the mean over the
layers, the worst layer, the gain of the mean over tensorwise (``tensorwise-current``: one
power-of-two scale per tensor, the same cast as the fine-grained ones, E5M2 output gradients;
``tensorwise-current-e4m3`` the same with E4M3 ones, as the fine-grained recipes have), and the
fraction of non-zero values that quantize to zero (``underflow_mean``, ``underflow_max``).
``outlier_rows_sqnr_db``: a synthetic 1024 x 1024 normal tensor whose rows 0, 100, ..., 1000 are
10,000 times larger, its SQNR over all rows and over the other rows alone.
``nvfp4-4over6`` is nvfp4 with ``nvfp4_scale_rule="4over6"`` (Four Over Six).
``bits_per_element``: the operand's element and scale bits of each format (nvfp4: 4-bit E2M1 and
an 8-bit scale per 16; the emulation keeps its elements in a byte). ``step_ms``: median wall time
of an O2 training step of the same model with each recipe (`fp8lm.initialize`), CPU.

    python benchmarks/recipes.py --results benchmarks/results/recipes_cpu.json
    python benchmarks/recipes.py --preset tiny --steps 5 --timing-steps 2 --results ''   # smoke
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from common import emit, machine
from torch import nn

import fp8lm
from fp8lm.ops.finegrained import quantize_operand
from fp8lm.ops.gemm import CPUBF16Linear
from fp8lm.ops.hadamard import random_hadamard
from fp8lm.train.data import BatchSampler, pack, stdlib_documents
from fp8lm.train.model import GPT, preset

RECIPES = ("tensorwise-current", "rowwise", "blockwise", "mxfp8", "nvfp4")
OPERANDS = ("input", "weight", "grad_output", "input_wgrad", "grad_output_wgrad")


def sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    x, q = x.double(), q.double()
    noise = (x - q).square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(x.square().sum().item() / noise)


def quantized(x: torch.Tensor, recipe: fp8lm.Recipe, operand: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D, float32) as ``operand`` of ``recipe`` reads it, and its quantized values
    (module doc)."""
    role, dim = operand.removesuffix("_wgrad"), 0 if operand.endswith("_wgrad") else 1
    if dim == 0 and recipe.granularity == "nvfp4":
        x = random_hadamard(x, recipe.hadamard_seed)
    generator = torch.Generator().manual_seed(0)
    return x, quantize_operand(x, recipe, role, dim, generator).dequantize()


def underflow(x: torch.Tensor, q: torch.Tensor) -> float:
    """Fraction of the non-zero values of ``x`` that quantize to zero."""
    nonzero = int(torch.count_nonzero(x))
    return int(torch.count_nonzero((q == 0) & (x != 0))) / nonzero if nonzero else 0.0


def bits_per_element(recipe: fp8lm.Recipe, rows: int, cols: int) -> dict:
    """Element and scale bits per element of an activation (1 x block) and a weight operand."""
    g = recipe.granularity
    if g == "tensorwise":
        return {"activation": 8 + 32 / (rows * cols), "weight": 8 + 32 / (rows * cols)}
    if g == "rowwise":
        return {"activation": 8 + 32 / cols, "weight": 8 + 32 / cols}
    block = recipe.block
    assert block is not None
    if g == "blockwise":
        return {"activation": 8 + 32 / block, "weight": 8 + 32 / block**2}
    if g == "mxfp8":
        return {"activation": 8 + 8 / block, "weight": 8 + 8 / block}
    tensor = 32 / (rows * cols)
    return {"activation": 4 + 8 / block + tensor, "weight": 4 + 8 / block**2 + tensor}


@contextmanager
def bf16_autocast():
    """BF16 autocast as `fp8lm train` runs it on CPU: `CPUBF16Linear` on CPUs without BF16 GEMMs."""
    with CPUBF16Linear(), torch.autocast("cpu", dtype=torch.bfloat16):
        yield


def train_bf16(args) -> tuple[GPT, BatchSampler]:
    torch.manual_seed(args.seed)
    source, docs = stdlib_documents()
    splits = pack(source, docs, args.cache_dir)
    cfg = preset(args.preset)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sampler = BatchSampler(splits.train, args.batch_size, cfg.block_size, args.seed)
    for _ in range(args.steps):
        x, y = sampler.next()
        with bf16_autocast():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, sampler


def capture(model: GPT, batch) -> dict[str, dict[str, torch.Tensor]]:
    """Every linear layer's input, weight and output gradient on ``batch`` (float32, 2-D)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    handles = []
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear):
            keep = tensors.setdefault(name, {"weight": layer.weight.detach().float().clone()})

            def on_input(module, args, keep=keep):
                keep["input"] = args[0].detach().float().reshape(-1, args[0].shape[-1])

            def on_grad(module, grad_input, grad_output, keep=keep):
                keep["grad_output"] = grad_output[0].detach().float().reshape(-1, grad_output[0].shape[-1])

            handles += [layer.register_forward_pre_hook(on_input), layer.register_full_backward_hook(on_grad)]
    with bf16_autocast():
        _, loss = model(*batch)
    loss.backward()
    for handle in handles:
        handle.remove()
    return tensors


def layer_metrics(tensors: dict, recipe: fp8lm.Recipe) -> dict[str, dict[str, list[float]]]:
    """Per operand, the SQNR and underflow of every layer's tensor."""
    out: dict[str, dict[str, list[float]]] = {op: {"sqnr": [], "underflow": []} for op in OPERANDS}
    for kept in tensors.values():
        for operand in OPERANDS:
            x, q = quantized(kept[operand.removesuffix("_wgrad")], recipe, operand)
            out[operand]["sqnr"].append(sqnr_db(x, q))
            out[operand]["underflow"].append(underflow(x, q))
    return out


OUTLIER_ROWS = slice(None, None, 100)  # rows 0, 100, ..., 1000


def outlier_rows() -> torch.Tensor:
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    x[OUTLIER_ROWS] *= 1e4
    return x


def outlier_metrics(recipe: fp8lm.Recipe) -> dict:
    """SQNR of the whole outlier-rows tensor (dominated by the outlier rows) and of its other
    rows alone (what the outlier rows cost the rest), per operand. nvfp4's weight-gradient
    operands mix each 16 rows (its Hadamard transform): no other-rows figure there."""
    x = outlier_rows()
    other = torch.ones(x.shape[0], dtype=torch.bool)
    other[OUTLIER_ROWS] = False
    out = {}
    for operand in OPERANDS:
        xq, q = quantized(x, recipe, operand)
        mixed = operand.endswith("_wgrad") and recipe.granularity == "nvfp4"
        out[operand] = {
            "all_rows_db": round(sqnr_db(xq, q), 2),
            "other_rows_db": None if mixed else round(sqnr_db(xq[other], q[other]), 2),
        }
    return out


def step_ms(model: GPT, sampler: BatchSampler, recipe: str | fp8lm.Recipe, args) -> float:
    """Median wall time of an O2 step of a copy of ``model`` with ``recipe`` (a name or a Recipe; ms)."""
    fp8_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(fp8_model.parameters(), lr=args.lr)
    fp8_model, opt = fp8lm.initialize(fp8_model, opt, "O2", recipe=recipe)
    times = []
    for _ in range(args.timing_steps + 1):
        x, y = sampler.next()
        start = time.perf_counter()
        with bf16_autocast():
            _, loss = fp8_model(x, y)
        loss.backward()
        fp8lm.clip_grad_norm_(fp8_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])  # the first step warms up


def summarize(per_layer: dict, base: dict) -> dict:
    out = {}
    for operand, values in per_layer.items():
        mean = statistics.fmean(values["sqnr"])
        out[operand] = {
            "mean_db": round(mean, 2),
            "worst_db": round(min(values["sqnr"]), 2),
            "vs_tensorwise_db": round(mean - statistics.fmean(base[operand]["sqnr"]), 2),
            "underflow_mean": round(statistics.fmean(values["underflow"]), 6),
            "underflow_max": round(max(values["underflow"]), 6),
        }
    return out


def training_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `train_bf16` (and ``--results``), for the benchmarks that start from it."""
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=200, help="BF16 training steps before the tensors are taken")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "fp8lm" / "tokens"))
    parser.add_argument("--results", default="", help="also write the JSON here")
    return parser


def main(argv=None) -> dict:
    parser = training_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--timing-steps", type=int, default=5, help="O2 steps timed per recipe (0: no timing)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, sampler = train_bf16(args)
    tensors = capture(model, sampler.next())
    recipes = {name: fp8lm.Recipe.from_name(name) for name in RECIPES}
    recipes["tensorwise-current-e4m3"] = recipes["tensorwise-current"].replace(grad_output_format=fp8lm.E4M3)
    recipes["mxfp8-rceil"] = recipes["mxfp8"].replace(mx_rounding="rceil")
    recipes["blockwise-pow2"] = recipes["blockwise"].replace(pow2_scales=True)
    recipes["nvfp4-4over6"] = recipes["nvfp4"].replace(nvfp4_scale_rule="4over6")
    per_layer = {name: layer_metrics(tensors, recipe) for name, recipe in recipes.items()}
    result = {
        "benchmark": "recipes",
        "command": "python benchmarks/recipes.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset,
        "bf16_steps": args.steps,
        "layers": len(tensors),
        "machine": machine(),
        "sqnr_db": {name: summarize(per_layer[name], per_layer["tensorwise-current"]) for name in recipes},
        "outlier_rows_sqnr_db": {name: outlier_metrics(recipe) for name, recipe in recipes.items()},
        "bits_per_element": {name: bits_per_element(r, 4096, 4096) for name, r in recipes.items()},
    }
    if args.timing_steps:
        timed = {name: name for name in ("tensorwise-delayed", *RECIPES)} | {"nvfp4-4over6": recipes["nvfp4-4over6"]}
        result["step_ms"] = {name: round(step_ms(model, sampler, r, args), 1) for name, r in timed.items()}
    emit(result, args.results)
    return result


if __name__ == "__main__":
    main()
