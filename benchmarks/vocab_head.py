"""The output head at a byte vocabulary (256) and a BPE vocabulary (8,192): the FP8 levels' gap to
bf16 with the head's GEMMs in BF16 (the default policy) and in FP8, and the head's weight-gradient
underflow, as JSON.

Every run is one `fp8lm train` (``--arch``, ``--preset``, the main job's other options) at one
vocabulary, level, head mode and seed, in a child process, single-threaded (its numbers do not
depend on the machine's load), ``--jobs`` at a time. Vocabulary 256 is ``--tokenizer bytes``,
any other ``--tokenizer bpe --vocab-size N`` (trained once per size in the shared cache). The FP8
levels run twice: ``head=bf16`` (``fp8lm.policy.preset(level)``: the head's GEMMs and weight
gradient in BF16) and ``head=fp8`` (``preset(level, output_head=False)``: the head like every
linear layer, E4M3 weight gradient). Reported per vocabulary:

- ``final_val_loss`` and ``val_bits_per_byte`` of every run;
- ``gap_pct``: each level's final validation loss against bf16's at the same seed,
  ``(val_loss / bf16's - 1) x 100``, per seed and the mean; ``gap_minus_fp32_pct``: that mean minus
  fp32's mean gap (fp32's own distance from bf16 is the noise floor of two ordinary precisions);
- ``lm_head_weight_grad_underflow``: over the FP8 runs' telemetry (every ``--telemetry-every``
  steps, every seed) the fraction of the head's non-zero weight-gradient values that its cast
  flushes to zero (E4M3 with head=fp8, BF16 with head=bf16), mean and max;
  ``lm_head_grad_output_underflow`` the same for the output gradient entering the head.

A run folder with a summary is reused, so an interrupted benchmark continues where it stopped.

    python benchmarks/vocab_head.py                    # small preset, 200 steps, seeds 0-4, O2
    python benchmarks/vocab_head.py --preset tiny --steps 10 --seeds 0 --vocabs 256,512 --results ''  # smoke
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

BASELINES = ("fp32", "bf16")


def run_name(vocab: int, level: str, head: str | None, seed: int) -> str:
    return f"v{vocab}/{level}{'' if head is None else '_head_' + head}_seed{seed}"


def _run(job: dict) -> dict:
    """One training run in this (child) process; its summary (reused when already finished)."""
    out = Path(job["out"])
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from fp8lm.policy import preset
    from fp8lm.train.config import TrainConfig
    from fp8lm.train.loop import train

    vocab, head = job["vocab"], job["head"]
    amp_options = {"policy": preset(job["level"], output_head=head == "bf16")} if head is not None else {}
    cfg = TrainConfig(
        arch=job["arch"],
        model=job["preset"],
        opt_level=job["level"],
        seed=job["seed"],
        steps=job["steps"],
        eval_every=job["steps"],
        telemetry_every=job["telemetry_every"] if head is not None else 0,
        tokenizer="bytes" if vocab == 256 else "bpe",
        vocab_size=None if vocab == 256 else vocab,
        amp_options=amp_options,
        out=str(out),
        cache_dir=job["cache_dir"],
        data=job["data"],
        device=job["device"],
        progress=False,
    )
    summary = train(cfg)
    assert summary is not None  # one process: rank 0
    print(f"{run_name(vocab, job['level'], head, job['seed'])}: val loss {summary['val_loss']:.4f}", flush=True)
    return summary


def head_underflow(run: Path, kind: str) -> list[float]:
    """The head's ``kind`` underflow at every telemetry step of a run (its last linear layer)."""
    path = run / "telemetry.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["underflow"] for r in records if r["layer"].endswith("lm_head") and r["kind"] == kind]


def stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "max": max(values), "samples": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gpt", choices=("gpt", "llama"))
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--vocabs", default="256,8192", help="256: bytes; others: BPE of that size")
    parser.add_argument("--levels", default="O2", help="FP8 levels, each with the head in BF16 and in FP8")
    parser.add_argument("--telemetry-every", type=int, default=10)
    parser.add_argument("--data", default=None, help="training text (default: fp8lm train's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="runs/vocab_head", help="run folders (reused)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument(
        "--results",
        default=str(Path(__file__).resolve().parent / "results" / "vocab_head_cpu.json"),
        help="also write the JSON here ('' : print only)",
    )
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    vocabs = [int(v) for v in args.vocabs.split(",")]
    levels = [lv for lv in args.levels.split(",") if lv]
    if args.steps < 1 or args.jobs < 1 or not seeds or not levels:
        raise SystemExit("vocab_head.py: --steps and --jobs must be >= 1, --seeds and --levels non-empty")
    out = Path(args.out) / f"{args.arch}_{args.preset}_{args.steps}"
    base = {
        "arch": args.arch,
        "preset": args.preset,
        "steps": args.steps,
        "telemetry_every": args.telemetry_every,
        "data": args.data,
        "device": args.device,
        "cache_dir": str(Path(args.out) / "cache"),
    }
    variants = [(level, None) for level in BASELINES] + [(lv, head) for lv in levels for head in ("bf16", "fp8")]
    jobs = [
        {**base, "vocab": vocab, "level": level, "head": head, "seed": seed}
        for vocab in vocabs
        for seed in seeds
        for level, head in variants
    ]
    for job in jobs:
        job["out"] = str(out / run_name(job["vocab"], job["level"], job["head"], job["seed"]))
    ctx = multiprocessing.get_context("spawn")  # no torch state shared with the children
    with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
        # each vocabulary's tokens made once, by a 1-step run, before runs that would race to make them
        warm = [{**base, "vocab": v, "level": "fp32", "head": None, "seed": 0, "steps": 1} for v in vocabs]
        for w in warm:
            w["out"] = str(Path(args.out) / "pack" / f"v{w['vocab']}")
        pool.map(_run, warm, chunksize=1)
        summaries = pool.map(_run, jobs, chunksize=1)
    results: dict = {}
    for vocab in vocabs:
        runs = {
            (j["level"], j["head"], j["seed"]): s for j, s in zip(jobs, summaries, strict=True) if j["vocab"] == vocab
        }
        names = {(level, head): level if head is None else f"{level}_head_{head}" for level, head in variants}
        final = {names[v]: {str(seed): runs[(*v, seed)]["val_loss"] for seed in seeds} for v in variants}
        bits = {names[v]: {str(seed): runs[(*v, seed)]["val_bits_per_byte"] for seed in seeds} for v in variants}
        gap = {}
        for v in variants:
            per_seed = {
                str(seed): 100 * (runs[(*v, seed)]["val_loss"] / runs[("bf16", None, seed)]["val_loss"] - 1)
                for seed in seeds
            }
            gap[names[v]] = {**per_seed, "mean": statistics.fmean(per_seed.values())}
        fp32_gap = gap["fp32"]["mean"]
        underflow = {}
        for level in levels:
            for head in ("bf16", "fp8"):
                folders = [out / run_name(vocab, level, head, seed) for seed in seeds]
                underflow[f"{level}_head_{head}"] = {
                    kind: stats([u for f in folders for u in head_underflow(f, kind)])
                    for kind in ("weight_grad", "grad_output")
                }
        results[str(vocab)] = {
            "model_vocab_size": runs[("bf16", None, seeds[0])]["model_config"]["vocab_size"],
            "final_val_loss": final,
            "val_bits_per_byte": bits,
            "gap_pct": gap,
            "gap_minus_fp32_pct": {name: g["mean"] - fp32_gap for name, g in gap.items() if name not in BASELINES},
            "lm_head_weight_grad_underflow": {name: u["weight_grad"] for name, u in underflow.items()},
            "lm_head_grad_output_underflow": {name: u["grad_output"] for name, u in underflow.items()},
            "skipped_steps": {f"{names[(lv, h)]}_seed{s}": runs[(lv, h, s)]["skipped_steps"] for lv, h, s in runs},
        }
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import emit, machine

    result = {
        "benchmark": "vocab_head",
        "machine": machine(),
        "command": "python benchmarks/vocab_head.py " + " ".join(sys.argv[1:]),
        "arch": args.arch,
        "preset": args.preset,
        "steps": args.steps,
        "seeds": seeds,
        "levels": [*BASELINES, *levels],
        "telemetry_every": args.telemetry_every,
        "vocabularies": results,
    }
    emit(result, args.results)


if __name__ == "__main__":
    main()
