"""What a training run is asked to do: `TrainConfig`, the precision levels, and their checks.

Levels (`OPT_LEVELS`, the one list the CLI offers):
- ``fp32``: no autocast, ``torch.optim.AdamW``;
- ``bf16``: ``torch.autocast(bfloat16)`` and FP32 AdamW, the baseline;
- ``O1`` / ``O2`` / ``O3``: ``fp8lm.distributed.wrap`` (``fp8lm.initialize``, and the FP8 data
  parallelism of the level under ``torchrun``) on the same model and AdamW, also under bf16
  autocast, so that the only difference from the baseline is what FP8-LM changes (GEMMs, weight
  gradients, weights and, from O2, the optimizer); FP8-LM too runs the non-GEMM ops in BF16. O3
  stores weights in FP8 with FP16 masters; across ranks it shards masters and moments (FP8 ZeRO),
  in one process it is O2 with FP8 weights.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..distributed import SCALINGS
from ..policy import FP8_LEVELS
from ..recipe import DEFAULT_RECIPE, RECIPES, Recipe
from .model import GPTConfig, preset

__all__ = [
    "OPT_LEVELS",
    "FP8_LEVELS",
    "FP8_OPTIMIZER_LEVELS",
    "SECOND_MOMENT_FORMATS",
    "TrainConfig",
    "RunError",
    "default_device",
]

OPT_LEVELS = ("fp32", "bf16", *FP8_LEVELS)  # the two baselines, then fp8lm's levels
SECOND_MOMENT_FORMATS = ("FP16", "E4M3", "E5M2")
FP8_OPTIMIZER_LEVELS = ("O2", "O3")  # the levels that replace AdamW by fp8lm.optim.FP8AdamW
FP8_DATA_PARALLEL_LEVELS = ("O1", "O2")  # under torchrun: fp8lm.distributed.FP8DataParallel
GRAD_SYNC_SCALINGS = SCALINGS  # FP8DataParallel's scaling modes (--grad-sync-scaling)
# option -> (low, high, whether each end is allowed): what validate accepts
_NUMBER_RANGES = {
    "lr": (0.0, math.inf, (False, False)),
    "min_lr_ratio": (0.0, 1.0, (True, True)),
    "weight_decay": (0.0, math.inf, (True, False)),
    "beta1": (0.0, 1.0, (True, False)),
    "beta2": (0.0, 1.0, (True, False)),
    "grad_clip": (0.0, math.inf, (True, False)),
    "val_fraction": (0.0, 1.0, (False, False)),
}
# --seed seeds torch's generators, with the rank added: within a signed 64-bit integer on any world size
_SEEDS = range(0, 2**63 - 2**20)
COMPUTE_DEVICES = ("cpu", "cuda")  # what a run can train on (not meta, not a lazy or virtual device)
_GIB = 2**30


class RunError(ValueError):
    """The run cannot start as asked (its output folder, or options that contradict each other)."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class TrainConfig:
    # model: a preset, with explicit sizes overriding it
    model: str = "small"
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    mlp: str | None = None
    # precision
    opt_level: str = "bf16"
    # optimization
    steps: int = 500
    batch_size: int = 16
    grad_accum: int = 1
    seq_len: int | None = None  # default: the preset's block_size
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int | None = None  # default: a tenth of the steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 1337
    device: str | None = None
    # data
    data: str | None = None
    hf_dataset: str | None = None
    val_fraction: float = 0.05
    cache_dir: str | None = None  # default: <out>/cache
    # evaluation and output
    eval_every: int = 100
    eval_batches: int = 8
    out: str = "runs/train"
    save_every: int = 0  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    resume: bool = False
    init_from: str | None = None
    progress: bool = True
    exp_avg_sq: str | None = None  # O2/O3: format of Adam's second moment (default FP16; E4M3/E5M2 = FP8)
    # FP8 numerics
    telemetry_every: int = 100  # record FP8 telemetry every N steps; 0 = off
    fallback: bool = False  # move layers to BF16 (and back) by telemetry (fp8lm.fallback)
    # O1/O2 under torchrun: scaling of the FP8 gradient all-reduce (fp8lm.distributed.FP8DataParallel)
    grad_sync_scaling: str = "local"
    fsdp: bool = False  # under torchrun: shard with FSDP2 (fp8lm.distributed.fully_shard) instead
    tp: int = 1  # under torchrun: tensor + sequence parallel ranks per model replica
    pp: int = 1  # under torchrun: pipeline stages per model replica
    pp_microbatches: int = 4  # with pp > 1: micro-batches per step (the schedule's)
    recipe: str = DEFAULT_RECIPE  # FP8 levels: the named fp8lm.Recipe of every FP8Linear
    amp_options: dict = field(default_factory=dict)  # extra keyword options of fp8lm.initialize

    def model_config(self) -> GPTConfig:
        return preset(
            self.model,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            mlp=self.mlp,
            block_size=self.seq_len,
        )

    def validate(self) -> None:
        if self.opt_level not in OPT_LEVELS:
            raise RunError(f"unknown opt level {self.opt_level!r}: use one of {', '.join(OPT_LEVELS)}")
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise RunError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "telemetry_every"):
            if (getattr(self, name) or 0) < 0:
                raise RunError(f"{name} must be >= 0, got {getattr(self, name)}")
        self._check_numbers()
        if not (isinstance(self.seed, int) and self.seed in _SEEDS):
            raise RunError(f"--seed must be a whole number in [0, 2**63 - 2**20), got {self.seed}")
        if self.device is not None:
            _check_device(self.device)
        if self.data and self.hf_dataset:
            raise RunError("pass either --data or --hf-dataset, not both")
        if self.resume and self.init_from:
            raise RunError(
                "--resume continues this run's own checkpoint; drop --init-from (it starts a new run from a checkpoint)"
            )
        if self.amp_options and self.opt_level not in FP8_LEVELS:
            raise RunError(f"fp8lm.initialize options apply to {'/'.join(FP8_LEVELS)} only, not to {self.opt_level}")
        self._check_recipe()
        if self.exp_avg_sq is not None:
            if self.opt_level not in FP8_OPTIMIZER_LEVELS:
                raise RunError(
                    f"--exp-avg-sq sets the FP8 optimizer's second moment, which only {'/'.join(FP8_OPTIMIZER_LEVELS)} have (this run is {self.opt_level})"
                )
            if self.exp_avg_sq.upper() not in SECOND_MOMENT_FORMATS:
                raise RunError(
                    f"unknown --exp-avg-sq format {self.exp_avg_sq!r}: use one of {', '.join(SECOND_MOMENT_FORMATS)}"
                )
        if self.grad_sync_scaling not in GRAD_SYNC_SCALINGS:
            raise RunError(
                f"unknown --grad-sync-scaling {self.grad_sync_scaling!r}: use one of {', '.join(GRAD_SYNC_SCALINGS)}"
            )
        if self.grad_sync_scaling != "local" and self.opt_level not in FP8_DATA_PARALLEL_LEVELS:
            raise RunError(
                f"--grad-sync-scaling sets the FP8 gradient all-reduce of {'/'.join(FP8_DATA_PARALLEL_LEVELS)} "
                f"(this run is {self.opt_level})"
            )
        self._check_fsdp()
        self._check_model_parallel()
        if self.fallback and (self.opt_level not in FP8_LEVELS or self.telemetry_every == 0):
            raise RunError(
                f"--fallback acts on FP8 telemetry: it needs an FP8 level ({'/'.join(FP8_LEVELS)}, this run is "
                f"{self.opt_level}) and --telemetry-every >= 1 (got {self.telemetry_every})"
            )
        try:
            model = self.model_config()
        except ValueError as e:  # a bad preset or sizes
            raise RunError(str(e)) from None
        self._check_split(model)
        self._check_memory(model)

    def _check_numbers(self) -> None:
        """Each optimization number finite and in its range (nan compares false: refused too)."""
        for name, (low, high, closed) in _NUMBER_RANGES.items():
            value = getattr(self, name)
            above = value >= low if closed[0] else value > low
            below = value <= high if closed[1] else value < high
            if not (math.isfinite(value) and above and below):
                interval = f"{'[' if closed[0] else '('}{low}, {high}{']' if closed[1] else ')'}"
                raise RunError(f"--{name.replace('_', '-')} must be a finite number in {interval}, got {value}")

    def _check_fsdp(self) -> None:
        if self.fsdp and self.opt_level == "O3":
            raise RunError(
                "--fsdp with O3: FSDP2 shards slices of FP16 weights, O3 is FP8 ZeRO (whole FP8 tensors, sharded "
                "masters); use --opt-level O2 --fsdp, or O3 without --fsdp"
            )
        if self.fsdp and self.grad_sync_scaling != "local":
            raise RunError("--grad-sync-scaling sets FP8DataParallel's all-reduce, which --fsdp replaces: drop one")

    def _check_model_parallel(self) -> None:
        """What --tp and --pp combine with (each refusal says what to drop)."""
        for name in ("tp", "pp", "pp_microbatches"):
            if getattr(self, name) < 1:
                raise RunError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.tp == 1 and self.pp == 1:
            return
        flag = f"--tp {self.tp}" if self.pp == 1 else f"--pp {self.pp}"
        refusals = [
            (
                self.opt_level == "O3" and self.tp > 1,
                f"--tp {self.tp} with O3 is not supported: E4M3 weights sliced by tensor parallelism need FP16 "
                "masters with one scale across the slices, which FP8AdamW does not keep; use --opt-level O2 "
                "(its FP16 weights are the masters) with --fsdp to shard the state",
            ),
            (
                self.grad_sync_scaling != "local",
                f"--grad-sync-scaling sets FP8DataParallel's all-reduce, which {flag} replaces: drop it",
            ),
            (
                self.pp > 1 and self.grad_accum > 1,
                "--pp splits each step into --pp-microbatches itself: drop --grad-accum",
            ),
        ]
        for refused, message in refusals:
            if refused:
                raise RunError(message)

    def _check_split(self, model: GPTConfig) -> None:
        """The model's sizes divide into --tp shards and --pp stages."""
        if model.n_layer % self.pp:
            raise RunError(f"--pp {self.pp} needs a layer count divisible by it, got {model.n_layer}: pick a divisor")
        sizes = {"--n-head": model.n_head, "--seq-len": model.block_size, "the vocabulary": model.vocab_size}
        for name, size in sizes.items():
            if size % self.tp:
                raise RunError(f"--tp {self.tp} shards {name} ({size}), which it does not divide: pick a divisor")

    def memory_needed(self, model: GPTConfig) -> tuple[int, int]:
        """A lower bound of the bytes this process needs, as (host, device): the validation batches
        (int64 token windows, all held at once) on the host; on the device the weights and what one
        micro-batch's backward pass keeps per token, counted short: the logits in BF16 and as the
        loss's FP32 log-probabilities (6 bytes per vocabulary entry) and two FP32 residual-stream
        inputs per block (8 bytes per channel). Measured saved bytes per token are higher at every
        level (tiny model: 3,917 at O2, 4,620 at bf16, 5,452 at fp32; this bound: 2,048)."""
        world = max(1, int(os.environ.get("WORLD_SIZE", "1")))
        sequences = max(1, self.batch_size // world)
        tokens = sequences * model.block_size
        validation = self.eval_batches * self.batch_size * (model.block_size + 1) * 8
        weights = 4 * (model.vocab_size + model.block_size) * model.n_embd + 48 * model.n_layer * model.n_embd**2
        step = tokens * (6 * model.vocab_size + 8 * model.n_layer * model.n_embd) + weights
        return validation, step

    def _check_memory(self, model: GPTConfig) -> None:
        """Refuse sizes that cannot fit before anything is allocated: a lower bound of the bytes
        needed (`memory_needed`) against the memory available now."""
        host, step = self.memory_needed(model)
        device = self.device or default_device()
        on_device = available_memory(device)
        if torch.device(device).type == "cpu":
            host, step, on_device = host + step, 0, None
        for needed, free, where in ((host, available_memory("cpu"), "in host memory"), (step, on_device, device)):
            if free is not None and needed > free:
                raise RunError(
                    f"{self._sizes(model)} needs at least {needed / _GIB:.1f} GiB {where}, and {free / _GIB:.1f} GiB "
                    f"are available: {self._memory_fix()}"
                )

    def _sizes(self, model: GPTConfig) -> str:
        return f"--batch-size {self.batch_size} x --seq-len {model.block_size} with --eval-batches {self.eval_batches}"

    def _memory_fix(self) -> str:
        return "lower --batch-size (use --grad-accum for as many sequences per step) or --eval-batches"

    def _check_recipe(self) -> None:
        if self.recipe not in RECIPES:
            raise RunError(f"unknown --recipe {self.recipe!r}: use one of {', '.join(RECIPES)}")
        if self.recipe == DEFAULT_RECIPE:
            return
        if self.opt_level not in FP8_LEVELS:
            raise RunError(f"--recipe sets the FP8 layers of {'/'.join(FP8_LEVELS)} (this run is {self.opt_level})")
        legacy = sorted(set(self.amp_options) & {"recipe", "history_len", "scaling", "backend"})
        if legacy:
            raise RunError(f"--recipe {self.recipe} and fp8lm.initialize options {', '.join(legacy)}: pass one of them")

    def to_dict(self) -> dict:
        return asdict(self)

    def initialize_options(self) -> dict:
        """Keyword options of `fp8lm.initialize` for this run."""
        options = dict(self.amp_options)
        if self.recipe != DEFAULT_RECIPE:
            options["recipe"] = Recipe.from_name(self.recipe)
        if self.exp_avg_sq is not None:
            policy = {**options.get("policy", {}), "*": {"exp_avg_sq": self.exp_avg_sq.upper()}}
            options["policy"] = policy
        return options


def _check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RunError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type not in COMPUTE_DEVICES:
        raise RunError(f"--device {name} cannot train (it holds no data or is not supported): use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RunError(f"device {name!r} asked for, but torch sees no CUDA device here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise RunError(
            f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s); "
            "pass cuda:N with N below that"
        )


def available_memory(device: str) -> int | None:
    """Bytes ``device`` can still allocate (None when unknown): for the CPU, the kernel's
    ``MemAvailable`` and what is left under this process's cgroup limit, whichever is smaller."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev.index or 0)[0] if torch.cuda.is_available() else None
    if dev.type != "cpu":
        return None
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
