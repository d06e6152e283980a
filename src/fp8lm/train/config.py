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

import json
import math
import os
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .hf_model import HFModelConfig
    from .model import GPTConfig

# This module imports no torch (nor any module that does) at import time: the command line's
# options are generated from `TrainConfig` and `fp8lm --help` must not wait for torch.

__all__ = [
    "OPT_LEVELS",
    "FP8_LEVELS",
    "FP8_OPTIMIZER_LEVELS",
    "SECOND_MOMENT_FORMATS",
    "TrainConfig",
    "DPOConfig",
    "RunError",
    "default_device",
    "option",
    "option_fields",
]

# Names the options offer, spelled here so that they import no torch; tests/test_options.py checks
# each against the module that owns it.
FP8_LEVELS = ("O1", "O2", "O3")  # fp8lm.policy.FP8_LEVELS
GRAD_SYNC_SCALINGS = ("local", "shared")  # fp8lm.distributed.SCALINGS: FP8DataParallel's scaling modes
RECIPE_NAMES = (  # fp8lm.recipe.RECIPES
    "tensorwise-delayed",
    "tensorwise-current",
    "rowwise",
    "rowwise-wgrad-bf16",
    "blockwise",
    "mxfp8",
    "nvfp4",
    "nvfp4-4over6",
)
DEFAULT_RECIPE = "tensorwise-delayed"  # fp8lm.recipe.DEFAULT_RECIPE
MODEL_PRESETS = ("tiny", "small", "base", "gpt2")  # fp8lm.train.model.PRESETS
MLP_KINDS = ("gelu", "swiglu")  # fp8lm.train.model.MLP_KINDS
ARCHS = ("gpt", "llama")  # fp8lm.train.model.ARCHS
ACTIVATIONS = ("bf16", "fp8")  # fp8lm.policy.ACTIVATIONS
CHECKPOINTING = ("none", "selective", "full")  # fp8lm.train.model.CHECKPOINTING
MOE_ROUTERS = ("softmax", "sigmoid")  # fp8lm.nn.moe.ROUTERS

OPT_LEVELS = ("fp32", "bf16", *FP8_LEVELS)  # the two baselines, then fp8lm's levels
SECOND_MOMENT_FORMATS = ("FP16", "E4M3", "E5M2")
FP8_OPTIMIZER_LEVELS = ("O2", "O3")  # the levels that replace AdamW by fp8lm.optim.FP8AdamW
FP8_DATA_PARALLEL_LEVELS = ("O1", "O2")  # under torchrun: fp8lm.distributed.FP8DataParallel
# option -> (low, high, whether each end is allowed): what validate accepts
_NUMBER_RANGES = {
    "lr": (0.0, math.inf, (False, False)),
    "min_lr_ratio": (0.0, 1.0, (True, True)),
    "weight_decay": (0.0, math.inf, (True, False)),
    "beta1": (0.0, 1.0, (True, False)),
    "beta2": (0.0, 1.0, (True, False)),
    "grad_clip": (0.0, math.inf, (True, False)),
    "val_fraction": (0.0, 1.0, (False, False)),
    "final_bf16_fraction": (0.0, 1.0, (True, False)),
}
# --seed seeds torch's generators, with the rank added: within a signed 64-bit integer on any world size
_SEEDS = range(0, 2**63 - 2**20)
COMPUTE_DEVICES = ("cpu", "cuda")  # what a run can train on (not meta, not a lazy or virtual device)
_GIB = 2**30


class RunError(ValueError):
    """The run cannot start as asked (its output folder, or options that contradict each other)."""


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def option(
    default: Any = None,
    help: str | None = None,
    *,
    group: str | None = None,
    flag: str | None = None,
    choices: tuple | None = None,
    type: Any = None,
    metavar: str | None = None,
    resume: str = "keep",
) -> Any:
    """A configuration field that is also a command-line option: ``help`` (its text; a field
    without one is no option), ``group`` (the heading it is listed under), ``flag`` (default:
    ``--`` and the name with dashes), ``choices``, ``type`` (default: the field's annotation) and
    ``metavar``. A bool is a switch: ``--flag`` sets True, or, for a field whose default is True,
    a ``--no-...`` flag sets False. The command line's default is the field's default.

    ``resume``: what ``--resume`` does with it (`fp8lm.train.resume.resume_options`): ``"keep"``,
    the run's value is taken and another one refused; ``"free"``, it may change (how long, where,
    how often to evaluate or save); ``"layout"``, it is the command's (not the run's) and a change
    reshards."""
    metadata = {
        "help": help,
        "group": group,
        "flag": flag,
        "choices": choices,
        "type": type,
        "metavar": metavar,
        "resume": resume,
    }
    return field(default=default, metadata=metadata)


def option_fields(cls: type) -> list[Field]:
    """The fields of config class ``cls`` that are command-line options, in the order its
    ``OPTIONS`` lists them (all fields with a help text, in their order, when it lists none)."""
    found = {f.name: f for f in fields(cls) if f.metadata.get("help")}
    names = cls.OPTIONS if cls.OPTIONS is not None else tuple(found)
    return [found[name] for name in names]


def option_flag(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def option_default(f: Field) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


_MODEL, _OPTIM, _DATA, _OUTPUT = "model", "optimization", "data", "evaluation and output"
_PARALLEL, _NUMERICS = "parallelism (under torchrun)", "FP8 numerics"


@dataclass
class TrainConfig:
    """What a training run is asked to do. Each field with a help text is also an option of
    ``fp8lm train`` and ``fp8lm compare`` (`option`): adding an option is adding a field."""

    # the fields the command offers, in order (None: every field with a help text)
    OPTIONS: ClassVar[tuple[str, ...] | None] = None

    # precision
    opt_level: str = option(
        "bf16",
        "fp32; bf16 (autocast + FP32 AdamW, the baseline); O1 (FP8 GEMMs, FP8 weight gradients, FP32 weights); "
        "O2 (O1 + FP16 weights + FP8AdamW); O3 (O2 with FP8 weights; under torchrun, FP8 ZeRO)",
        choices=OPT_LEVELS,
    )
    out: str = option("runs/train", "output folder", resume="free")
    # model: a preset, with explicit sizes overriding it
    model: str = option(
        "small",
        f"size preset ({', '.join(MODEL_PRESETS)}), or a folder with a Hugging Face config.json (optionally "
        "safetensors weights and a tokenizer.json): the causal LM transformers builds from it (needs fp8lm[hf])",
        group=_MODEL,
        metavar="PRESET|PATH",
    )
    arch: str = option(
        "gpt",
        "gpt: GPT-2 (LayerNorm, learned positions, GELU, biases); llama: RMSNorm, rotary positions, SwiGLU, "
        "grouped-query attention, no biases",
        group=_MODEL,
        choices=ARCHS,
    )
    n_layer: int | None = option(None, "override the preset's number of blocks", group=_MODEL)
    n_head: int | None = option(None, "override the preset's attention heads", group=_MODEL)
    n_embd: int | None = option(None, "override the preset's width (keep it a multiple of 16 for FP8)", group=_MODEL)
    n_kv_head: int | None = option(
        None, "--arch llama: key/value heads, a divisor of --n-head (default: --n-head)", group=_MODEL
    )
    mlp: str | None = option(
        None, "MLP kind (default: gelu for --arch gpt, swiglu for llama)", group=_MODEL, choices=MLP_KINDS
    )
    moe_experts: int = option(
        0,
        "mixture of experts: every block's MLP becomes E experts of its kind (GELU for --arch gpt, SwiGLU for "
        "llama), their GEMMs in FP8 at the FP8 levels with a scale per expert; 0 = a dense MLP",
        group=_MODEL,
        metavar="E",
    )
    moe_top_k: int = option(2, "--moe-experts: experts each token goes to", group=_MODEL, metavar="K")
    moe_router: str = option(
        "softmax",
        "--moe-experts: the router's top-k, of softmax probabilities or sigmoid scores",
        group=_MODEL,
        choices=MOE_ROUTERS,
    )
    moe_shared_expert: bool = option(
        False, "--moe-experts: add a dense MLP that every token goes through too", group=_MODEL
    )
    moe_aux_loss_coef: float = option(
        0.01, "--moe-experts: weight of the load-balancing loss (Switch's) in the training loss", group=_MODEL
    )
    moe_capacity_factor: float | None = option(
        None,
        "--moe-experts: drop the token slots beyond ceil(F x slots / experts) per expert (Switch's capacity; "
        "the dropped fraction logged as moe_dropped); default: no token dropped",
        group=_MODEL,
        metavar="F",
    )
    # optimization
    steps: int = option(500, "optimizer steps", group=_OPTIM, resume="free")
    batch_size: int = option(16, "sequences per micro-batch", group=_OPTIM)
    grad_accum: int = option(1, "micro-batches per step", group=_OPTIM)
    seq_len: int | None = option(None, "tokens per sequence (default: the preset's block size)", group=_OPTIM)
    lr: float = option(3e-3, "peak learning rate", group=_OPTIM)
    min_lr_ratio: float = option(0.1, "final lr / peak lr of the cosine decay", group=_OPTIM)
    warmup_steps: int | None = option(None, "linear warmup steps (default: a tenth of --decay-steps)", group=_OPTIM)
    decay_steps: int | None = option(
        None,
        "length of the learning-rate schedule, warmup included: cosine decay to lr x --min-lr-ratio at this "
        "step, constant after it (default: --steps; --resume keeps the run's, pass it to decay again over a "
        "longer run)",
        group=_OPTIM,
        resume="free",
    )
    weight_decay: float = option(0.1, "AdamW weight decay of matrices", group=_OPTIM)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = option(1.0, "max gradient norm, 0 = no clipping", group=_OPTIM)
    # O2/O3: format of Adam's second moment (default FP16; E4M3/E5M2 = FP8)
    exp_avg_sq: str | None = option(
        None,
        "O2: format of Adam's second moment (default FP16; E4M3/E5M2 store it in FP8)",
        group=_OPTIM,
        choices=SECOND_MOMENT_FORMATS,
        type=str.upper,
    )
    activation_checkpointing: str = option(
        "none",
        "recompute activations in backward instead of keeping them: selective, every other block (the 2nd, "
        "4th, ...); full, every block (FP8 casts recomputed bit for bit: the same training)",
        group=_OPTIM,
        choices=CHECKPOINTING,
        resume="free",
    )
    seed: int = option(1337, "seed of the weights and the batch order", group=_OPTIM)
    device: str | None = option(
        None, "cpu, cuda, cuda:1, ... (default: cuda when available)", group=_OPTIM, resume="free"
    )
    # data
    data: str | None = option(
        None,
        "a text file or a folder of text files (default: the Python standard library's .py sources)",
        group=_DATA,
    )
    hf_dataset: str | None = option(
        None, "a Hugging Face dataset name (its 'text' column; needs the 'datasets' package)", group=_DATA
    )
    tokenizer: str | None = option(
        None,
        "bytes: the UTF-8 bytes, vocabulary 256; bpe: a byte-level BPE trained on the training split (Hugging "
        "Face tokenizers, cached with the packed tokens); or the path of a tokenizer.json file (default: a --model "
        "folder's tokenizer.json, else bytes)",
        group=_DATA,
        metavar="bytes|bpe|PATH",
    )
    vocab_size: int | None = option(
        None,
        "--tokenizer bpe: the vocabulary to train (default: 8192); the model's is padded to a multiple of 16 so "
        "that the output head suits FP8",
        group=_DATA,
    )
    val_fraction: float = option(0.05, "share of documents held out for validation", group=_DATA)
    cache_dir: str | None = option(
        None, "where packed tokens are cached (default: OUT/cache)", group=_DATA, resume="free"
    )
    # evaluation and output
    eval_every: int = option(100, "validate every N steps and at the end", group=_OUTPUT, resume="free")
    eval_batches: int = option(8, "validation batches", group=_OUTPUT, resume="free")
    save_every: int = option(
        0, "checkpoint every N steps; the final step is always saved", group=_OUTPUT, resume="free"
    )  # 0: only the final checkpoint
    keep_checkpoints: int = option(2, "checkpoints kept", group=_OUTPUT, resume="free")
    resume: bool = option(
        False,
        "continue the run in --out from its newest checkpoint, with the options it was started with (an option "
        "given that differs is refused; --steps extends it)",
        group=_OUTPUT,
        resume="free",
    )
    init_from: str | None = option(
        None,
        "start from a checkpoint's weights (fine-tuning): a step_*.pt file or a run folder",
        group=_OUTPUT,
        metavar="CHECKPOINT",
        resume="free",
    )
    progress: bool = option(True, "no progress bar", group=_OUTPUT, flag="--no-progress", resume="free")
    # parallelism
    fsdp: bool = option(
        False,
        "shard weights, gradients and optimizer state with FSDP2: O1/O2 gather weights and reduce-scatter "
        "gradients in FP8, bf16 in BF16 (torch's MixedPrecisionPolicy), fp32 in FP32; not with O3 (FP8 ZeRO); "
        "with --tp: FSDP2 over the data-parallel ranks (2-D)",
        group=_PARALLEL,
        resume="layout",
    )
    tp: int = option(
        1,
        "tensor + sequence parallel ranks per model replica: FP8 activations and gradients on the wire at "
        "O1/O2, BF16 at bf16 (world size = dp x tp x pp)",
        group=_PARALLEL,
        resume="layout",
    )
    pp: int = option(
        1,
        "pipeline stages per model replica (GPipe): FP8 activations and gradients between stages at O1/O2, "
        "BF16 at bf16",
        group=_PARALLEL,
        resume="layout",
    )
    ep: int = option(
        1,
        "--moe-experts: expert parallelism over groups of N ranks (N dividing the experts and the world size): "
        "each rank holds E/N experts of every block, tokens travel to them and back in FP8 (E4M3, gradients "
        "E5M2); everything else data-parallel (with --fsdp: sharded with FSDP2); O1/O2, bf16, fp32",
        group=_PARALLEL,
        metavar="N",
        resume="layout",
    )
    pp_microbatches: int = option(
        4, "with --pp: micro-batches each step's batch is split into", group=_PARALLEL, resume="layout"
    )
    # FP8 numerics
    telemetry_every: int | None = option(
        None,
        "record FP8 telemetry (amax, scale, underflow, saturation of every FP8 layer's tensors) to "
        "OUT/telemetry.jsonl every N steps; 0 = off (default: a fifth of --steps, at most 100, so that a "
        "short run is sampled too)",
        group=_NUMERICS,
        resume="free",
    )
    grad_sync_scaling: str = option(
        "local",
        "O1/O2 under torchrun: scaling of the FP8 gradient all-reduce. local: each rank scales its own "
        "tensors, sums in FP32; shared: one scale per bucket with the automatic factor mu of FP8-LM, logged "
        "as grad_sync_mu",
        group=_NUMERICS,
        choices=GRAD_SYNC_SCALINGS,
    )
    recipe: str = option(
        DEFAULT_RECIPE,
        "FP8 levels: the fp8lm.Recipe of the FP8 layers: tensorwise (one scale per tensor, delayed or current "
        "scaling), or fine-grained: rowwise, rowwise-wgrad-bf16, blockwise (1x128 / 128x128), mxfp8, nvfp4 "
        "(experimental); see docs/recipes.md",
        group=_NUMERICS,
        choices=RECIPE_NAMES,
    )
    activations: str | None = option(
        None,
        "FP8 levels: how the norms' and activation functions' inputs are saved for backward: bf16, as "
        "computed; fp8, in E4M3 with a scale per token and 128 features (the linear layers' inputs are FP8 "
        "at every FP8 level); default: fp8 at O2, bf16 at the other levels",
        group=_NUMERICS,
        choices=ACTIVATIONS,
    )
    policy: str | None = option(
        None,
        "FP8 levels: per-module rules over the level's precision policy, as JSON {pattern: {field: value}} "
        "(fields: weight, grad, master, exp_avg, exp_avg_sq, fp8_gemm, activations; patterns match module "
        'names), e.g. \'{"*ln_*": {"activations": "bf16"}}\' saves the norms\' inputs as computed; '
        "see docs/api.md",
        group=_NUMERICS,
        metavar="JSON",
    )
    fallback: bool = option(
        False,
        "move a layer to BF16 while its telemetry shows too much underflow or saturation, and back "
        "(fp8lm.fallback; switches logged to metrics.jsonl)",
        group=_NUMERICS,
    )
    final_bf16_fraction: float = option(
        0.0,
        "FP8 levels: run the last FRACTION of the steps with every FP8 layer's GEMMs in BF16 and its weight "
        "gradient in the weight's dtype (precision annealing, docs/recipes.md); 0: FP8 to the last step",
        group=_NUMERICS,
        metavar="FRACTION",
        resume="free",
    )
    amp_options: dict = field(default_factory=dict)  # extra keyword options of fp8lm.initialize

    def model_config(self) -> GPTConfig | HFModelConfig:
        """The model: a preset of the built-in GPT with the sizes given, its vocabulary the
        tokenizer's, or the Hugging Face model of a ``--model`` folder."""
        from .hf_model import folder_model_config, is_model_folder
        from .model import preset
        from .tokenizer import model_vocab_size

        if self.model not in MODEL_PRESETS:
            if not is_model_folder(self.model):
                raise RunError(
                    f"--model {self.model!r} is neither a size preset ({', '.join(MODEL_PRESETS)}) nor a folder "
                    "holding a Hugging Face config.json; pass one of those"
                )
            return folder_model_config(self.model, self.seq_len)
        return preset(
            self.model,
            vocab_size=model_vocab_size(self.tokenizer_spec(), self.vocab_size),
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            mlp=self.mlp,
            block_size=self.seq_len,
            arch=self.arch,
            n_kv_head=self.n_kv_head,
            moe_experts=self.moe_experts,
            moe_top_k=self.moe_top_k,
            moe_router=self.moe_router,
            moe_shared_expert=self.moe_shared_expert,
            moe_aux_loss_coef=self.moe_aux_loss_coef,
            moe_capacity_factor=self.moe_capacity_factor,
        )

    def model_folder(self) -> str | None:
        """The ``--model`` folder of a Hugging Face model (None: a preset)."""
        return None if self.model in MODEL_PRESETS else self.model

    def tokenizer_spec(self) -> str:
        """What ``--tokenizer`` resolves to: its value; else a ``--model`` folder's tokenizer.json
        when it has one; else bytes."""
        if self.tokenizer is not None:
            return self.tokenizer
        folder = self.model_folder()
        if folder is not None:
            from .hf_model import folder_tokenizer

            return folder_tokenizer(folder) or "bytes"
        return "bytes"

    def validate(self) -> None:
        if self.opt_level not in OPT_LEVELS:
            raise RunError(f"unknown opt level {self.opt_level!r}: use one of {', '.join(OPT_LEVELS)}")
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise RunError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "decay_steps", "save_every", "telemetry_every"):
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
        self._check_activations()
        self._check_policy()
        self._check_tokenizer()
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
        self._check_moe()
        if self.fallback and (self.opt_level not in FP8_LEVELS or self.telemetry_interval() == 0):
            raise RunError(
                f"--fallback acts on FP8 telemetry: it needs an FP8 level ({'/'.join(FP8_LEVELS)}, this run is "
                f"{self.opt_level}) and --telemetry-every >= 1 (got {self.telemetry_every})"
            )
        self._check_final_bf16()
        self._check_model_folder()
        try:
            model = self.model_config()
        except ValueError as e:  # a bad preset or sizes
            raise RunError(str(e)) from None
        self._check_vocabulary(model)
        if self.model_folder() is None:
            self._check_split(model)
        elif self.tp > 1 or self.pp > 1:
            self._check_folder_split(model)
        self._check_memory(model)

    def _check_final_bf16(self) -> None:
        if not self.final_bf16_fraction:
            return
        if self.opt_level not in FP8_LEVELS:
            raise RunError(
                f"--final-bf16-fraction moves the FP8 layers to BF16 ({'/'.join(FP8_LEVELS)}); this run is "
                f"{self.opt_level}: drop it or pick an FP8 level"
            )
        if self.fallback:
            raise RunError("--fallback and --final-bf16-fraction both switch layers to BF16: pass one of them")

    def bf16_from_step(self) -> int | None:
        """The first (0-based) step of ``--final-bf16-fraction``'s BF16 steps, None when there are none."""
        return first_bf16_step(self.steps, self.final_bf16_fraction)

    def _check_tokenizer(self) -> None:
        from .tokenizer import check_tokenizer_options

        check_tokenizer_options(self.tokenizer_spec(), self.vocab_size)

    def _check_model_folder(self) -> None:
        """What a ``--model`` folder does not combine with: the built-in model's sizes (--tp, --pp: `_check_folder_split`)."""
        if self.model_folder() is None:
            return
        from .hf_model import require_transformers

        require_transformers()
        sizes = {"--arch": self.arch != "gpt", "--mlp": self.mlp is not None}
        sizes |= {
            f"--{n.replace('_', '-')}": getattr(self, n) is not None
            for n in ("n_layer", "n_head", "n_embd", "n_kv_head")
        }
        given = [flag for flag, on in sizes.items() if on]
        if given:
            raise RunError(
                f"--model {self.model!r} takes its architecture and sizes from its config.json: drop {', '.join(given)}"
            )

    def _check_vocabulary(self, model: GPTConfig | HFModelConfig) -> None:
        """The tokenizer's ids fit the model's vocabulary (a --model folder sets its own)."""
        from .tokenizer import model_vocab_size

        needed = model_vocab_size(self.tokenizer_spec(), self.vocab_size)
        if needed > model.vocab_size:
            raise RunError(
                f"the tokenizer ({self.tokenizer_spec()}, {needed:,} ids padded) does not fit the vocabulary of "
                f"--model {self.model!r} ({model.vocab_size:,}): pass a smaller --vocab-size or a tokenizer of "
                "that model"
            )

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

    def _check_moe(self) -> None:
        """What --moe-experts combines with (not a --model folder), and --ep."""
        self._check_ep()
        if not self.moe_experts:
            return
        if self.model_folder() is not None:
            raise RunError(
                "--moe-experts builds the built-in models' experts; a --model folder has its own MLPs: drop it"
            )

    def _check_ep(self) -> None:
        if self.ep < 1:
            raise RunError(f"--ep must be >= 1, got {self.ep}")
        if self.ep == 1:
            return
        if not self.moe_experts or self.moe_experts % self.ep:
            raise RunError(
                f"--ep {self.ep} spreads the experts of --moe-experts over the ranks: pass --moe-experts E with E a "
                f"multiple of {self.ep} (got {self.moe_experts})"
            )
        if self.opt_level == "O3":
            raise RunError("--ep with O3: FP8 ZeRO would shard the experts each rank holds alone; use O2 with --ep")
        # groups of data-parallel ranks within each stage and tensor-parallel place
        world, needed = int(os.environ.get("WORLD_SIZE", "1")), self.ep * self.pp * self.tp
        if world % needed:
            within = [name for n, name in ((self.pp, "pipeline stage"), (self.tp, "tensor-parallel place")) if n > 1]
            raise RunError(
                f"--ep {self.ep} spreads the experts over groups of {self.ep} data-parallel ranks"
                f"{' of each ' + ' and '.join(within) if within else ''}: launch torchrun with a multiple of "
                f"{needed} ranks (this run has {world})"
            )

    def _check_folder_split(self, model: HFModelConfig) -> None:
        """A --model folder under --tp: its architecture declares a plan fp8lm splits, and --tp
        divides the sizes that plan splits; under --pp: a model its stages split."""
        from .hf_model import hf_config_object
        from .hf_parallel import check_pipeline_split, check_tensor_split, plan_sizes

        config = hf_config_object(model.hf_config)
        try:
            if self.pp > 1:
                check_pipeline_split(config, self.pp)
            if self.tp > 1:
                check_tensor_split(config)
        except ValueError as e:
            raise RunError(str(e)) from None
        if self.tp == 1:
            return
        for what, size in plan_sizes(config).items():
            if size % self.tp:
                raise RunError(
                    f"--tp {self.tp} splits the {what} of --model ({size}), which it does not divide: pick a divisor"
                )

    def _check_split(self, model: GPTConfig) -> None:
        """The model's sizes divide into --tp shards and --pp stages."""
        if model.n_layer % self.pp:
            raise RunError(f"--pp {self.pp} needs a layer count divisible by it, got {model.n_layer}: pick a divisor")
        sizes = {
            "--n-head": model.n_head,
            "--n-kv-head": model.n_kv_head,
            "--seq-len": model.block_size,
            "the vocabulary": model.vocab_size,
        }
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
        if device.split(":")[0] == "cpu":
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

    def _fp8_level_option(self, flag: str, what: str, amp_key: str) -> None:
        """Refuse ``flag`` (it sets ``what``) at a level without FP8 layers, or given twice: as the flag
        and as the fp8lm.initialize option ``amp_key``."""
        if self.opt_level not in FP8_LEVELS:
            raise RunError(
                f"{flag} sets {what} ({'/'.join(FP8_LEVELS)}); this run is {self.opt_level}: drop it or pick an "
                "FP8 level"
            )
        if amp_key in self.amp_options:
            raise RunError(f"{flag} and the fp8lm.initialize option {amp_key}: pass one of them")

    def _check_recipe(self) -> None:
        if self.recipe not in RECIPE_NAMES:
            raise RunError(f"unknown --recipe {self.recipe!r}: use one of {', '.join(RECIPE_NAMES)}")
        if self.recipe == DEFAULT_RECIPE:
            return
        self._fp8_level_option("--recipe", "the FP8 layers' scaling", "recipe")

    def _check_activations(self) -> None:
        if self.activations is not None and self.activations not in ACTIVATIONS:
            raise RunError(f"unknown --activations {self.activations!r}: use one of {', '.join(ACTIVATIONS)}")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise RunError(
                f"unknown --activation-checkpointing {self.activation_checkpointing!r}: use one of "
                f"{', '.join(CHECKPOINTING)}"
            )
        if self.activations is None or self.activations == "bf16":
            return
        self._fp8_level_option("--activations fp8", "how the FP8 levels save activations", "activations")

    def _check_policy(self) -> None:
        if self.policy is None:
            return
        self._fp8_level_option("--policy", "the precision policy of the FP8 levels", "policy")
        from ..policy import preset

        resolved = preset(self.opt_level)
        for pattern, changes in self.policy_overrides().items():
            try:
                resolved = resolved.override(pattern, **changes)
            except (TypeError, ValueError) as e:
                raise RunError(f"--policy rule {pattern!r}: {e}") from None

    def check_policy_names(self, model: Any) -> None:
        """Refuse a ``--policy`` pattern that matches none of ``model``'s module and parameter
        names: a rule that changes nothing is a misspelt name, not a choice."""
        if self.opt_level not in FP8_LEVELS or self.policy is None:
            return
        names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
        for pattern in self.policy_overrides():
            if not any(fnmatchcase(name, pattern) for name in names):
                examples = [n for n in names if n.count(".") >= 2][:3] or names[-3:]
                raise RunError(
                    f"--policy rule {pattern!r} matches no module or parameter of this model; its names look "
                    f"like {', '.join(map(repr, examples))} (fp8lm.nn.activation_targets lists its norms and "
                    "activations)"
                )

    def policy_overrides(self) -> dict[str, dict]:
        """``--policy`` parsed (`policy_rules`)."""
        return policy_rules(self.policy)

    def to_dict(self) -> dict:
        return asdict(self)

    def telemetry_interval(self) -> int:
        """Steps between FP8 telemetry samples (0: none), the default resolved from the run's length."""
        if self.telemetry_every is not None:
            return self.telemetry_every
        return min(100, max(1, self.steps // 5))

    def schedule(self) -> tuple[int, int]:
        """(warmup steps, schedule length) of the learning rate, defaults resolved."""
        length = self.steps if self.decay_steps is None else self.decay_steps
        return (length // 10 if self.warmup_steps is None else self.warmup_steps), length

    def options(self) -> dict:
        """The command-line options of this run as a checkpoint records them for ``--resume``, the
        schedule's defaults resolved (an extended run keeps its schedule)."""
        options = {f.name: getattr(self, f.name) for f in option_fields(type(self))}
        if "warmup_steps" in options:
            options["warmup_steps"], options["decay_steps"] = self.schedule()
        if "activations" in options:  # resolved: a resumed run keeps what it saved with
            options["activations"] = self.resolved_activations()
        return options

    def resolved_activations(self) -> str:
        """How this run saves activations outside the linear layers: ``--activations``, else the
        level's default (fp8 at O2, bf16 otherwise)."""
        if self.activations is not None:
            return self.activations
        if "activations" in self.amp_options:
            return str(self.amp_options["activations"])
        return "fp8" if self.opt_level == "O2" else "bf16"

    def initialize_options(self) -> dict:
        """Keyword options of `fp8lm.initialize` for this run."""
        from ..recipe import Recipe

        options = dict(self.amp_options)
        if self.recipe != DEFAULT_RECIPE:
            options["recipe"] = Recipe.from_name(self.recipe)
        if self.activations is not None and self.opt_level in FP8_LEVELS:
            options["activations"] = self.activations
        if self.policy is not None and self.opt_level in FP8_LEVELS:
            options["policy"] = self.policy_overrides()
        if self.exp_avg_sq is not None:  # the last rule: it decides over --policy's for every parameter
            policy = {**options.get("policy", {})}
            policy["*"] = {**policy.get("*", {}), "exp_avg_sq": self.exp_avg_sq.upper()}
            options["policy"] = policy
        return options


@dataclass
class DPOConfig(TrainConfig):
    """`TrainConfig` with DPO's defaults and options (``fp8lm dpo``): ``data`` is a JSON Lines file
    of pairs (None: the built-in set), ``batch_size`` counts pairs, the model comes from ``init_from``."""

    OPTIONS: ClassVar[tuple[str, ...] | None] = (
        "init_from",
        "opt_level",
        "data",
        "beta",
        "out",
        "steps",
        "batch_size",
        "lr",
        "warmup_steps",
        "decay_steps",
        "weight_decay",
        "seed",
        "val_fraction",
        "cache_dir",
        "eval_every",
        "save_every",
        "keep_checkpoints",
        "resume",
        "device",
        "progress",
    )

    init_from: str | None = option(
        None,
        "the pretrained model: a step_*.pt file or a run folder of fp8lm train (required unless --resume)",
        metavar="CHECKPOINT",
        resume="free",
    )
    opt_level: str = option(
        "O2",
        "the policy's level, as in fp8lm train; the frozen reference is stored in E4M3 at O1/O2/O3, in BF16 at bf16",
        choices=OPT_LEVELS,
    )
    data: str | None = option(
        None,
        "JSON Lines with 'prompt', 'chosen', 'rejected' strings (default: pairs built from the --init-from "
        "run's corpus: the true continuation chosen, a corrupted one rejected)",
        metavar="PAIRS.jsonl",
    )
    beta: float = option(0.1, "DPO's beta")
    out: str = option("runs/dpo", "output folder", resume="free")
    steps: int = option(200, "optimizer steps", resume="free")
    batch_size: int = option(16, "pairs per step")
    lr: float = option(3e-4, "peak learning rate")
    warmup_steps: int | None = option(10, "linear warmup steps")
    decay_steps: int | None = option(
        None,
        "length of the learning-rate schedule, warmup included: cosine decay to a tenth of --lr at this step, "
        "constant after it (default: --steps; --resume keeps the run's, pass it to decay again over a longer run)",
        resume="free",
    )
    weight_decay: float = option(0.0, "AdamW weight decay of matrices")
    seed: int = option(1337, "seed of the pair order")
    val_fraction: float = option(0.05, "share of --data pairs held out")
    cache_dir: str | None = option(
        None,
        "where the built-in pairs' corpus is packed (default: the pretraining run's packed tokens, read, or OUT/cache)",
        resume="free",
    )
    eval_every: int = option(50, "evaluate held-out pairs every N steps and at the end", resume="free")
    telemetry_every: int = 0

    def validate(self) -> None:
        if not (math.isfinite(self.beta) and self.beta > 0):  # inf: every loss non-finite, every step skipped
            raise RunError(f"--beta must be > 0 and finite, got {self.beta}")
        if not (self.init_from or self.resume):
            raise RunError(
                "fp8lm dpo starts from a trained model: pass --init-from CHECKPOINT (a step_*.pt or a run folder)"
            )
        if self.hf_dataset or self.telemetry_every or self.fallback or self.grad_accum != 1:
            raise RunError("fp8lm dpo does not take --hf-dataset, --telemetry-every, --fallback or --grad-accum")
        super().validate()  # last: it reads the checkpoint's model_config

    def memory_needed(self, model: GPTConfig) -> tuple[int, int]:
        """As `TrainConfig.memory_needed`, for pairs: a step and the held-out batches run the
        policy and the reference on ``2 x --batch-size`` sequences; no validation windows are held."""
        pairs = TrainConfig(batch_size=2 * self.batch_size, eval_batches=1, device=self.device)
        host, step = pairs.memory_needed(model)
        return host, 2 * step

    def _sizes(self, model: GPTConfig) -> str:
        return f"--batch-size {self.batch_size} pairs of up to {model.block_size} tokens"

    def _memory_fix(self) -> str:
        return "lower --batch-size"

    def model_config(self) -> GPTConfig | HFModelConfig:
        """The model of the starting checkpoint (of the run's own when resuming)."""
        from .checkpoint import CheckpointError, load_checkpoint
        from .hf_model import model_config_from_dict

        state = load_checkpoint(self.init_from or Path(self.out) / "checkpoints")
        if "model_config" not in state:
            raise CheckpointError(f"checkpoint {state['path']!r} has no model_config; pass one written by fp8lm train")
        return model_config_from_dict(state["model_config"])


def first_bf16_step(steps: int, fraction: float) -> int | None:
    """The first (0-based) of the last ``round(fraction * steps)`` steps (``--final-bf16-fraction``'s
    BF16 steps), None when there are none."""
    tail = round(fraction * steps)
    return steps - tail if tail > 0 else None


def policy_rules(policy: str | None) -> dict[str, dict]:
    """``--policy`` parsed: ``{pattern: {field: value}}`` (empty without it). JSON only: the option
    is data, never code, also when ``--resume`` or an export reads it back from a checkpoint."""
    if policy is None:
        return {}
    example = '\'{"*ln_*": {"activations": "bf16"}}\''
    try:
        rules = json.loads(policy)
    except json.JSONDecodeError as e:
        raise RunError(f"--policy is not JSON ({e.msg} at character {e.pos}): pass e.g. {example}") from None
    if not isinstance(rules, dict) or not all(isinstance(c, dict) for c in rules.values()):
        raise RunError(f"--policy takes a JSON object of {{pattern: {{field: value}}}}, e.g. {example}")
    return rules


def _check_device(name: str) -> None:
    import torch

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
    import torch

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
