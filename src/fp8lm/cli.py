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
from dataclasses import Field
from pathlib import Path

from .train.config import DPOConfig, TrainConfig, option_default, option_fields, option_flag

# Nothing that imports torch is imported here: `fp8lm --help` answers at once, and each command
# imports what it runs when it runs (`fp8lm.train.config`, where the options are defined, imports
# no torch).

__all__ = ["main", "build_parser", "SUBCOMMANDS", "add_config_options", "config_from_args"]


def __getattr__(name: str):
    if name == "USER_ERRORS":  # loaded on first use: the error classes live in modules that import torch
        return _user_errors()
    raise AttributeError(f"module 'fp8lm.cli' has no attribute {name!r}")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the user asked for something that cannot work": one line on stderr, exit 2."""
    from .bench import BenchError
    from .export import ExportError
    from .train.checkpoint import CheckpointError
    from .train.config import RunError
    from .train.data import DataError
    from .train.telemetry_report import InspectError

    return (DataError, CheckpointError, RunError, InspectError, BenchError, ExportError)


class _Parser(argparse.ArgumentParser):
    subcommands: dict[str, argparse.ArgumentParser]  # the top level's: name -> its parser

    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_TYPES = {"int": int, "float": float, "str": str}


def add_config_options(
    p: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = (), grouped: bool = True
) -> None:
    """Add the options of config class ``cls`` (its fields made with `fp8lm.train.config.option`)
    to ``p``, each under its group (when ``grouped``), with the field's default."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in option_fields(cls):
        if f.name in exclude:
            continue
        group = f.metadata["group"] if grouped else None
        target = p if group is None else groups.setdefault(group, p.add_argument_group(group))
        target.add_argument(option_flag(f), dest=f.name, help=_help(f), **_argument(f))


def _argument(f: Field) -> dict:
    """argparse's keywords for option field ``f``: a switch for a bool, else a typed value."""
    default, meta = option_default(f), f.metadata
    annotation = (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))).replace(
        " | None", ""
    )
    if annotation == "bool":
        return {"action": "store_false" if default else "store_true"}
    kwargs = {"default": default, "type": meta["type"] or _TYPES[annotation]}
    if meta["choices"]:
        kwargs["choices"] = list(meta["choices"])
    if meta["metavar"]:
        kwargs["metavar"] = meta["metavar"]
    return kwargs


def _help(f: Field) -> str:
    text = f.metadata["help"].replace("%", "%%")
    default = option_default(f)
    if default is None or isinstance(default, bool) or "default" in text:
        return text
    return text + " (default: %(default)s)"


def config_from_args(cls: type, args: argparse.Namespace, **values):
    """An instance of config class ``cls`` from parsed options (those ``args`` has), and ``values``."""
    given = {f.name: getattr(args, f.name) for f in option_fields(cls) if hasattr(args, f.name)}
    return cls(**{**given, **values})


def _add_train(p: argparse.ArgumentParser) -> None:
    add_config_options(p, TrainConfig)


def _resumed(cfg, args: argparse.Namespace):
    """``cfg``, and with --resume the options the command did not give taken from the run it
    continues (`fp8lm.train.resume.resume_options`); what changes is said in one line each."""
    if not cfg.resume:
        return cfg
    from .train.resume import resume_options

    cfg, lines = resume_options(cfg, args.given)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in lines:
            print(line, flush=True)
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    from .train import loop

    summary = loop.train(_resumed(config_from_args(TrainConfig, args), args))
    if summary is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    keys = ("opt_level", "steps", "tokens", "train_loss", "val_loss", "tokens_per_s", "bytes_per_param")
    if summary["world_size"] > 1:
        keys += ("world_size", "comm_bytes_per_step", "ddp_fp32_bytes_per_step", "ddp_bf16_bytes_per_step")
    print(json.dumps({k: summary[k] for k in keys}, indent=1))
    print(f"summary: {args.out}/summary.json")
    return 0


def _add_compare(p: argparse.ArgumentParser) -> None:
    from .train.config import OPT_LEVELS

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
    add_config_options(p, TrainConfig, exclude=("opt_level", "out"))


def cmd_compare(args: argparse.Namespace) -> int:
    from .train.compare import compare, parse_levels, parse_seeds

    levels = parse_levels(args.levels)
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    result = compare(config_from_args(TrainConfig, args, opt_level=levels[0]), levels, seeds)
    if result is None:  # a rank other than 0 under torchrun
        return 0
    per = f"per level and seed, seeds {args.seeds}" if seeds else "per level"
    print(
        f"{result['steps']} steps, {result['tokens']:,} tokens {per}, {result['num_params']:,} parameters, {result['device']}"
    )
    print(result["table"])
    print(f"comparison: {args.out}/compare.json")
    if result["plot"] is not None:
        print(f"plot: {result['plot']}")
    return 0


# what `fp8lm inspect` offers (fp8lm.telemetry.KINDS, fp8lm.train.telemetry_report.STATS), spelled
# here so that its options import no torch; tests/test_options.py checks them
TELEMETRY_KINDS = ("input", "weight", "grad_output", "weight_grad", "exp_avg", "exp_avg_sq")
TELEMETRY_STATS = ("underflow", "saturation")


def _add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out folder of a run trained with --telemetry-every N")
    p.add_argument("--top", type=int, default=10, help="tensors listed per statistic (default: %(default)s)")
    p.add_argument(
        "--kind", default="grad_output", choices=TELEMETRY_KINDS, help="tensors of the heatmap (default: %(default)s)"
    )
    p.add_argument(
        "--stat", default="underflow", choices=TELEMETRY_STATS, help="statistic of the heatmap (default: %(default)s)"
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    from .train.telemetry_report import STATS, InspectError, plot_heatmap, read_telemetry, worst_table

    if args.top < 1:
        raise InspectError(f"--top must be >= 1, got {args.top}")
    records = read_telemetry(args.run_dir)
    steps = sorted({r["step"] for r in records})
    print(f"{len(records)} telemetry records, {len(steps)} sampled steps ({steps[0]}..{steps[-1]})")
    for stat in STATS:
        print(f"\nworst {stat}:")
        print(worst_table(records, stat, args.top))
    path = plot_heatmap(records, f"{args.run_dir}/telemetry_{args.kind}_{args.stat}.png", args.kind, args.stat)
    if path is not None:
        print(f"\nheatmap: {path}")
    return 0


def _add_bench(p: argparse.ArgumentParser) -> None:
    from .bench import BENCHMARKS, DEFAULT

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
    from .bench import BENCHMARKS, DEFAULT, BenchError, run_benchmark, scripts_dir

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
    add_config_options(p, DPOConfig, grouped=False)


def cmd_dpo(args: argparse.Namespace) -> int:
    from .train.dpo import SUMMARY_KEYS, dpo

    summary = dpo(_resumed(config_from_args(DPOConfig, args), args))
    if summary is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    print(json.dumps({k: summary[k] for k in ("opt_level", "steps", *SUMMARY_KEYS)}, indent=1))
    print(f"summary: {args.out}/summary.json")
    return 0


def _add_export(p: argparse.ArgumentParser) -> None:
    from .export import FORMATS as EXPORT_FORMATS

    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder of fp8lm train or a step_*.pt checkpoint")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument(
        "--format",
        default="hf",
        choices=EXPORT_FORMATS,
        help="hf: BF16 weights; hf-fp8: the linear layers' weights in E4M3 with their scales "
        "(compressed-tensors) (default: %(default)s)",
    )
    p.add_argument(
        "--input-activations",
        default="bf16",
        choices=("bf16", "fp8"),
        help="hf-fp8: fp8 also declares the linear layers' inputs E4M3, scaled per batch in the recipe's "
        "blocks (W8A8, what serving engines' FP8 GEMMs run; --arch llama runs) (default: %(default)s)",
    )
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def cmd_export(args: argparse.Namespace) -> int:
    from .train.export import export_run

    out = export_run(args.source, args.out, args.format, args.step, args.overwrite, args.input_activations)
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
    from .export import ExportError
    from .train.generate import generate_ids, load_generator

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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; with ``only``, of that one (the others are listed with their
    help, without their options): a command builds just its own options."""
    from . import __version__

    parser = _Parser(prog="fp8lm", description="FP8 training for LLMs on stock PyTorch")
    parser.add_argument("--version", action="version", version=f"fp8lm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.subcommands = {}
    for name, (help_text, add, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            add(p)
        p.set_defaults(func=run)
        parser.subcommands[name] = p
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Arguments after "--" are passed through (fp8lm bench hands them to the benchmark scripts).
    argv, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    command = next((a for a in argv if not a.startswith("-")), "")  # the top level takes no values
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    if extra and args.command != "bench":
        parser.error(f"arguments after -- ({' '.join(extra)}) are for fp8lm bench only")
    args.extra = extra
    args.given = _given(command, argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        print(f"fp8lm {args.command}: interrupted", file=sys.stderr)
        code = 130
    except BaseException as e:  # torch's CheckpointException is a BaseException
        code = _failed(args.command, e)
    if _in_process_group():
        _leave_process_group(code)
    return code


def _given(command: str, argv: list[str]) -> set[str]:
    """The options (their destinations) that ``argv`` gives: parsed again with no defaults."""
    parser = build_parser(only=command)
    for action in parser.subcommands[command]._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command", "func"}


def _failed(command: str, e: BaseException) -> int:
    """The exit code of a command that raised ``e``, after one line on stderr saying why (a user's
    error, the disk, a sharded checkpoint) or, under torchrun, the traceback and which rank stopped;
    anything else is raised on."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, _user_errors()):
        print(f"fp8lm {command}: error: {_rank_prefix()}{e}", file=sys.stderr)
        return 2
    if isinstance(e, CheckpointException):  # torch's Distributed Checkpoint, every rank's failures
        print(f"fp8lm {command}: error: {_rank_prefix()}{_checkpoint_exception_line(e)}", file=sys.stderr)
        return 2
    if isinstance(e, OSError):  # the disk, permissions, paths: the system's answer is the user's to act on
        print(f"fp8lm {command}: error: {_rank_prefix()}{_os_error_line(e)}", file=sys.stderr)
        return 2
    if not isinstance(e, Exception) or not _in_process_group():
        raise e
    # Under torchrun one rank's failure (often another rank dying) is reported with its
    # traceback, then one line saying which rank stopped and why.
    traceback.print_exc()
    first = (str(e).splitlines() or [""])[0]
    print(
        f"fp8lm {command}: error: {_rank_prefix()}stopped: {type(e).__name__}: {first} "
        "(if another rank died or hung, its log says why)",
        file=sys.stderr,
    )
    return 1


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


def _checkpoint_exception_line(e) -> str:
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
    if "torch" not in sys.modules:  # no command imported torch: no process group
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank_prefix() -> str:
    """``rank N: `` under torchrun with more than one rank, also before the process group is joined
    (``--resume`` reads the run's options first): torchrun's environment names the rank."""
    if _in_process_group():
        import torch.distributed as dist

        return f"rank {dist.get_rank()}: " if dist.get_world_size() > 1 else ""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "")
    return f"rank {rank}: " if world.isdigit() and int(world) > 1 and rank.isdigit() else ""


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
