"""Training speed of a ``--model`` Hugging Face folder against the built-in architecture of the same
size, as JSON.

For each ``--archs`` entry the folder is the built-in model's exact Hugging Face equivalent
(`fp8lm.train.export.llama_config` / `gpt2_config` of the preset: ``LlamaForCausalLM`` or
``GPT2LMHeadModel``, same sizes, untied head, same MLP width), written with ``save_pretrained``
(no weights: ``from_config``). Each model trains ``--steps`` steps at each level with the same
options, data and seed, one run at a time in a child process with ``--threads`` threads;
``tokens_per_s`` is the run's own (the steps after the first). Reported per architecture and
level: both runs' tokens per second and parameter counts, and ``hf_over_builtin``, the folder's
tokens per second over the built-in model's.

    python benchmarks/hf_model_speed.py                          # small preset, bf16 and O2, CPU
    python benchmarks/hf_model_speed.py --device cuda --preset base --steps 100
    python benchmarks/hf_model_speed.py --preset tiny --steps 4 --results ''   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from pathlib import Path


def _run(job: dict) -> dict:
    """One training run in this (child) process; its summary."""
    os.environ.setdefault("OMP_NUM_THREADS", str(job["threads"]))
    import torch

    torch.set_num_threads(job["threads"])
    from fp8lm.train.config import TrainConfig
    from fp8lm.train.loop import train

    model = {"model": job["folder"]} if job["folder"] else {"model": job["preset"], "arch": job["arch"]}
    cfg = TrainConfig(
        **model,
        opt_level=job["level"],
        steps=job["steps"],
        eval_every=job["steps"],
        eval_batches=2,
        telemetry_every=0,
        seq_len=job["seq_len"],
        out=job["out"],
        cache_dir=job["cache_dir"],
        data=job["data"],
        device=job["device"],
        progress=False,
    )
    summary = train(cfg)
    assert summary is not None  # one process: rank 0
    return summary


def write_folder(arch: str, preset: str, seq_len: int | None, folder: Path) -> None:
    """The Hugging Face equivalent of the built-in ``arch`` at ``preset`` (config only)."""
    from fp8lm.train.export import gpt2_config, llama_config
    from fp8lm.train.model import preset as gpt_preset

    cfg = gpt_preset(preset, arch=arch, block_size=seq_len)
    (llama_config(cfg) if arch == "llama" else gpt2_config(cfg)).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="llama,gpt")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's block size")
    parser.add_argument("--levels", default="bf16,O2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data", default=None, help="training text (default: fp8lm train's)")
    parser.add_argument("--out", default="runs/hf_model_speed")
    parser.add_argument(
        "--results",
        default=str(Path(__file__).resolve().parent / "results" / "hf_model_speed_cpu.json"),
        help="also write the JSON here ('' : print only)",
    )
    args = parser.parse_args()
    archs = [a for a in args.archs.split(",") if a]
    levels = [lv for lv in args.levels.split(",") if lv]
    if args.steps < 2 or args.threads < 1 or not archs or not levels:
        raise SystemExit("hf_model_speed.py: --steps >= 2, --threads >= 1, --archs and --levels non-empty")
    out = Path(args.out)
    base = {
        "preset": args.preset,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "threads": args.threads,
        "device": args.device,
        "data": args.data,
        "cache_dir": str(out / "cache"),
    }
    jobs = []
    for arch in archs:
        folder = out / f"{arch}_{args.preset}_folder"
        write_folder(arch, args.preset, args.seq_len, folder)
        for level in levels:
            for kind, path in (("builtin", None), ("hf", str(folder))):
                name = f"{arch}_{level}_{kind}"
                jobs.append({**base, "arch": arch, "level": level, "kind": kind, "folder": path})
                jobs[-1]["out"] = str(out / "runs" / name)
    ctx = multiprocessing.get_context("spawn")  # no torch state shared with the children
    summaries = []
    for job in jobs:  # one at a time: the runs do not share the machine
        if (Path(job["out"]) / "summary.json").exists():
            summaries.append(json.loads((Path(job["out"]) / "summary.json").read_text()))
            continue
        with ctx.Pool(1) as pool:
            summaries.append(pool.apply(_run, (job,)))
    results: dict = {}
    for job, summary in zip(jobs, summaries, strict=True):
        row = results.setdefault(job["arch"], {}).setdefault(job["level"], {})
        row[job["kind"]] = {
            "tokens_per_s": summary["tokens_per_s"],
            "num_params": summary["num_params"],
            "val_loss": summary["val_loss"],
        }
    for levels_ in results.values():
        for row in levels_.values():
            row["hf_over_builtin"] = row["hf"]["tokens_per_s"] / row["builtin"]["tokens_per_s"]
            row["same_num_params"] = row["hf"]["num_params"] == row["builtin"]["num_params"]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import emit, machine

    result = {
        "benchmark": "hf_model_speed",
        "machine": machine(),
        "command": "python benchmarks/hf_model_speed.py " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "steps": args.steps,
        "threads": args.threads,
        "device": args.device,
        "results": results,
    }
    emit(result, args.results)


if __name__ == "__main__":
    main()
