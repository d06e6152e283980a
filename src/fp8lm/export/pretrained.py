"""`save_pretrained`: a Hugging Face model (fp8lm-converted or not) as a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads, with BF16 or FP8 weights."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn.linear import FP8Linear, is_conv1d
from .folder import ExportError, atomic_folder, check_destination
from .formats import FORMATS
from .fp8 import quantization_config, quantize_weight

__all__ = ["save_pretrained", "require_hf", "WEIGHTS_NAME"]

WEIGHTS_NAME = "model.safetensors"


def save_pretrained(
    model: nn.Module,
    out: str | os.PathLike,
    *,
    format: str = "hf",
    tokenizer: Any = None,
    generation_config: Any = None,
    readme: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (a ``transformers`` causal LM, its linear layers plain or `FP8Linear`) to the
    folder ``out``: ``config.json``, ``model.safetensors``, ``generation_config.json``, the
    tokenizer (a ``tokenizers.Tokenizer`` or a transformers tokenizer) and ``README.md``.

    ``format="hf"``: every weight in BF16. ``format="hf-fp8"``: the linear layers' weights in E4M3
    with per-tensor scales (``compressed-tensors`` "float-quantized", `fp8lm.export.fp8`), the
    output head and everything else in BF16. The folder appears complete or not at all; an
    existing non-empty ``out`` is refused unless ``overwrite``. Returns ``out``."""
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}: use one of {', '.join(FORMATS)}")
    require_hf("compressed_tensors" if format == "hf-fp8" else None)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ExportError(
            f"save_pretrained expects a transformers model (with a .config), got {type(model).__name__}; "
            "build the Hugging Face model first"
        )
    out = Path(out)
    check_destination(out, overwrite)  # before the (possibly long) conversion
    tensors, quantized = _weights(model, format == "hf-fp8")
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    config.dtype = "bfloat16"
    if format == "hf-fp8":
        head = _head_names(model)
        config.quantization_config = quantization_config(head, dequantize=any(_transposed(m) for m in quantized))
    with atomic_folder(out, overwrite) as tmp:
        _save_tensors(tensors, tmp / WEIGHTS_NAME)
        config.save_pretrained(tmp)
        _generation_config(config, generation_config).save_pretrained(tmp)
        if tokenizer is not None:
            _as_transformers_tokenizer(tokenizer).save_pretrained(tmp)
        (tmp / "README.md").write_text(readme if readme is not None else _default_readme(type(model).__name__, format))
    return out


def require_hf(extra: str | None = None) -> None:
    """Raise one `ExportError` line when a package an export needs is missing."""
    for name in ("transformers", "safetensors", "tokenizers", *([extra] if extra else [])):
        if importlib.util.find_spec(name) is None:
            package = name.replace("_", "-")
            raise ExportError(f"exports need the {package!r} package: pip install {package} (or fp8lm[hf])")


def _weights(model: nn.Module, fp8: bool) -> tuple[dict[str, torch.Tensor], list[nn.Module]]:
    """The tensors to write by name (BF16, or E4M3 + ``weight_scale`` for the linear layers when
    ``fp8``) and the linear modules quantized."""
    layers = _linear_layers(model) if fp8 else {}
    state = model.state_dict()
    keep = {name for name, _ in model.named_parameters()} | {
        name for name, _ in model.named_buffers() if name in state and not _is_fp8lm_state(model, name)
    }
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(keep & state.keys()):
        value = state[name].detach()
        module_name, _, leaf = name.rpartition(".")
        if leaf == "weight" and module_name in layers:
            tensors[name], tensors[f"{module_name}.weight_scale"] = quantize_weight(value)
        elif value.is_floating_point():
            tensors[name] = value.to(torch.bfloat16).contiguous().clone()
        else:
            tensors[name] = value.contiguous().clone()
    return tensors, list(layers.values())


def _linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers whose weights go to FP8: ``nn.Linear``, GPT-2 ``Conv1D`` and `FP8Linear`, but not
    the output head (serving engines keep it in high precision)."""
    head = set(_head_names(model))
    return {
        name: m
        for name, m in model.named_modules()
        if name not in head and (isinstance(m, (nn.Linear, FP8Linear)) or is_conv1d(m))
    }


def _head_names(model: nn.Module) -> list[str]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return [name for name, m in model.named_modules() if m is head and head is not None]


def _transposed(module: nn.Module) -> bool:
    """Whether the model class stores this layer's weight as (in, out): a GPT-2 ``Conv1D``."""
    return is_conv1d(module) or bool(getattr(module, "transposed_checkpoint", False))


def _is_fp8lm_state(model: nn.Module, name: str) -> bool:
    """Buffers of fp8lm's scaling state (amax histories): training state, not weights."""
    module_name = name.rpartition(".")[0]
    return any(part.endswith("_meta") for part in module_name.split("."))


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # as the other files (safetensors creates it private)


def _generation_config(config, given):
    from transformers import GenerationConfig

    return given if given is not None else GenerationConfig.from_model_config(config)


def _as_transformers_tokenizer(tokenizer):
    """A ``tokenizers.Tokenizer`` wrapped as transformers' fast tokenizer; others as they are."""
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def _default_readme(architecture: str, format: str) -> str:
    weights = "BF16" if format == "hf" else "E4M3 linear-layer weights with per-tensor scales (compressed-tensors)"
    return f"# {architecture}\n\nExported with fp8lm (format `{format}`: {weights}).\n"
