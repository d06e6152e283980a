"""Whether a run may start or continue: the output folder's state, and a checkpoint's fit to the
run (model shape, level, format, gradient sync scaling, rank count). Each refusal is one line
saying what to pass instead, raised before anything is written."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import IO

from torch import nn

from .amp_record import amp_options_change, record_amp_options
from .checkpoint import CheckpointError, list_checkpoints
from .config import RunError, TrainConfig, option_fields, option_flag
from .data import data_fingerprint, run_documents
from .ranks import Ranks, broadcast_from_main, restarts_allowed

__all__ = [
    "CHECKPOINT_FORMAT",
    "RESUME_KEYS",
    "resume_config",
    "check_output",
    "check_writable_folder",
    "lock_output",
    "OutputLock",
    "claim_output",
    "check_state_fits",
    "check_resume",
    "layout_options",
    "same_option",
    "resume_options",
]

CHECKPOINT_FORMAT = "fp8lm.train/2"
# Options a resumed run must share with the run it continues (besides the model's shape and the
# level, checked on their own): they decide the batches, the token counts and the updates.
RESUME_KEYS = (
    "batch_size",
    "grad_accum",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "seed",
    "data",
    "hf_dataset",
    "val_fraction",
    "tokenizer",
    "vocab_size",
    "recipe",
    "activations",
    "policy",
    "exp_avg_sq",
    "fallback",
)
# GPTConfig field -> the option that sets it
_MODEL_FLAGS = {
    "arch": "--arch",
    "n_layer": "--n-layer",
    "n_head": "--n-head",
    "n_kv_head": "--n-kv-head",  # after --n-head: unset, it follows --n-head
    "n_embd": "--n-embd",
    "mlp": "--mlp",
    "block_size": "--seq-len",
}


def check_output(cfg: TrainConfig) -> bool:
    """Refuse to start over a finished or checkpointed run (unless resuming), or to resume nothing.
    Returns whether the run resumes: under ``torchrun --max-restarts N`` the same command line
    serves the first attempt and the restarts, so there ``--resume`` starts a run that has no
    checkpoint yet."""
    out = Path(cfg.out)
    check_writable_folder(out, "--out")
    if cfg.cache_dir:
        check_writable_folder(Path(cfg.cache_dir), "--cache-dir")
    has_checkpoint = bool(list_checkpoints(out / "checkpoints"))
    if not cfg.resume and ((out / "summary.json").exists() or has_checkpoint):
        raise RunError(
            f"{str(out)!r} already holds a training run; pass --resume to continue it or choose another --out"
        )
    if cfg.resume and not has_checkpoint and not restarts_allowed():
        raise RunError(
            f"--resume: no checkpoint in {str(out / 'checkpoints')!r}; run without --resume to start training"
        )
    return cfg.resume and has_checkpoint


def check_writable_folder(path: Path, option: str) -> None:
    """Refuse, before anything is written, a folder that cannot be one (a file stands there, the
    name is too long) or that this process cannot write to (nor create)."""
    try:
        if path.exists() and not path.is_dir():
            raise RunError(f"{option} {str(path)!r} is not a folder; pass a folder (an existing one or a new one)")
        existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    except OSError as e:  # e.g. ENAMETOOLONG
        raise RunError(f"{option} {str(path)!r}: {e.strerror}; pass a shorter or another path") from None
    if not existing.is_dir():
        raise RunError(f"{option} {str(path)!r}: {str(existing)!r} is a file, not a folder; pass another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunError(
            f"{option} {str(path)!r}: cannot write in {str(existing)!r} (read-only or no permission); "
            f"pass a folder you can write to"
        )


def lock_output(out: Path) -> IO[str]:
    """Hold ``out/.lock`` (an exclusive ``flock``) for the run: a second run on the same folder is
    refused, naming the process that holds it. The lock ends with the file (or the process)."""
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a process that has not written its id yet"
        lock.close()
        raise RunError(
            f"{str(out)!r} is in use by another run ({holder}); wait for it to end or choose another --out"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()}\n")
    lock.flush()
    return lock


class OutputLock:
    """Rank 0's hold on ``OUT/.lock`` for the whole run, from before the first check of ``OUT``
    (`claim_output`) to the end of training."""

    def __init__(self, out: Path) -> None:
        check_writable_folder(out, "--out")
        self.out, self.created = out, not out.exists()
        self.file: IO[str] | None = lock_output(out)

    def release(self, failed: bool = False) -> None:
        """Let go of the lock. A run that fails before training, in a folder it created, removes
        the folder again (it holds nothing but the lock file then), so a refusal leaves no trace."""
        if self.file is None:
            return
        if failed and self.created:
            (self.out / ".lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: something was written, keep it
                self.out.rmdir()
        self.file.close()
        self.file = None


def claim_output(out: Path, ranks: Ranks) -> OutputLock | None:
    """Take ``OUT/.lock`` on rank 0 before anything looks at or writes ``OUT``: two runs started on
    one folder at the same time cannot both pass the folder checks. A refusal is raised on every
    rank, as the same one line. Returns rank 0's lock (None on the other ranks)."""
    lock, refusal = None, None
    if ranks.main:
        try:
            lock = OutputLock(out)
        except RunError as e:
            refusal = str(e)
        except OSError as e:  # e.g. creating the folder on a full or read-only disk
            refusal = f"--out {str(out)!r}: {e.strerror or type(e).__name__}; pass a folder you can write to"
    refusal = broadcast_from_main(refusal, ranks)
    if refusal is not None:
        raise RunError(refusal)
    return lock


def resume_config(cfg: TrainConfig) -> dict:
    """What a checkpoint records of ``cfg`` for `check_resume` to compare: the `RESUME_KEYS`
    options and a fingerprint of the data's files (`data_fingerprint`), so that the same path
    with other contents is not taken for the same data."""
    return {**_resume_values(cfg), "data_fingerprint": _data_fingerprint(cfg)}


def _resume_values(cfg: TrainConfig) -> dict:
    values = {key: getattr(cfg, key) for key in RESUME_KEYS}
    values["warmup_steps"] = cfg.schedule()[0]  # resolved: an extended run (more --steps) keeps it
    values["activations"] = cfg.resolved_activations()  # resolved: the level's default may change
    return values


def _data_fingerprint(cfg: TrainConfig) -> str | None:
    """The fingerprint of ``--data`` (or of the default corpus); None for a Hugging Face dataset,
    whose own fingerprint names the packed cache."""
    if cfg.hf_dataset:
        return None
    return data_fingerprint(run_documents(cfg.data)[1])


def resume_options(cfg: TrainConfig, given: set[str]) -> tuple[TrainConfig, list[str]]:
    """``cfg`` (a command line's, ``--resume``) completed by the options the run in ``cfg.out`` was
    started with: each option the command did not give (``given``: field names) takes the run's
    value, from its newest checkpoint. One given with another value is refused in one line, unless
    it may change (`fp8lm.train.config.option`'s ``resume``: how long, how often, where; the layout,
    which reshards). Returns the config and the lines that say what changes (an extension's
    learning-rate schedule). Without a checkpoint ``cfg`` is returned as it is: the run refuses it."""
    from dataclasses import replace

    from .checkpoint import list_checkpoints, load_checkpoint

    if not list_checkpoints(Path(cfg.out) / "checkpoints"):
        return cfg, []
    state = load_checkpoint(Path(cfg.out) / "checkpoints")
    saved = saved_options(state)
    options = {f.name: f for f in option_fields(type(cfg))}
    known = {name for name in saved if hasattr(cfg, name)}
    for name in sorted(known & given & options.keys()):
        f = options[name]
        if f.metadata["resume"] == "keep" and not same_option(name, saved[name], getattr(cfg, name)):
            flag = option_flag(f)
            raise RunError(
                f"--resume: the run in {cfg.out!r} was trained with {_as_option(flag, saved[name])}, this command "
                f"has {_as_option(flag, getattr(cfg, name))}; drop {flag} to continue it with its own (or choose "
                "another --out for a new run)"
            )
    # Not taken from the run: the layout (the command's launch decides it; a change reshards), the
    # device, and paths written to (the token cache: OUT/cache unless given). --data is taken: it
    # is only read, and only once its files match the fingerprint the checkpoint recorded.
    layout = {name for name, f in options.items() if f.metadata["resume"] == "layout"}
    keep = {"out", "resume", "progress", "init_from", "device", "cache_dir"} | layout
    taken = {name: saved[name] for name in known - given - keep}
    resumed = replace(cfg, **taken)
    return resumed, _schedule_lines(saved, resumed, given, int(state["step"]))


def saved_options(state: dict) -> dict:
    """The options a checkpoint records; for one written before they were recorded, those it has
    (the options of `RESUME_KEYS`, the level and the model's sizes)."""
    if "options" in state:
        return dict(state["options"])
    saved = {k: v for k, v in (state.get("config") or {}).items() if k != "data_fingerprint"}
    model = state.get("model_config") or {}
    sizes = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "mlp": "mlp", "block_size": "seq_len"}
    saved |= {option: model[key] for key, option in sizes.items() if key in model}
    return saved | ({"opt_level": state["opt_level"]} if "opt_level" in state else {})


def _schedule_lines(saved: dict, cfg: TrainConfig, given: set[str], step: int) -> list[str]:
    """What an extension (more --steps than the run had) does to the learning rate."""
    before = saved.get("steps")
    if before is None or cfg.steps <= before:
        return []
    warmup, length = cfg.schedule()
    if "decay_steps" in given and length != saved.get("decay_steps"):
        return [
            f"--resume: extending the run from {before} to {cfg.steps} steps with a new learning-rate schedule "
            f"(--decay-steps {length}, warmup {warmup}): the lr is that schedule's from step {step + 1} on"
        ]
    if cfg.steps <= length:  # the run was given a schedule this long (--decay-steps): it goes on with it
        return [
            f"--resume: extending the run from {before} to {cfg.steps} steps within its learning-rate schedule "
            f"(--decay-steps {length}): the lr decays to {cfg.lr * cfg.min_lr_ratio:.2e} at step {length}"
        ]
    return [
        f"--resume: extending the run from {before} to {cfg.steps} steps; its learning-rate schedule keeps its "
        f"length: the lr reaches {cfg.lr * cfg.min_lr_ratio:.2e} at step {length} and stays there (pass "
        f"--decay-steps {cfg.steps} to decay over the new length instead)"
    ]


def check_state_fits(model: nn.Module, state: dict, where: str) -> None:
    """Raise one clear line when a checkpoint's weights do not fit ``model`` (a plain GPT): a weight
    of another shape, one missing, or one this model does not have (a deeper checkpoint)."""
    own, theirs = model.state_dict(), state["model"]
    if theirs is None:  # sharded weights only (a --tp/--pp run): the shard folder's load checks them
        return
    wrong = [k for k in own if k in theirs and tuple(theirs[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in theirs]
    extra = [k for k in theirs if k not in own]
    if not (wrong or missing or extra):
        return
    first = (wrong or missing or extra)[0]
    if wrong:
        detail = f"has shape {tuple(theirs[first].shape)}, this model needs {tuple(own[first].shape)}"
    else:
        detail = "is missing" if missing else "is not in this model"
    saved = state.get("model_config") or {}
    diff = ", ".join(
        f"{k}={v} (here {getattr(model.config, k)})"
        for k, v in saved.items()
        if hasattr(model.config, k) and getattr(model.config, k) != v
    )
    raise CheckpointError(
        f"checkpoint {where} does not fit this model: {first!r} {detail}"
        + (f"; it was trained with {diff}" if diff else "")
        + "; pass --model/--arch/--n-layer/--n-head/--n-kv-head/--n-embd/--mlp/--seq-len to match it"
    )


def check_resume(cfg: TrainConfig, state: dict, model: nn.Module, ranks: Ranks) -> None:
    """Refuse a checkpoint this run cannot continue exactly."""
    finished = (Path(cfg.out) / "summary.json").exists()
    if int(state["step"]) > cfg.steps or (finished and int(state["step"]) == cfg.steps):
        raise RunError(
            f"the run in {cfg.out!r} already reached step {state['step']}; pass --steps larger than that to continue it"
        )
    if state.get("opt_level") != cfg.opt_level:
        raise CheckpointError(
            f"checkpoint {state['path']!r} was trained at opt level {state.get('opt_level')}, "
            f"not {cfg.opt_level}; resume with --opt-level {state.get('opt_level')}"
        )
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {state['path']!r} has format {state.get('format')!r}, this version reads {CHECKPOINT_FORMAT!r}"
        )
    _check_same_options(cfg, state, model)
    _check_same_amp_options(cfg, state)
    _check_same_data(cfg, state)
    check_state_fits(model, state, repr(state["path"]))
    saved_scaling = (state.get("data_parallel") or {}).get("scaling")
    if saved_scaling is not None and saved_scaling != cfg.grad_sync_scaling:
        raise CheckpointError(
            f"checkpoint {state['path']!r} was trained with --grad-sync-scaling {saved_scaling}, not "
            f"{cfg.grad_sync_scaling}; resume with --grad-sync-scaling {saved_scaling}"
        )
    # another world size or layout reshards (fp8lm.train.reshard decides what it can)


def layout_options(cfg: TrainConfig) -> dict:
    """How a run spreads its state over the ranks, as a checkpoint records it."""
    return {"tp": cfg.tp, "pp": cfg.pp, "fsdp": cfg.fsdp, "ep": cfg.ep}


def _check_same_options(cfg: TrainConfig, state: dict, model: nn.Module) -> None:
    """Refuse another model shape or another `RESUME_KEYS` option than the checkpoint's run had
    (checkpoints written before options were recorded are checked for their shapes only)."""
    here = {flag: getattr(model.config, field) for field, flag in _MODEL_FLAGS.items()}
    saved_model = state.get("model_config") or {}
    saved = {flag: saved_model[field] for field, flag in _MODEL_FLAGS.items() if field in saved_model}
    recorded = _resume_values(cfg)
    if (state.get("config") or {}).get("warmup_steps", 0) is None:  # recorded unresolved by older versions
        recorded["warmup_steps"] = cfg.warmup_steps
    here |= {"--" + key.replace("_", "-"): recorded[key] for key in RESUME_KEYS}
    saved |= {"--" + key.replace("_", "-"): value for key, value in (state.get("config") or {}).items()}
    for flag, value in saved.items():
        if flag in here and not same_option(flag[2:].replace("-", "_"), value, here[flag]):
            theirs = _as_option(flag, value)
            fix = f"drop {flag}" if theirs.startswith("no ") else f"pass {theirs}"
            raise RunError(
                f"--resume: the run in {cfg.out!r} was trained with {theirs}, this command has "
                f"{_as_option(flag, here[flag])}; {fix} to continue it (or choose another --out for a new run)"
            )


def _check_same_amp_options(cfg: TrainConfig, state: dict) -> None:
    """Refuse other `TrainConfig.amp_options` than the checkpoint's run passed from code (also
    none, as the command line has, for a run that passed some)."""
    changed = amp_options_change(state.get("amp_options"), record_amp_options(cfg.amp_options, cfg.opt_level))
    if changed:
        raise RunError(
            f"--resume: the run in {cfg.out!r} was trained with other fp8lm.initialize options passed from code "
            f"(TrainConfig.amp_options: {', '.join(changed)}); pass the ones it had to continue it (or choose "
            "another --out for a new run)"
        )


def _check_same_data(cfg: TrainConfig, state: dict) -> None:
    """Refuse to continue on data whose files changed since the checkpoint (checkpoints written
    before fingerprints were recorded are not checked)."""
    saved = (state.get("config") or {}).get("data_fingerprint")
    if saved is None or saved == _data_fingerprint(cfg):
        return
    what = f"--data {cfg.data}" if cfg.data else "the default corpus (the standard library's sources)"
    raise RunError(
        f"--resume: the files of {what} changed since the run in {cfg.out!r} was checkpointed (names, sizes or "
        "contents); resume on the data it trained on, or start a new run in another --out"
    )


def same_option(key: str, saved, here) -> bool:
    """Whether option ``key`` has the same value as the run that was saved: ``data`` and a
    ``tokenizer`` file as the path they name (relative or absolute, the same file), the others as
    they are."""
    if key in ("data", "tokenizer") and saved is not None and here is not None:
        if key == "tokenizer" and ("bytes" in (saved, here) or "bpe" in (saved, here)):
            return saved == here
        return _normalized_path(saved) == _normalized_path(here)
    return saved == here


def _normalized_path(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _as_option(flag: str, value) -> str:
    if value is None or value is False:
        return f"no {flag}"
    return flag if value is True else f"{flag} {value}"
