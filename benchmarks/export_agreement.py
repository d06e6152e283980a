"""How faithfully an export serves the model fp8lm trained: each run's checkpoint exported as
``hf`` (BF16) and ``hf-fp8`` (E4M3 linear weights, compressed-tensors), loaded with
``transformers`` on the CPU as a user would (BF16, the dtype the folder names), and compared with
fp8lm's own model of the checkpoint (its opt level, recipe and saved scaling state, BF16
autocast: what the run's validation computes) on held-out tokens of the run's validation split.

    PYTHONPATH=src python benchmarks/export_agreement.py --run o2=runs/o2 --run fsdp=runs/fsdp \\
        --tokens 1000 > benchmarks/results/export_agreement_cpu.json

Per run and format: ``agreement`` (share of positions whose most likely next token is fp8lm's),
``mean_kl`` (KL(fp8lm || export) of the next-token distributions, nats, mean over positions),
``perplexity`` (of the held-out tokens) and ``size_bytes`` (the folder on disk); fp8lm's own
perplexity as ``reference_perplexity``. The same GPT without FP8 GEMMs (FP32, the checkpoint's
weights) is a second reference, ``vs_high_precision``: it separates what the export changes from
what FP8 activations change (fp8lm's forward quantizes each linear layer's input to E4M3; the
exports run their activations in BF16).

``--input-activations fp8`` also measures, for runs whose model has ``nn.Linear`` layers
(``--arch llama``), the ``hf-fp8`` export with FP8 inputs (W8A8, ``hf-fp8-w8a8``: transformers'
compressed-tensors runtime quantizes each linear layer's input per batch). ``--serve-dir DIR``
keeps each run's exports there (``DIR/NAME-hf``, ``DIR/NAME-hf-fp8``, ``DIR/NAME-hf-fp8-w8a8``)
with ``DIR/NAME-reference.json``: the held-out windows, their targets, fp8lm's most likely next
token at each position and its log-probability of the target, which
``benchmarks/vllm_serve.py`` compares a serving engine against.

Two more references against the FP32 GPT say where the gap to fp8lm's model comes from:
``bf16_vs_high_precision``, the same GPT under BF16 autocast without FP8 (BF16 arithmetic alone),
and with ``--fp8-recipes NAME,...`` ``recipes_vs_high_precision``: the checkpoint's weights run
with each named recipe's FP8 casts at the run's level (scales from each batch; a recipe with finer
scales than the run's shows whether the inputs' scales are what costs agreement);
``high_precision_top2_gap_quantiles``: how close the FP32 GPT's two most likely next tokens are.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from fp8lm.export import FORMATS  # noqa: E402
from fp8lm.train.data import pack, run_documents  # noqa: E402
from fp8lm.train.export import (  # noqa: E402
    export_run,
    full_weights,
    read_run_checkpoint,
    run_autocast,
    run_initialize_options,
    run_model,
)
from fp8lm.train.hf_model import build_model  # noqa: E402
from fp8lm.train.model import GPT  # noqa: E402


def held_out(run: Path, state: dict, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``: windows of the run's context length, evenly spaced over its
    validation split, ``tokens`` predictions in all (the last window cut short)."""
    config = state.get("config") or {}
    source, docs = run_documents(config.get("data"))
    split = pack(source, docs, run / "cache", config.get("val_fraction", 0.05)).val
    block = state["model_config"].block_size
    count = math.ceil(tokens / block)
    starts = torch.linspace(0, len(split) - block - 1, count).long().tolist()
    windows = torch.tensor([list(split[s : s + block + 1]) for s in starts], dtype=torch.long)
    return windows[:, :-1], windows[:, 1:]


def logits_of(model, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(inputs)
    return (out.logits if hasattr(out, "logits") else out[0]).double()


def compare(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, tokens: int) -> dict:
    ref = F.log_softmax(reference.reshape(-1, reference.shape[-1])[:tokens], dim=-1)
    got = F.log_softmax(logits.reshape(-1, logits.shape[-1])[:tokens], dim=-1)
    target = targets.reshape(-1)[:tokens]
    return {
        "agreement": (ref.argmax(-1) == got.argmax(-1)).double().mean().item(),
        "mean_kl": (ref.exp() * (ref - got)).sum(-1).mean().item(),
        "perplexity": math.exp(F.nll_loss(got, target).item()),
    }


def recipe_model(state: dict, weights: dict, recipe: str):
    """The checkpoint's model at its level with ``recipe``'s FP8 casts (no saved scaling state)."""
    from fp8lm import Recipe, initialize

    model = build_model(state["model_config"])
    model.load_state_dict(weights)
    options = {**run_initialize_options(state), "recipe": Recipe.from_name(recipe)}
    model, _ = initialize(model, None, state["opt_level"], **options)
    return model.eval()


def measure(
    run: Path, tokens: int, work: Path, w8a8: bool = False, name: str | None = None, recipes: tuple[str, ...] = ()
) -> dict:
    from transformers import AutoModelForCausalLM

    state = read_run_checkpoint(run)
    inputs, targets = held_out(run, state, tokens)
    weights = full_weights(state)
    with run_autocast(state):
        reference = logits_of(run_model(state, weights), inputs)
    plain = GPT(state["model_config"])
    plain.load_state_dict(weights)
    high_precision = logits_of(plain.eval(), inputs)
    result = {
        "checkpoint": Path(state["path"]).name,
        "opt_level": state.get("opt_level"),
        "recipe": (state.get("config") or {}).get("recipe"),
        "layout": state.get("layout"),
        "world_size": len(state["ranks"]),
        "tokens": min(tokens, targets.numel()),
        "reference_perplexity": compare(reference, reference, targets, tokens)["perplexity"],
        "high_precision_perplexity": compare(high_precision, high_precision, targets, tokens)["perplexity"],
        "high_precision": compare(reference, high_precision, targets, tokens),
    }
    # how near ties the FP32 GPT's predictions are: the gap between its two most likely tokens'
    # log-probabilities (nats), at a few quantiles over the positions
    top2 = high_precision.reshape(-1, high_precision.shape[-1])[:tokens].topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    result["high_precision_top2_gap_quantiles"] = {str(q): gaps.quantile(q).item() for q in (0.01, 0.02, 0.05)}
    with run_autocast(state):
        # as "high_precision" compares fp8lm's model: KL(this || FP32), the FP32 GPT's perplexity
        result["bf16_vs_high_precision"] = compare(logits_of(plain, inputs), high_precision, targets, tokens)
        result["recipes_vs_high_precision"] = {
            recipe: compare(logits_of(recipe_model(state, weights, recipe), inputs), high_precision, targets, tokens)
            for recipe in recipes
        }
    exports = {fmt: (fmt, "bf16") for fmt in FORMATS}
    if w8a8 and getattr(state["model_config"], "arch", None) == "llama":
        exports["hf-fp8-w8a8"] = ("hf-fp8", "fp8")
    prefix = name or run.name
    if name is not None:  # kept for a serving engine: the windows and fp8lm's predictions
        reference_json = {
            "run": name,
            "checkpoint": result["checkpoint"],
            "inputs": inputs.tolist(),
            "targets": targets.tolist(),
            "reference_argmax": reference.argmax(-1).tolist(),
            "reference_target_logprob": F.log_softmax(reference, -1).gather(-1, targets[..., None])[..., 0].tolist(),
        }
        (work / f"{prefix}-reference.json").write_text(json.dumps(reference_json))
    for key, (fmt, activations) in exports.items():
        folder = export_run(run, work / f"{prefix}-{key}", fmt, input_activations=activations)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()  # BF16, as config.json says
        logits = logits_of(model, inputs)
        result[key] = compare(reference, logits, targets, tokens)
        hp = compare(high_precision, logits, targets, tokens)
        result[key]["vs_high_precision"] = {"agreement": hp["agreement"], "mean_kl": hp["mean_kl"]}
        result[key]["dtype"] = str(model.dtype).removeprefix("torch.")
        result[key]["size_bytes"] = sum(f.stat().st_size for f in folder.iterdir())
        result[key]["weights_bytes"] = (folder / "model.safetensors").stat().st_size
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, metavar="NAME=RUN_DIR", help="a run to export")
    parser.add_argument("--tokens", type=int, default=1000, help="held-out next-token predictions (default: 1000)")
    parser.add_argument(
        "--input-activations",
        default="bf16",
        choices=("bf16", "fp8"),
        help="fp8: also the W8A8 hf-fp8 export of --arch llama runs (default: %(default)s)",
    )
    parser.add_argument("--serve-dir", help="keep the hf-fp8 exports and fp8lm's predictions here (a new folder)")
    parser.add_argument("--fp8-recipes", default="", help="also these recipes' FP8 casts against FP32 (NAME,...)")
    args = parser.parse_args()
    runs = dict(spec.split("=", 1) for spec in args.run)
    w8a8 = args.input_activations == "fp8"
    recipes = tuple(r for r in args.fp8_recipes.split(",") if r)
    if args.serve_dir:
        Path(args.serve_dir).mkdir(parents=True, exist_ok=False)
        results = {
            name: measure(Path(path), args.tokens, Path(args.serve_dir), w8a8, name, recipes)
            for name, path in runs.items()
        }
    else:
        with tempfile.TemporaryDirectory() as work:
            results = {
                name: measure(Path(path), args.tokens, Path(work), w8a8, recipes=recipes) for name, path in runs.items()
            }
    print(json.dumps({"machine": machine(), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
