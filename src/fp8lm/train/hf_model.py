"""``--model PATH``: a local Hugging Face model folder as the run's model.

The folder holds a ``config.json`` of a causal LM that ``transformers`` knows (its ``model_type``;
a config naming custom code, ``auto_map``, is refused: nothing in a model folder runs), optionally
its weights as safetensors (``model.safetensors`` or an index of shards; pickled ``.bin``/``.pt``
weights are refused, reading them can run code) and optionally a ``tokenizer.json``, which then
is the run's tokenizer unless ``--tokenizer`` names another.

`HFModelConfig` is what the run and its checkpoints record of it (the config as built, its sizes);
`HFCausalLM` wraps ``AutoModelForCausalLM`` (``from_config``, or ``from_pretrained`` with
``use_safetensors=True`` when weights are there; float32, never ``trust_remote_code``) so that the
training loop sees the built-in GPT's interface: ``forward(idx, targets) -> (logits, loss)``, the
loss computed as the GPT computes it, and ``blocks``, the decoder layers FSDP2 wraps one by one.
Its vocabulary is padded to a multiple of 16 (`fp8lm.train.tokenizer.VOCAB_MULTIPLE`), so that the
output head suits FP8. `fp8lm.initialize` then converts it like any model (its ``nn.Linear`` and
GPT-2 ``Conv1D`` layers).

`model_config_from_dict` and `build_model` serve either kind of model: the built-in `GPT` or this.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import RunError
from .model import GPT, GPTConfig
from .tokenizer import HF_EXTRA, padded_vocab

__all__ = [
    "HFModelConfig",
    "HFCausalLM",
    "is_model_folder",
    "require_transformers",
    "folder_model_config",
    "folder_tokenizer",
    "model_config_from_dict",
    "build_model",
    "hf_config_object",
]

CONFIG_FILE, TOKENIZER_FILE = "config.json", "tokenizer.json"
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# config.json keys that name code outside transformers
_REMOTE_CODE = ("auto_map",)


def require_transformers(what: str = "--model PATH") -> None:
    """One `RunError` line when Hugging Face ``transformers`` is not installed."""
    for name in ("transformers", "safetensors"):
        if importlib.util.find_spec(name) is None:
            raise RunError(f"{what} needs Hugging Face {name}: {HF_EXTRA}")


def is_model_folder(path: str) -> bool:
    """Whether ``--model`` names a folder holding a ``config.json`` (not a preset)."""
    return (Path(path).expanduser() / CONFIG_FILE).is_file()


@dataclass(frozen=True)
class HFModelConfig:
    """A Hugging Face causal LM as a run records it: ``hf_config``, its config as built (the
    vocabulary padded), and the sizes the run reads (as `GPTConfig` names them)."""

    hf_config: dict = field(repr=False)
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int

    @property
    def model_type(self) -> str:
        return str(self.hf_config["model_type"])

    @property
    def arch(self) -> str:  # what the checks that compare architectures see
        return f"hf:{self.model_type}"

    mlp = None  # not one of the built-in kinds
    bias = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HFModelConfig:
        names = {"hf_config", "vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd"}
        if set(d) != names or not isinstance(d["hf_config"], dict):
            raise ValueError(f"a Hugging Face model's record needs exactly {sorted(names)}, got {sorted(d)}")
        return cls(**d)


def model_config_from_dict(d: dict) -> GPTConfig | HFModelConfig:
    """The model config a checkpoint records: a built-in GPT's or a Hugging Face model's."""
    return HFModelConfig.from_dict(d) if "hf_config" in d else GPTConfig.from_dict(d)


def build_model(config: GPTConfig | HFModelConfig, folder: str | None = None) -> nn.Module:
    """The model of ``config``, random weights (a Hugging Face one's from ``folder``'s safetensors
    when ``folder`` is given and holds them)."""
    if isinstance(config, HFModelConfig):
        return HFCausalLM(config, folder)
    return GPT(config)


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise RunError(
            f"--model {str(folder)!r}: {CONFIG_FILE} cannot be read as JSON ({e}); pass another folder"
        ) from None
    if not isinstance(d, dict) or not isinstance(d.get("model_type"), str):
        raise RunError(
            f"--model {str(folder)!r}: {CONFIG_FILE} has no 'model_type'; pass a folder written by "
            "transformers' save_pretrained"
        )
    for key in _REMOTE_CODE:
        if key in d:
            raise RunError(
                f"--model {str(folder)!r}: {CONFIG_FILE} names custom code ({key!r}); fp8lm runs no code from a "
                "model folder: use a model type that transformers has"
            )
    return d


def hf_config_object(d: dict):
    """The ``transformers`` config of the dict ``d`` (``model_type`` picks its class)."""
    from transformers import AutoConfig

    values = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version")}
    try:
        return AutoConfig.for_model(d["model_type"], **values)
    except (ValueError, KeyError, TypeError) as e:
        raise RunError(
            f"--model: config.json's model_type {d['model_type']!r} is not one transformers builds here ({_line(e)})"
        ) from None


def _sizes(config) -> dict:
    """The sizes the run reads, from a ``transformers`` config's standard attribute names."""

    def first(*names: str) -> Any:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    sizes = {
        "n_layer": first("num_hidden_layers", "n_layer"),
        "n_head": first("num_attention_heads", "n_head"),
        "n_embd": first("hidden_size", "n_embd", "d_model"),
        "positions": first("max_position_embeddings", "n_positions"),
    }
    sizes["n_kv_head"] = first("num_key_value_heads") or sizes["n_head"]
    return sizes


def folder_model_config(folder: str, seq_len: int | None = None) -> HFModelConfig:
    """The `HFModelConfig` of ``--model folder`` (checked: readable, a causal LM transformers
    builds, weights not pickled), ``seq_len`` tokens per sequence (default: its positions)."""
    require_transformers()
    path = Path(folder).expanduser()
    pickles = sorted(p.name for pattern in _PICKLES for p in path.glob(pattern))
    if pickles and not weights_in(path):
        raise RunError(
            f"--model {str(path)!r} holds its weights as pickles ({pickles[0]}), which can run code when read; "
            "convert them to safetensors (save_pretrained(..., safe_serialization=True)) or remove them"
        )
    d = _read_config(path)
    config = hf_config_object(d)
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise RunError(
            f"--model {str(path)!r}: model_type {d['model_type']!r} is not a causal language model transformers "
            "knows (AutoModelForCausalLM); pass the folder of a decoder such as llama or gpt2"
        )
    sizes = _sizes(config)
    missing = [k for k in ("n_layer", "n_head", "n_embd") if sizes[k] is None]
    if missing:
        raise RunError(f"--model {str(path)!r}: {CONFIG_FILE} does not say the model's {', '.join(missing)}")
    positions = sizes["positions"]
    block_size = seq_len or positions or 1024
    if positions is not None and block_size > positions:
        raise RunError(
            f"--seq-len {block_size} exceeds the {positions} positions of --model {str(path)!r}; pass at most that"
        )
    built = config.to_dict()
    built["vocab_size"] = padded_vocab(int(config.vocab_size))
    built["model_type"] = d["model_type"]
    built.pop("transformers_version", None)
    return HFModelConfig(
        hf_config=json.loads(json.dumps(built)),  # plain JSON values: what a checkpoint stores
        vocab_size=built["vocab_size"],
        block_size=block_size,
        n_layer=sizes["n_layer"],
        n_head=sizes["n_head"],
        n_kv_head=sizes["n_kv_head"],
        n_embd=sizes["n_embd"],
    )


def weights_in(folder: Path) -> bool:
    return any((folder / name).is_file() for name in SAFETENSORS)


def folder_tokenizer(folder: str) -> str | None:
    """The ``tokenizer.json`` of a model folder (None: it has none)."""
    path = Path(folder).expanduser() / TOKENIZER_FILE
    return str(path) if path.is_file() else None


@contextlib.contextmanager
def _quiet_loading():
    """transformers' progress bars off while a model is built (the run prints its own progress)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: the ModuleList of the classes transformers names as not to be
    split (``_no_split_modules``), else the longest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    for candidate in lists:
        if all(type(c).__name__ in names for c in candidate):
            return candidate
    return max(lists, key=len) if lists else nn.ModuleList()


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind the built-in GPT's interface:
    ``forward(idx, targets=None) -> (logits, loss)``; ``blocks``: its decoder layers."""

    def __init__(self, config: HFModelConfig, folder: str | None = None) -> None:
        super().__init__()
        require_transformers()
        from transformers import AutoModelForCausalLM

        self.config = config
        hf_config = hf_config_object(config.hf_config)
        with _quiet_loading():
            if folder is not None and weights_in(Path(folder).expanduser()):
                model = AutoModelForCausalLM.from_pretrained(
                    Path(folder).expanduser(),
                    use_safetensors=True,
                    trust_remote_code=False,
                    dtype=torch.float32,
                )
                if model.get_input_embeddings().weight.shape[0] != config.vocab_size:
                    model.resize_token_embeddings(config.vocab_size)  # padded to a multiple of 16
            else:
                model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False, dtype=torch.float32)
        self.hf = model

    @property
    def blocks(self) -> nn.ModuleList:
        return _decoder_layers(self.hf)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.shape[1] > self.config.block_size:
            raise ValueError(
                f"sequence length {idx.shape[1]} exceeds the model's block_size {self.config.block_size}; "
                "use a shorter sequence"
            )
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
