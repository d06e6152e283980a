"""A long `--arch llama` run at O2 against bf16 and fp32: the validation-loss gap over training and
each block's SwiGLU amax over training, as JSON.

Every run is one `fp8lm train --arch llama` of the given preset (the main job's other options) at
one level and seed, in a child process, single-threaded (its numbers do not depend on the machine's
load), ``--jobs`` at a time. A run validates every ``--eval-every`` steps; the O2 runs record FP8
telemetry every ``--telemetry-every`` steps. Reported:

- ``val_gap_pct``: at every validation of every seed, ``(val_loss / reference's - 1) x 100`` for
  O2 against bf16 and against fp32, and bf16 against fp32 (the noise floor of two ordinary
  precisions); ``final_val_gap_pct``: the same at the last step, per seed and their mean;
- ``swiglu_amax``: per seed and block, the amax over training of the two tensors the FP8 MLP casts
  (O2 telemetry, kind ``input``): ``down_proj_input``, SwiGLU's output ``silu(gate) * up`` as the
  down projection (``mlp.c_proj``) quantizes it, the tensor whose outliers SwiGLU amplifies
  (Fishman et al. 2024) and Smooth-SwiGLU would rescale per channel; and ``mlp_input``, the
  normalized residual stream entering the gate/up projection (``mlp.c_fc``). Each is a list of
  ``[step, amax, saturation]`` (saturation: fraction of values beyond E4M3's max after scaling);
  ``swiglu_amax_summary`` gives each series' first, largest and last amax;
- ``fp8_saturation_max``: the largest saturation of the down projection's input, and of any FP8
  layer's input, over all O2 telemetry.

Runs longer than 1,000 steps checkpoint every 500 steps; a run folder with a summary is reused,
one with checkpoints continues from its last (bit for bit), so an interrupted benchmark resumes.

    python benchmarks/llama_long.py                      # 1,500 steps, seeds 0,1, small preset
    python benchmarks/llama_long.py --steps 20 --preset tiny --results ''   # a smoke run
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

LEVELS = ("O2", "bf16", "fp32")
GAPS = (("O2", "bf16"), ("O2", "fp32"), ("bf16", "fp32"))


def run_dir(out: Path, preset: str, steps: int, level: str, seed: int) -> Path:
    return out / f"{preset}_{steps}" / f"{level}_seed{seed}"


def _run(job: dict) -> dict:
    """One training run in this (child) process; its summary (reused when already finished)."""
    out = Path(job["out"])
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from fp8lm.train.config import TrainConfig
    from fp8lm.train.loop import train

    save_every = 500 if job["steps"] > 1000 else 0
    cfg = TrainConfig(
        arch="llama",
        model=job["preset"],
        opt_level=job["level"],
        seed=job["seed"],
        steps=job["steps"],
        eval_every=job["eval_every"],
        telemetry_every=job["telemetry_every"] if job["level"] == "O2" else 0,
        out=str(out),
        cache_dir=job["cache_dir"],
        data=job["data"],
        device="cpu",
        progress=False,
        save_every=save_every,
        resume=save_every > 0 and (out / "checkpoints").is_dir(),
    )
    start = time.perf_counter()
    summary = train(cfg)
    assert summary is not None  # one process: rank 0
    print(
        f"{job['level']} seed {job['seed']}: val loss {summary['val_loss']:.4f} ({time.perf_counter() - start:.0f} s)"
    )
    return summary


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def val_losses(run: Path) -> dict[int, float]:
    """Step -> validation loss of a finished run."""
    return {r["step"]: r["val_loss"] for r in _jsonl(run / "metrics.jsonl") if "val_loss" in r}


def gaps(runs: dict, seeds: list[int]) -> tuple[dict, dict]:
    """Validation-loss gaps (percent) over training and at the last step, per pair of levels."""
    over, final = {}, {}
    for level, ref in GAPS:
        name = f"{level}_vs_{ref}"
        over[name], final[name] = {}, {}
        for seed in seeds:
            ours, theirs = runs[level][seed], runs[ref][seed]
            steps = sorted(ours.keys() & theirs.keys())
            over[name][str(seed)] = [[s, round(100 * (ours[s] / theirs[s] - 1), 4)] for s in steps]
            final[name][str(seed)] = over[name][str(seed)][-1][1]
        final[name]["mean"] = round(statistics.fmean(final[name][str(s)] for s in seeds), 4)
    return over, final


def swiglu_amax(run: Path) -> tuple[dict, dict]:
    """Per block, the O2 run's MLP input amaxes over training, and the largest saturations."""
    series: dict[str, dict[str, list]] = {}
    saturation = {"down_proj_input": 0.0, "any_input": 0.0}
    for r in _jsonl(run / "telemetry.jsonl"):
        if r["kind"] != "input":
            continue
        saturation["any_input"] = max(saturation["any_input"], r["saturation"])
        parts = r["layer"].split(".")  # blocks.N.mlp.c_fc / blocks.N.mlp.c_proj
        if len(parts) != 4 or parts[0] != "blocks" or parts[2] != "mlp":
            continue
        key = {"c_proj": "down_proj_input", "c_fc": "mlp_input"}[parts[3]]
        series.setdefault(f"blocks.{parts[1]}", {}).setdefault(key, []).append(
            [r["step"], round(r["amax"], 4), r["saturation"]]
        )
        if key == "down_proj_input":
            saturation["down_proj_input"] = max(saturation["down_proj_input"], r["saturation"])
    return dict(sorted(series.items(), key=lambda kv: int(kv[0].split(".")[1]))), saturation


def summarize(series: dict) -> dict:
    return {
        block: {
            key: {"first": points[0][1], "max": max(p[1] for p in points), "last": points[-1][1]}
            for key, points in kinds.items()
        }
        for block, kinds in series.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--eval-every", type=int, default=None, help="default: a fifteenth of --steps")
    parser.add_argument("--telemetry-every", type=int, default=None, help="default: a thirtieth of --steps")
    parser.add_argument("--data", default=None, help="training text (default: fp8lm train's)")
    parser.add_argument("--out", default="runs/llama_long", help="run folders (reused and resumed)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument(
        "--results",
        default=str(Path(__file__).resolve().parent / "results" / "llama_long_cpu.json"),
        help="also write the JSON here ('' : print only)",
    )
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 1 or args.jobs < 1 or not seeds:
        raise SystemExit("llama_long.py: --steps and --jobs must be >= 1 and --seeds non-empty")
    eval_every = args.eval_every or max(1, args.steps // 15)
    telemetry_every = args.telemetry_every or max(1, args.steps // 30)
    out = Path(args.out)
    jobs = [
        {
            "level": level,
            "seed": seed,
            "steps": args.steps,
            "preset": args.preset,
            "eval_every": eval_every,
            "telemetry_every": telemetry_every,
            "data": args.data,
            "cache_dir": str(out / "cache"),
            "out": str(run_dir(out, args.preset, args.steps, level, seed)),
        }
        for seed in seeds
        for level in LEVELS
    ]
    ctx = multiprocessing.get_context("spawn")  # no torch state shared with the children
    with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
        if args.jobs > 1:  # the data tokenized once, by a 1-step run, before runs that would race to pack it
            warm = {**jobs[0], "level": "fp32", "steps": 1, "eval_every": 1, "out": str(out / "pack_data")}
            pool.apply(_run, (warm,))
        summaries = pool.map(_run, jobs, chunksize=1)
    skipped = {f"{j['level']}_seed{j['seed']}": s["skipped_steps"] for j, s in zip(jobs, summaries, strict=True)}
    runs = {
        level: {seed: val_losses(run_dir(out, args.preset, args.steps, level, seed)) for seed in seeds}
        for level in LEVELS
    }
    over, final = gaps(runs, seeds)
    amax, saturation = {}, {"down_proj_input": 0.0, "any_input": 0.0}
    for seed in seeds:
        amax[str(seed)], sat = swiglu_amax(run_dir(out, args.preset, args.steps, "O2", seed))
        saturation = {k: max(saturation[k], sat[k]) for k in saturation}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import emit, machine

    result = {
        "benchmark": "llama_long",
        "machine": machine(),
        "command": "python benchmarks/llama_long.py " + " ".join(sys.argv[1:]),
        "arch": "llama",
        "preset": args.preset,
        "steps": args.steps,
        "seeds": seeds,
        "levels": list(LEVELS),
        "eval_every": eval_every,
        "telemetry_every": telemetry_every,
        "final_val_loss": {
            level: {str(seed): runs[level][seed][max(runs[level][seed])] for seed in seeds} for level in LEVELS
        },
        "skipped_steps": skipped,
        "final_val_gap_pct": final,
        "val_gap_pct": over,
        "swiglu_amax_summary": {seed: summarize(series) for seed, series in amax.items()},
        "fp8_saturation_max": saturation,
        "swiglu_amax": amax,
    }
    emit(result, args.results)


if __name__ == "__main__":
    main()
