"""The ``fp8lm`` command. One ``_add_<name>`` (its options) and one ``cmd_<name>`` (what it does)
per subcommand, registered in `SUBCOMMANDS`; a new subcommand is one more entry."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from .bench import BENCHMARKS, DEFAULT, BenchError, run_benchmark, scripts_dir
from .export import FORMATS as EXPORT_FORMATS
from .export import ExportError
from .recipe import RECIPES
from .telemetry import KINDS
from .train.checkpoint import CheckpointError
from .train.compare import compare, parse_levels, parse_seeds
from .train.config import GRAD_SYNC_SCALINGS, OPT_LEVELS, SECOND_MOMENT_FORMATS, RunError, TrainConfig
from .train.data import DataError
from .train.dpo import SUMMARY_KEYS as DPO_SUMMARY_KEYS
from .train.dpo import DPOConfig, dpo
from .train.export import export_run
from .train.generate import generate_ids, load_generator
from .train.loop import train
from .train.model import MLP_KINDS, PRESETS
from .train.telemetry_report import STATS, InspectError, plot_heatmap, read_telemetry, worst_table

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

# Errors that mean "the user asked for something that cannot work": one line on stderr, exit 2.
USER_ERRORS = (DataError, CheckpointError, RunError, InspectError, BenchError, ExportError)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by train and compare (everything but the precision level)."""
    d = TrainConfig()
    m = p.add_argument_group("model")
    m.add_argument("--model", default=d.model, choices=list(PRESETS), help="size preset (default: %(default)s)")
    m.add_argument("--n-layer", type=int, help="override the preset's number of blocks")
    m.add_argument("--n-head", type=int, help="override the preset's attention heads")
    m.add_argument("--n-embd", type=int, help="override the preset's width (keep it a multiple of 16 for FP8)")
    m.add_argument("--mlp", choices=MLP_KINDS, help="MLP kind (preset default: gelu)")
    o = p.add_argument_group("optimization")
    o.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default: %(default)s)")
    o.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch (default: %(default)s)"
    )
    o.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step (default: %(default)s)")
    o.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's block size)")
    o.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    o.add_argument(
        "--min-lr-ratio",
        type=float,
        default=d.min_lr_ratio,
        help="final lr / peak lr of the cosine decay (default: %(default)s)",
    )
    o.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: a tenth of --steps)")
    o.add_argument(
        "--weight-decay",
        type=float,
        default=d.weight_decay,
        help="AdamW weight decay of matrices (default: %(default)s)",
    )
    o.add_argument(
        "--grad-clip", type=float, default=d.grad_clip, help="max gradient norm, 0 = no clipping (default: %(default)s)"
    )
    o.add_argument(
        "--exp-avg-sq",
        choices=SECOND_MOMENT_FORMATS,
        type=str.upper,
        help="O2: format of Adam's second moment (default FP16; E4M3/E5M2 store it in FP8)",
    )
    o.add_argument(
        "--seed", type=int, default=d.seed, help="seed of the weights and the batch order (default: %(default)s)"
    )
    o.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    _add_data_and_output_options(p)
    _add_parallel_options(p)
    _add_numerics_options(p)


def _add_data_and_output_options(p: argparse.ArgumentParser) -> None:
    """What a run reads and writes."""
    d = TrainConfig()
    g = p.add_argument_group("data")
    g.add_argument(
        "--data", help="a text file or a folder of text files (default: the Python standard library's .py sources)"
    )
    g.add_argument("--hf-dataset", help="a Hugging Face dataset name (its 'text' column; needs the 'datasets' package)")
    g.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="share of documents held out for validation (default: %(default)s)",
    )
    g.add_argument("--cache-dir", help="where packed tokens are cached (default: OUT/cache)")
    r = p.add_argument_group("evaluation and output")
    r.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="validate every N steps and at the end (default: %(default)s)",
    )
    r.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches (default: %(default)s)")
    r.add_argument(
        "--save-every",
        type=int,
        default=d.save_every,
        help="checkpoint every N steps; the final step is always saved (default: %(default)s)",
    )
    r.add_argument(
        "--keep-checkpoints", type=int, default=d.keep_checkpoints, help="checkpoints kept (default: %(default)s)"
    )
    r.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    r.add_argument(
        "--init-from",
        metavar="CHECKPOINT",
        help="start from a checkpoint's weights (fine-tuning): a step_*.pt file or a run folder",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_parallel_options(p: argparse.ArgumentParser) -> None:
    """How a run under torchrun spreads over its ranks."""
    d = p.add_argument_group("parallelism (under torchrun)")
    d.add_argument(
        "--fsdp",
        action="store_true",
        help="shard weights, gradients and optimizer state with FSDP2: O1/O2 gather weights and reduce-scatter "
        "gradients in FP8, bf16 in BF16 (torch's MixedPrecisionPolicy), fp32 in FP32; not with O3 (FP8 ZeRO); "
        "with --tp: FSDP2 over the data-parallel ranks (2-D)",
    )
    d.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor + sequence parallel ranks per model replica: FP8 activations and gradients on the wire at "
        "O1/O2, BF16 at bf16 (world size = dp x tp x pp) (default: %(default)s)",
    )
    d.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages per model replica (GPipe): FP8 activations and gradients between stages at O1/O2, "
        "BF16 at bf16 (default: %(default)s)",
    )
    d.add_argument(
        "--pp-microbatches",
        type=int,
        default=TrainConfig().pp_microbatches,
        help="with --pp: micro-batches each step's batch is split into (default: %(default)s)",
    )


def _add_numerics_options(p: argparse.ArgumentParser) -> None:
    """How the FP8 layers scale, and what watches them."""
    d = TrainConfig()
    n = p.add_argument_group("FP8 numerics")
    n.add_argument(
        "--telemetry-every",
        type=int,
        default=d.telemetry_every,
        help="record FP8 telemetry (amax, scale, underflow, saturation of every FP8 layer's tensors) to "
        "OUT/telemetry.jsonl every N steps; 0 = off (default: %(default)s)",
    )
    n.add_argument(
        "--grad-sync-scaling",
        choices=GRAD_SYNC_SCALINGS,
        default=d.grad_sync_scaling,
        help="O1/O2 under torchrun: scaling of the FP8 gradient all-reduce. local: each rank scales its "
        "own tensors, sums in FP32; shared: one scale per bucket with the automatic factor mu of "
        "FP8-LM, logged as grad_sync_mu (default: %(default)s)",
    )
    n.add_argument(
        "--recipe",
        choices=list(RECIPES),
        default=d.recipe,
        help="FP8 levels: the fp8lm.Recipe of the FP8 layers (formats, delayed or current scaling, "
        "amax history) (default: %(default)s)",
    )
    n.add_argument(
        "--fallback",
        action="store_true",
        help="move a layer to BF16 while its telemetry shows too much underflow or saturation, and back "
        "(fp8lm.fallback; switches logged to metrics.jsonl)",
    )


def _config(args: argparse.Namespace, opt_level: str) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        mlp=args.mlp,
        opt_level=opt_level,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        exp_avg_sq=args.exp_avg_sq,
        seed=args.seed,
        device=args.device,
        data=args.data,
        hf_dataset=args.hf_dataset,
        val_fraction=args.val_fraction,
        cache_dir=args.cache_dir,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        out=args.out,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        init_from=args.init_from,
        progress=not args.no_progress,
        telemetry_every=args.telemetry_every,
        fallback=args.fallback,
        grad_sync_scaling=args.grad_sync_scaling,
        fsdp=args.fsdp,
        tp=args.tp,
        pp=args.pp,
        pp_microbatches=args.pp_microbatches,
        recipe=args.recipe,
    )


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--opt-level",
        default="bf16",
        choices=OPT_LEVELS,
        help="fp32; bf16 (autocast + FP32 AdamW, the baseline); O1 (FP8 GEMMs, FP8 weight gradients, "
        "FP32 weights); O2 (O1 + FP16 weights + FP8AdamW); O3 (O2 with FP8 weights; under torchrun, FP8 ZeRO) "
        "(default: %(default)s)",
    )
    p.add_argument("--out", default="runs/train", help="output folder (default: %(default)s)")
    _add_run_options(p)


def cmd_train(args: argparse.Namespace) -> int:
    summary = train(_config(args, args.opt_level))
    if summary is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    keys = ("opt_level", "steps", "tokens", "train_loss", "val_loss", "tokens_per_s", "bytes_per_param")
    if summary["world_size"] > 1:
        keys += ("world_size", "comm_bytes_per_step", "ddp_fp32_bytes_per_step", "ddp_bf16_bytes_per_step")
    print(json.dumps({k: summary[k] for k in keys}, indent=1))
    print(f"summary: {args.out}/summary.json")
    return 0


def _add_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--levels",
        default="bf16,O1,O2",
        help=f"comma-separated levels of {', '.join(OPT_LEVELS)} (default: %(default)s)",
    )
    p.add_argument(
        "--out", default="runs/compare", help="output folder, one sub-folder per level (default: %(default)s)"
    )
    p.add_argument(
        "--seeds",
        metavar="S,S,...",
        help="train every level at each of these seeds (OUT/seed<S>/<level>/) and report each level's gap to "
        "bf16 per seed, its mean and spread; --seed is then ignored",
    )
    _add_run_options(p)


def cmd_compare(args: argparse.Namespace) -> int:
    levels = parse_levels(args.levels)
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    result = compare(_config(args, levels[0]), levels, seeds)
    if result is None:  # a rank other than 0 under torchrun
        return 0
    per = f"per level and seed, seeds {args.seeds}" if seeds else "per level"
    print(
        f"{result['steps']} steps, {result['tokens']:,} tokens {per}, {result['num_params']:,} parameters, {result['device']}"
    )
    print(result["table"])
    print(f"comparison: {args.out}/compare.json")
    print(f"plot: {result['plot']}")
    return 0


def _add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out folder of a run trained with --telemetry-every N")
    p.add_argument("--top", type=int, default=10, help="tensors listed per statistic (default: %(default)s)")
    p.add_argument("--kind", default="grad_output", choices=KINDS, help="tensors of the heatmap (default: %(default)s)")
    p.add_argument("--stat", default="underflow", choices=STATS, help="statistic of the heatmap (default: %(default)s)")


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise InspectError(f"--top must be >= 1, got {args.top}")
    records = read_telemetry(args.run_dir)
    steps = sorted({r["step"] for r in records})
    print(f"{len(records)} telemetry records, {len(steps)} sampled steps ({steps[0]}..{steps[-1]})")
    for stat in STATS:
        print(f"\nworst {stat}:")
        print(worst_table(records, stat, args.top))
    path = plot_heatmap(records, f"{args.run_dir}/telemetry_{args.kind}_{args.stat}.png", args.kind, args.stat)
    print(f"\nheatmap: {path}")
    return 0


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run, of {', '.join(BENCHMARKS)} (default: {' '.join(DEFAULT)}); "
        "arguments after -- go to each of them",
    )
    p.add_argument("--out", default="runs/bench", help="folder for NAME.json (default: %(default)s)")
    p.add_argument("--scripts", help="the benchmarks/ folder (default: the one of this source checkout)")


def cmd_bench(args: argparse.Namespace) -> int:
    names = args.names or list(DEFAULT)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise BenchError(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(BENCHMARKS)}")
    scripts = scripts_dir(args.scripts)
    for name in names:
        print(f"fp8lm bench: running {name}", file=sys.stderr, flush=True)
        result = run_benchmark(name, scripts, Path(args.out), args.extra)
        print(json.dumps(result, indent=1), flush=True)
        print(f"saved: {Path(args.out) / (name + '.json')}", flush=True)
    return 0


def _add_dpo(p: argparse.ArgumentParser) -> None:
    d = DPOConfig()
    p.add_argument(
        "--init-from",
        metavar="CHECKPOINT",
        help="the pretrained model: a step_*.pt file or a run folder of fp8lm train (required unless --resume)",
    )
    p.add_argument(
        "--opt-level",
        default=d.opt_level,
        choices=OPT_LEVELS,
        help="the policy's level, as in fp8lm train; the frozen reference is stored in E4M3 at O1/O2/O3, "
        "in BF16 at bf16 (default: %(default)s)",
    )
    p.add_argument(
        "--data",
        metavar="PAIRS.jsonl",
        help="JSON Lines with 'prompt', 'chosen', 'rejected' strings (default: built-in pairs from the "
        "standard library's sources: true continuation chosen, a corrupted one rejected)",
    )
    p.add_argument("--beta", type=float, default=d.beta, help="DPO's beta (default: %(default)s)")
    p.add_argument("--out", default=d.out, help="output folder (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="pairs per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument(
        "--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup steps (default: %(default)s)"
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=d.weight_decay,
        help="AdamW weight decay of matrices (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the pair order (default: %(default)s)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="share of --data pairs held out (default: %(default)s)",
    )
    p.add_argument("--cache-dir", help="where the built-in pairs' corpus is packed (default: OUT/cache)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="evaluate held-out pairs every N steps and at the end (default: %(default)s)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=d.save_every,
        help="checkpoint every N steps; the final step is always saved (default: %(default)s)",
    )
    p.add_argument(
        "--keep-checkpoints", type=int, default=d.keep_checkpoints, help="checkpoints kept (default: %(default)s)"
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_dpo(args: argparse.Namespace) -> int:
    cfg = DPOConfig(
        init_from=args.init_from,
        opt_level=args.opt_level,
        data=args.data,
        beta=args.beta,
        out=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        seed=args.seed,
        val_fraction=args.val_fraction,
        cache_dir=args.cache_dir,
        eval_every=args.eval_every,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        device=args.device,
        progress=not args.no_progress,
    )
    summary = dpo(cfg)
    if summary is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    print(json.dumps({k: summary[k] for k in ("opt_level", "steps", *DPO_SUMMARY_KEYS)}, indent=1))
    print(f"summary: {args.out}/summary.json")
    return 0


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder of fp8lm train or a step_*.pt checkpoint")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument(
        "--format",
        default="hf",
        choices=EXPORT_FORMATS,
        help="hf: BF16 weights; hf-fp8: the linear layers' weights in E4M3 with their scales "
        "(compressed-tensors) (default: %(default)s)",
    )
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def cmd_export(args: argparse.Namespace) -> int:
    out = export_run(args.source, args.out, args.format, args.step, args.overwrite)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"exported {args.source} as {args.format} to {out} ({size / 2**20:.2f} MiB)")
    return 0


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="DIR", help="a folder written by fp8lm export, a run folder or a step_*.pt file")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sample (default: %(default)s)")
    p.add_argument("--top-k", type=int, help="sample from the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")
    p.add_argument("--step", type=int, help="of a run folder: the checkpoint of this step (default: the newest)")


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ExportError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ExportError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ExportError(f"--top-k must be >= 1, got {args.top_k}")
    model = load_generator(args.source, args.step)
    prompt = model.encode(args.prompt)
    if not prompt:
        raise ExportError("--prompt is empty; pass some text to continue")
    new = generate_ids(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(model.decode(prompt + new))
    return 0


# name -> (help, add options, run)
SUBCOMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "train": ("train a GPT on a real corpus at one precision level", _add_train, cmd_train),
    "compare": ("train the same GPT at several precision levels and compare them", _add_compare, cmd_compare),
    "inspect": (
        "show a run's FP8 telemetry: the worst tensors and a heatmap (layers x steps)",
        _add_inspect,
        cmd_inspect,
    ),
    "dpo": ("preference-tune a trained GPT with DPO: FP8 policy, frozen FP8 reference", _add_dpo, cmd_dpo),
    "bench": ("run the benchmark scripts of the source checkout and save their JSON", _add_bench, cmd_bench),
    "export": (
        "export a run as a Hugging Face model folder, its weights in BF16 or FP8",
        _add_export,
        cmd_export,
    ),
    "generate": ("continue a prompt with an exported folder or a run's model", _add_generate, cmd_generate),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fp8lm", description="FP8 training for LLMs on stock PyTorch")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Arguments after "--" are passed through (fp8lm bench hands them to the benchmark scripts).
    argv, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(argv)
    if extra and args.command != "bench":
        parser.error(f"arguments after -- ({' '.join(extra)}) are for fp8lm bench only")
    args.extra = extra
    try:
        code = args.func(args)
    except USER_ERRORS as e:
        print(f"fp8lm {args.command}: error: {_rank_prefix()}{e}", file=sys.stderr)
        code = 2
    except CheckpointException as e:  # a BaseException: torch's Distributed Checkpoint, every rank's failures
        print(f"fp8lm {args.command}: error: {_rank_prefix()}{_checkpoint_exception_line(e)}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print(f"fp8lm {args.command}: interrupted", file=sys.stderr)
        code = 130
    except OSError as e:  # the disk, permissions, paths: the system's answer is the user's to act on
        print(f"fp8lm {args.command}: error: {_rank_prefix()}{_os_error_line(e)}", file=sys.stderr)
        code = 2
    except Exception as e:
        if not _in_process_group():
            raise
        # Under torchrun one rank's failure (often another rank dying) is reported with its
        # traceback, then one line saying which rank stopped and why.
        traceback.print_exc()
        first = (str(e).splitlines() or [""])[0]
        print(
            f"fp8lm {args.command}: error: {_rank_prefix()}stopped: {type(e).__name__}: {first} "
            "(if another rank died or hung, its log says why)",
            file=sys.stderr,
        )
        code = 1
    if _in_process_group():
        _leave_process_group(code)
    return code


# errno -> what to do about it
_OS_ERROR_FIXES = {
    errno.ENOSPC: "free some space (or pass another --out), then rerun with --resume to continue from the last checkpoint",
    errno.EDQUOT: "free some space (or pass another --out), then rerun with --resume to continue from the last checkpoint",
    errno.EACCES: "pass a path you can write to",
    errno.EPERM: "pass a path you can write to",
    errno.EROFS: "pass a path on a writable file system",
    errno.ENAMETOOLONG: "pass a shorter path",
    errno.ENOTDIR: "a file stands where a folder is needed; pass another path",
}


def _os_error_line(e: OSError) -> str:
    """One line for an OSError: what failed, on which file, and what to do. A file being written
    is a temporary one renamed only when complete (`fp8lm.train.checkpoint`): nothing is half-written."""
    where = f" ({e.filename!r})" if e.filename else ""
    fix = _OS_ERROR_FIXES.get(e.errno, "check the path and the disk")
    return f"{e.strerror or type(e).__name__}{where}; {fix}"


def _checkpoint_exception_line(e: CheckpointException) -> str:
    """One line for a sharded checkpoint that torch could not read or write (its message lists
    every rank's traceback): the first failure."""
    failures = [(rank, exc) for rank, (exc, _) in sorted(e.failures.items())]
    if not failures:
        return f"sharded checkpoint failed: {(str(e).splitlines() or [''])[0]}"
    rank, exc = failures[0]
    first = (str(exc).strip().splitlines() or ["(no message)"])[0]
    return (
        f"sharded checkpoint failed on rank {rank}: {type(exc).__name__}: {first}; if resuming, move the newest "
        "checkpoint out of the run to continue from an older one"
    )


def _in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank_prefix() -> str:
    import torch.distributed as dist

    return f"rank {dist.get_rank()}: " if _in_process_group() and dist.get_world_size() > 1 else ""


def _leave_process_group(code: int) -> None:
    """End a torchrun worker with ``code`` (`fp8lm.distributed.shutdown`; never returns). If the
    final barrier fails, a peer is gone: exit 1."""
    from .distributed import shutdown

    try:
        shutdown(code)
    except Exception as e:
        print(
            f"fp8lm: error: {_rank_prefix()}leaving the process group failed: {type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0]}",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
