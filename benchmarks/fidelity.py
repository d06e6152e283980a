"""Loss fidelity of the FP8 levels: paired runs over seeds, one FP8 choice changed at a time.

Every job is one `fp8lm train` run of the main job (default preset, same options) at one seed
with one variant: a level plus `fp8lm.initialize` options (a policy override, scaling, history
length, ...). The gap of a job is ``(val_loss - bf16's val_loss at the same seed) / bf16's``;
fp32's gap at the same seeds is the noise floor. Jobs run in child processes, ``--jobs`` at a
time, single-threaded so that a run's numbers do not depend on the machine's load; finished jobs
are kept in ``--out/results.jsonl`` and not rerun, so an interrupted ablation continues.

    python benchmarks/fidelity.py --seeds 0,1,2 --variants bf16,fp32,O2,O2-head-grad-bf16
    python benchmarks/fidelity.py --list
    python benchmarks/fidelity.py --init-from CKPT --lr 1e-3 --steps 300 --seeds 0 --variants bf16,O2,O2-m-fp16
    python benchmarks/fidelity.py --arch llama --init-from CKPT --lr 4e-4 --steps 300 --seeds 0,1 --variants bf16,O2
    python benchmarks/fidelity.py --model tiny --moe-experts 8 --moe-top-k 2 --seeds 0,1 --variants bf16,O2,O2-act-mlp-bf16
    python benchmarks/fidelity.py --eval-bf16 --seeds 0,1,2 --variants bf16,fp32,O2-nvfp4

The last is a continuation probe: every variant trains from the same checkpoint's weights (a
fresh optimizer, constant lr), which measures a choice's cost at that point of a long run for a
fraction of the run's time; with ``--lr 1e-12 --steps 1`` it measures the validation loss of the
checkpoint's weights as each variant evaluates them (the FP8 forward's own cost). ``--eval-bf16``
trains nothing: it validates the finished runs' final weights with every GEMM in BF16, which
separates what a recipe costs the trained weights from what its forward costs the validation.

Prints one JSON object: per variant, the gap at each seed, their mean and standard deviation,
and the mean gap minus fp32's (the FP8 cost above the noise floor); for runs of 2,000 steps or
more the same over each run's evaluations from a fifth of the steps on (``*_from_step_N_pct``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

# One variant: (level, fp8lm.initialize options). Policy overrides are module-name patterns of
# fp8lm.train.model.GPT: lm_head, wte and wpe (embeddings), blocks.*.attn.*, blocks.*.mlp.*.
FINE_GRAINED_RECIPES = ("rowwise", "rowwise-wgrad-bf16", "blockwise", "mxfp8", "nvfp4")
_HI = {"fp8_gemm": False, "weight": "FP32", "grad": "FP32", "exp_avg": "FP32", "exp_avg_sq": "FP32"}
VARIANTS: dict[str, tuple[str, dict]] = {
    "fp32": ("fp32", {}),
    "bf16": ("bf16", {}),
    "O1": ("O1", {}),
    "O2": ("O2", {}),
    # layer types kept in high precision (GEMMs in BF16, FP32 weight, gradient and moments)
    "O2-head-hp": ("O2", {"policy": {"lm_head": _HI}}),
    "O2-emb-hp": ("O2", {"policy": {"wte": _HI, "wpe": _HI}}),
    "O2-attn-hp": ("O2", {"policy": {"*.attn.*": _HI}}),
    "O2-mlp-hp": ("O2", {"policy": {"*.mlp.*": _HI}}),
    # the attention projections' GEMMs in BF16, their storage and optimizer states as O2's
    "O2-attn-gemm-bf16": ("O2", {"policy": {"*.attn.*": {"fp8_gemm": False}}}),
    "O1-attn-gemm-bf16": ("O1", {"policy": {"*.attn.*": {"fp8_gemm": False}}}),
    # one FP8 choice of the output head at a time (the defaults: BF16 GEMMs, BF16 weight gradient)
    "O2-head-gemm-fp8": ("O2", {"policy": {"lm_head": {"fp8_gemm": True}}}),
    "O2-head-gemm-bf16": ("O2", {"policy": {"lm_head": {"fp8_gemm": False}}}),
    "O2-head-grad-bf16": ("O2", {"policy": {"lm_head": {"grad": "BF16"}}}),
    "O2-head-grad-e5m2": ("O2", {"policy": {"lm_head": {"grad": "E5M2"}}}),
    "O2-head-m-fp32": ("O2", {"policy": {"lm_head": {"exp_avg": "FP32"}}}),
    "O2-head-grad-m": ("O2", {"policy": {"lm_head": {"grad": "BF16", "exp_avg": "FP16"}}}),
    # every layer
    "O2-grad-bf16": ("O2", {"policy": {"*": {"grad": "BF16"}}}),
    "O2-grad-e5m2": ("O2", {"policy": {"*": {"grad": "E5M2"}}}),
    "O2-m-fp16": ("O2", {"policy": {"*": {"exp_avg": "FP16"}}}),
    "O2-v-fp32": ("O2", {"policy": {"*": {"exp_avg_sq": "FP32"}}}),
    "O2-master-fp32": ("O2", {"policy": {"*": {"weight": "FP32", "exp_avg": "FP32", "exp_avg_sq": "FP32"}}}),
    "O2-gemm-bf16": ("O2", {"policy": {"*": {"fp8_gemm": False}}}),
    # scaling (fp8lm.Recipe fields): current scaling, amax history length, margin, output-gradient format
    "O2-current": ("O2", {"recipe": {"scaling": "current"}}),
    "O2-hist1": ("O2", {"recipe": {"history_len": 1}}),
    "O2-hist64": ("O2", {"recipe": {"history_len": 64}}),
    "O2-margin1": ("O2", {"recipe": {"margin": 1}}),
    "O2-gradout-e4m3": ("O2", {"recipe": {"grad_output_format": "E4M3"}}),
    # the output-head rule of the default policy undone (the head's weight gradient in E4M3)
    "O2-head-grad-e4m3": ("O2", {"policy": {"lm_head": {"grad": "E4M3"}}}),
    "O1-head-grad-e4m3": ("O1", {"policy": {"lm_head": {"grad": "E4M3"}}}),
    "O1-head-hp": ("O1", {"policy": {"lm_head": _HI}}),
    "O1-head-grad-bf16": ("O1", {"policy": {"lm_head": {"grad": "BF16"}}}),
    "O1-grad-e5m2": ("O1", {"policy": {"*": {"grad": "E5M2"}}}),
    "O1-gemm-bf16": ("O1", {"policy": {"*": {"fp8_gemm": False}}}),
    "O1-head-gemm-bf16": ("O1", {"policy": {"lm_head": {"fp8_gemm": False}}}),
    "O1-head-gemm-fp8": ("O1", {"policy": {"lm_head": {"fp8_gemm": True}}}),
    "O1-master-fp32": ("O1", {"policy": {"*": {"weight": "FP32"}}}),  # O1's default since FP32 weights
    # O1's linear weights as scaled FP16 (O1's default before, O2's storage)
    "O1-weight-fp16": ("O1", {"policy": {p: {"weight": "FP16"} for p in ("*.c_*.weight", "lm_head.weight")}}),
    "O1-grad-bf16": ("O1", {"policy": {"*": {"grad": "BF16"}}}),
    # what autograd saves outside the linear layers (norm and activation-function inputs) in E4M3
    # (O2's default since its 5-seed comparison; O2-act-bf16 is O2 as it was before)
    "O2-act-fp8": ("O2", {"activations": "fp8"}),
    "O2-act-bf16": ("O2", {"activations": "bf16"}),
    "O1-act-fp8": ("O1", {"activations": "fp8"}),
    # O2's FP8-saved activations with one kind of module back to saving them as computed
    "O2-act-norm-bf16": ("O2", {"policy": {"*ln_*": {"activations": "bf16"}}}),
    "O2-act-attn-bf16": ("O2", {"policy": {"*.sdpa": {"activations": "bf16"}}}),
    "O2-act-mlp-bf16": ("O2", {"policy": {"*.mlp.*": {"activations": "bf16"}}}),
    # the whole output head in FP8 (GEMMs and E4M3 weight gradient): preset("O2", output_head=False)
    "O2-head-fp8": ("O2", {"output_head": False}),
    # the fine-grained recipes (docs/recipes.md), the output head as the default policy keeps it
    # (BF16 GEMMs and weight gradient), and with the whole head in FP8 under the recipe ("-head-fp8")
    **{f"O2-{name}": ("O2", {"recipe": name}) for name in FINE_GRAINED_RECIPES},
    **{f"O2-{name}-head-fp8": ("O2", {"recipe": name, "output_head": False}) for name in FINE_GRAINED_RECIPES},
    # nvfp4 with NVIDIA's selective high precision (arXiv 2509.25149: about 15 % of the linear layers,
    # at the end, in BF16): the last block's MLP of the main job's 4 blocks (17 % of the blocks'
    # GEMM weights), or its whole last block (25 %)
    "O2-nvfp4-last-mlp-bf16": ("O2", {"recipe": "nvfp4", "policy": {"blocks.3.mlp.*": {"fp8_gemm": False}}}),
    "O2-nvfp4-last-block-bf16": ("O2", {"recipe": "nvfp4", "policy": {"blocks.3.*": {"fp8_gemm": False}}}),
    # where nvfp4's cost sits: one kind of layer's GEMMs in BF16 (the attention projections, or the
    # MLP's), or every layer's weight-gradient GEMM in BF16 (its forward and input-gradient GEMMs 4-bit)
    "O2-nvfp4-attn-bf16": ("O2", {"recipe": "nvfp4", "policy": {"*.attn.*": {"fp8_gemm": False}}}),
    "O2-nvfp4-mlp-bf16": ("O2", {"recipe": "nvfp4", "policy": {"*.mlp.*": {"fp8_gemm": False}}}),
    "O2-nvfp4-wgrad-bf16": ("O2", {"recipe": {"name": "nvfp4", "weight_grad_gemm": "bf16"}}),
    # nvfp4's GEMMs at O1 (FP32 weights and Adam moments; weight gradients E4M3 as at O2): how much
    # of its gap O2's FP16 weights and FP8 / FP16 moments add
    "O1-nvfp4": ("O1", {"recipe": "nvfp4"}),
    # Four Over Six: each nvfp4 block scaled to 6 or to 4, whichever rounds it closer
    "O2-nvfp4-4over6": ("O2", {"recipe": {"name": "nvfp4", "nvfp4_scale_rule": "4over6"}}),
    "O2-nvfp4-4over6-attn-bf16": (
        "O2",
        {"recipe": {"name": "nvfp4", "nvfp4_scale_rule": "4over6"}, "policy": {"*.attn.*": {"fp8_gemm": False}}},
    ),
    # precision annealing (arXiv 2509.25149): the last fifth of the steps (and so the final validation)
    # with every FP8 layer's GEMMs in BF16 (TrainConfig.final_bf16_fraction, under "train"); "-10": the last tenth
    "O2-nvfp4-final-bf16": ("O2", {"recipe": "nvfp4", "train": {"final_bf16_fraction": 0.2}}),
    "O2-nvfp4-4over6-final-bf16": (
        "O2",
        {"recipe": {"name": "nvfp4", "nvfp4_scale_rule": "4over6"}, "train": {"final_bf16_fraction": 0.2}},
    ),
    "O2-nvfp4-4over6-final-bf16-10": ("O2", {"recipe": "nvfp4-4over6", "train": {"final_bf16_fraction": 0.1}}),
    # mxfp8 with cuBLAS's scale rounding (RCEIL: no block's amax saturates) instead of the OCP spec's
    # floor, which clips a block's amax by up to 12.5 % (docs/measurements/recipes.md)
    "O2-mxfp8-rceil": ("O2", {"recipe": {"name": "mxfp8", "mx_rounding": "rceil"}}),
    "O2-mxfp8-rceil-head-fp8": ("O2", {"recipe": {"name": "mxfp8", "mx_rounding": "rceil"}, "output_head": False}),
}


def _run(job: dict) -> dict:
    """One training run in this (child) process; returns its result line (the one already in
    ``results.jsonl``, marked ``reused``, when another ablation process finished it meanwhile)."""
    done = _done(Path(job["out"]).parent / "results.jsonl").get((job["variant"], job["seed"], job["steps"]))
    if done is not None:
        return {**done, "reused": True}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from fp8lm.train.loop import train

    cfg = train_config(job)
    start = time.perf_counter()
    summary = train(cfg)
    return {
        **job,
        "val_loss": summary["val_loss"],
        "train_loss": summary["train_loss"],
        "bytes_per_param": summary["bytes_per_param"],
        "skipped_steps": summary["skipped_steps"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def train_config(job: dict):
    """The `fp8lm.train.config.TrainConfig` of one job."""
    from fp8lm.train.config import TrainConfig

    level, options = variant_options(job["variant"])
    # long runs checkpoint every 500 steps and continue from there (bit for bit) when restarted
    save_every = 500 if job["steps"] > 1000 else 0
    return TrainConfig(
        opt_level=level,
        seed=job["seed"],
        steps=job["steps"],
        out=job["out"],
        cache_dir=job["cache_dir"],
        progress=False,
        telemetry_every=0,
        amp_options=options,
        device="cpu",
        save_every=save_every,
        resume=save_every > 0 and (Path(job["out"]) / "checkpoints").is_dir(),
        **job.get("train", {}),
        **variant_train_fields(job["variant"]),
    )


def bf16_validation(job: dict) -> float:
    """A finished job's validation loss recomputed from its final checkpoint with every GEMM in
    BF16: the plain GPT with the run's final weights under the run's BF16 autocast (what its FP8
    layers compute in high precision, and what its ``hf`` export computes). For a bf16 job it is
    the loss the run recorded."""
    import torch

    from fp8lm.train.data import eval_batches, pack, run_documents
    from fp8lm.train.export import full_weights, read_run_checkpoint
    from fp8lm.train.model import GPT
    from fp8lm.train.run import BF16Autocast
    from fp8lm.train.tokenizer import tokenize

    cfg = train_config(job)
    state = read_run_checkpoint(job["out"])
    source, docs = run_documents(cfg.data, cfg.hf_dataset)
    splits, _ = tokenize(
        pack(source, docs, cfg.cache_dir, cfg.val_fraction), cfg.tokenizer_spec(), cfg.vocab_size, cfg.cache_dir
    )
    model = GPT(state["model_config"])
    model.load_state_dict(full_weights(state))
    batches = eval_batches(splits.val, cfg.eval_batches, cfg.batch_size, state["model_config"].block_size)
    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            with BF16Autocast("cpu"):
                total += model.eval()(x, y)[1].item()
    return total / len(batches)


def _continuation(args) -> dict:
    """TrainConfig fields of a continuation probe (``--init-from``), else none."""
    if not args.init_from:
        return {}
    return {
        "init_from": args.init_from,
        "lr": args.lr,
        "warmup_steps": min(30, args.steps // 10),
        "min_lr_ratio": 1.0,
        "eval_batches": 16,
    }


def train_options(args) -> dict:
    """TrainConfig fields every job of this invocation shares: the model (when not the main job's
    GPT: architecture, size, experts) and a continuation probe's."""
    model = {"arch": args.arch} if args.arch != "gpt" else {}
    if args.model != "small":
        model["model"] = args.model
    if args.moe_experts:
        model.update(moe_experts=args.moe_experts, moe_top_k=args.moe_top_k)
    return {**_continuation(args), **model}


def variant_train_fields(variant: str) -> dict:
    """The `fp8lm.train.config.TrainConfig` fields a `VARIANTS` entry sets (its ``"train"``), beyond
    the opt level and fp8lm.initialize options."""
    return dict(VARIANTS[variant][1].get("train", {}))


def variant_options(variant: str) -> tuple[str, dict]:
    """``(level, fp8lm.initialize options)`` of a `VARIANTS` entry: a recipe is a name, or fields
    that change the default fp8lm.Recipe (formats by name), or the named one's with ``"name"``; ``"output_head": False`` becomes the
    policy ``fp8lm.policy.preset(level, output_head=False)``."""
    from fp8lm.formats import format_of
    from fp8lm.policy import preset
    from fp8lm.recipe import Recipe

    level, options = VARIANTS[variant]
    options = {k: v for k, v in options.items() if k != "train"}  # TrainConfig fields: variant_train_fields
    if isinstance(options.get("recipe"), dict):
        fields = {k: format_of(v) if k.endswith("_format") else v for k, v in options["recipe"].items()}
        named = fields.pop("name", None)  # a named recipe with some fields changed
        options = {**options, "recipe": Recipe.from_name(named).replace(**fields) if named else Recipe(**fields)}
    if "output_head" in options:
        options = {k: v for k, v in options.items() if k != "output_head"}
        assert "policy" not in options  # a variant names one or the other
        options["policy"] = preset(level, output_head=VARIANTS[variant][1]["output_head"])
    return level, options


def time_steps(variants: list[str], rounds: int, steps: int) -> dict:
    """Step time of each variant on the main job's model and batch shape, one thread, in
    interleaved rounds (the machine's load hits all variants alike): the minimum over rounds of
    the mean time of ``steps`` steps, in ms, and its ratio to the first variant."""
    import torch

    import fp8lm
    from fp8lm.ops.gemm import CPUBF16Linear
    from fp8lm.train.model import GPT, preset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (16, 128))
    runs = {}
    for name in variants:
        level, options = variant_options(name)
        model = GPT(preset("small"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if level not in ("fp32", "bf16"):
            model, opt = fp8lm.initialize(model, opt, level, **options)
        runs[name] = (model, opt, level != "fp32")

    def step(model, opt, autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), CPUBF16Linear():
            loss = model(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    best = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name in variants:
            step(*runs[name])  # warm
            start = time.perf_counter()
            for _ in range(steps):
                step(*runs[name])
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
    first = best[variants[0]]
    return {name: {"step_ms": round(1e3 * t, 1), "ratio": round(t / first, 3)} for name, t in best.items()}


def _results(pool, first: list[dict], rest: list[dict]):
    yield from pool.imap(_run, first)  # submitted only after the first jobs finished
    yield from pool.imap_unordered(_run, rest)


def _done(results: Path) -> dict[tuple, dict]:
    if not results.exists():
        return {}
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(r["variant"], r["seed"], r["steps"]): r for r in lines}


def _val_losses(run_dir: str) -> dict[int, float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["val_loss"] for r in map(json.loads, lines) if "val_loss" in r}


def mean_gap_from(run: dict, bf16_run: dict, first_step: int) -> float:
    """Mean gap to bf16 (percent) over the evaluations from ``first_step`` on: a long run's final
    evaluation alone is one sample of a noisy curve."""
    mine, base = _val_losses(run["out"]), _val_losses(bf16_run["out"])
    steps = [s for s in mine if s >= first_step and s in base]
    return statistics.mean(100 * (mine[s] / base[s] - 1) for s in steps)


def _long_run_gaps(rows: dict[tuple, dict], v: str, seeds: list, steps: int) -> dict:
    first = steps // 5
    gaps = {s: mean_gap_from(rows[(v, s, steps)], rows[("bf16", s, steps)], first) for s in seeds}
    return {
        f"gaps_from_step_{first}_pct": {str(s): round(g, 3) for s, g in gaps.items()},
        f"mean_from_step_{first}_pct": round(statistics.mean(gaps.values()), 3),
    }


def summarize(rows: dict[tuple, dict], variants: list[str], seeds: list[int], steps: int) -> dict:
    """Gaps to bf16 per variant and seed (percent), mean, spread, and mean minus fp32's mean; for
    runs of 2,000 steps or more also the mean gap over the evaluations of the last 80 %."""
    base = {s: rows[("bf16", s, steps)]["val_loss"] for s in seeds if ("bf16", s, steps) in rows}
    table = {}
    for v in variants:
        gaps = {
            s: 100 * (rows[(v, s, steps)]["val_loss"] / base[s] - 1)
            for s in seeds
            if (v, s, steps) in rows and s in base
        }
        if not gaps:
            continue
        vals = list(gaps.values())
        entry = {
            "gaps_pct": {str(s): round(g, 3) for s, g in gaps.items()},
            "mean_pct": round(statistics.mean(vals), 3),
            "std_pct": round(statistics.stdev(vals), 3) if len(vals) > 1 else None,
            "bytes_per_param": rows[(v, next(iter(gaps)), steps)]["bytes_per_param"],
        }
        if steps >= 2000:
            entry.update(_long_run_gaps(rows, v, list(gaps), steps))
        table[v] = entry
    if "fp32" in table:
        floor = dict(table["fp32"])
        for entry in table.values():
            for mean in [k for k in entry if k.startswith("mean_")]:
                entry[mean.replace("mean", "above_fp32", 1)] = round(entry[mean] - floor[mean], 3)
            entry["paired_above_fp32"] = _paired(entry["gaps_pct"], floor["gaps_pct"])
    return table


def _paired(gaps: dict[str, float], floor: dict[str, float]) -> dict:
    """A variant's gap minus fp32's, seed by seed, over the seeds both ran: the comparison that
    the seeds' shared data order and initialization do not blur (``above_fp32_pct`` subtracts
    means, which may cover different seeds while a run is incomplete). What ``fp8lm compare
    --seeds`` reports as ``minus_fp32`` (`paired_difference`), in percent."""
    from fp8lm.train.compare import paired_difference

    d = paired_difference(gaps, floor)
    pct = {key: None if d[key] is None else round(d[key], 3) for key in ("mean", "std", "stderr")}
    return {"mean_pct": pct["mean"], "std_pct": pct["std"], "stderr_pct": pct["stderr"], "seeds": d["seeds"]}


def eval_bf16(rows: dict[tuple, dict], variants: list[str], seeds: list[int], steps: int) -> dict:
    """`summarize`'s table of the finished runs with each one's `bf16_validation` as its loss,
    and each run's loss both ways (``val_loss``: as the run validated)."""
    import torch

    torch.set_num_threads(1)
    missing = [(v, s) for v in variants for s in seeds if (v, s, steps) not in rows]
    if missing:
        raise SystemExit(f"--eval-bf16 needs finished runs; none yet of {missing}: train them first")
    evaluated, losses = {}, {}
    for v in variants:
        for s in seeds:
            row = rows[(v, s, steps)]
            loss = bf16_validation(row)
            if v == "bf16" and loss != row["val_loss"]:
                raise SystemExit(f"bf16 seed {s}: recomputed {loss!r}, the run recorded {row['val_loss']!r}")
            evaluated[(v, s, steps)] = {**row, "val_loss": loss}
            losses[f"{v} seed {s}"] = {"val_loss": row["val_loss"], "bf16_gemms": loss}
            print(f"{v} seed {s}: val_loss {row['val_loss']:.4f}, with BF16 GEMMs {loss:.4f}", file=sys.stderr)
    return {
        "steps": steps,
        "seeds": seeds,
        "eval": "bf16 GEMMs",
        "losses": losses,
        "variants": summarize(evaluated, variants, seeds, steps),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--variants", default="fp32,bf16,O1,O2")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default: %(default)s)")
    p.add_argument("--out", default="runs/fidelity")
    p.add_argument(
        "--arch", default="gpt", choices=("gpt", "llama"), help="the main job's architecture (default: %(default)s)"
    )
    p.add_argument("--model", default="small", help="the model preset (default: %(default)s, the main job's)")
    p.add_argument("--moe-experts", type=int, default=0, help="a mixture of this many experts in every block")
    p.add_argument("--moe-top-k", type=int, default=2, help="--moe-experts: experts per token (default: %(default)s)")
    p.add_argument(
        "--init-from",
        metavar="CKPT",
        help="continuation probe: every run starts from this checkpoint's weights (fresh optimizer state) "
        "at the constant --lr (warmup: a tenth of the steps, at most 30) with 16 validation batches",
    )
    p.add_argument(
        "--lr", type=float, default=1e-3, help="--init-from: the constant learning rate (default: %(default)s)"
    )
    p.add_argument(
        "--eval-bf16",
        action="store_true",
        help="instead of training: the finished runs' final weights validated with every GEMM in BF16 "
        "(see bf16_validation), as the same table",
    )
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    p.add_argument("--time", metavar="V,V,...", help="instead of training: time these variants' steps (see time_steps)")
    p.add_argument("--rounds", type=int, default=5, help="--time: interleaved rounds (default: %(default)s)")
    p.add_argument("--time-steps", type=int, default=10, help="--time: steps per round (default: %(default)s)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        print(json.dumps({k: {"level": lvl, "options": o} for k, (lvl, o) in VARIANTS.items()}, indent=1))
        return 0
    if args.time:
        from common import machine

        timed = time_steps([v.strip() for v in args.time.split(",")], args.rounds, args.time_steps)
        print(json.dumps({"machine": machine(), "step_time": timed}, indent=1))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}: see --list")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    rows = _done(results)
    if args.eval_bf16:
        print(json.dumps(eval_bf16(rows, variants, seeds, args.steps), indent=1))
        return 0
    jobs = [
        {
            "variant": v,
            "seed": s,
            "steps": args.steps,
            "out": str(out / f"{v}-s{s}-n{args.steps}"),
            "cache_dir": str(out / "cache"),
            "train": train_options(args),
        }
        for s in seeds
        for v in variants
        if (v, s, args.steps) not in rows
    ]
    ctx = multiprocessing.get_context("spawn")
    first = [] if (out / "cache").exists() else jobs[:1]  # packs the token cache before others read it
    with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
        for row in _results(pool, first, jobs[len(first) :]):
            rows[(row["variant"], row["seed"], row["steps"])] = row
            if row.pop("reused", False):
                continue
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{row['variant']} seed {row['seed']}: val_loss {row['val_loss']:.4f} ({row['seconds']} s)",
                file=sys.stderr,
                flush=True,
            )
    print(
        json.dumps(
            {"steps": args.steps, "seeds": seeds, "variants": summarize(rows, variants, seeds, args.steps)}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
