"""`save_pretrained`: a Hugging Face model (fp8lm-converted or not) as a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads, with BF16 or FP8 weights."""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn.linear import FP8Linear, is_conv1d
from ..recipe import Recipe, recipe_from
from .folder import ExportError, atomic_folder, check_destination
from .formats import FORMATS
from .fp8 import WeightScheme, activation_args, quantization_config, quantize_weights, weight_scheme

__all__ = ["save_pretrained", "model_recipe", "require_hf", "WEIGHTS_NAME"]

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
    recipe: Recipe | str | None = None,
    fused: Sequence[Sequence[str]] = (),
    input_activations: str = "bf16",
) -> Path:
    """Write ``model`` (a ``transformers`` causal LM, its linear layers plain or `FP8Linear`) to the
    folder ``out``: ``config.json``, ``model.safetensors``, ``generation_config.json``, the
    tokenizer (a ``tokenizers.Tokenizer`` or a transformers tokenizer) and ``README.md``.

    ``format="hf"``: every weight in BF16. ``format="hf-fp8"``: the linear layers' weights in E4M3
    with the scales of the recipe the model computes with (``compressed-tensors``, `fp8lm.export.fp8`:
    per tensor, per output channel for rowwise, 128 x 128 blocks for blockwise, MXFP8 groups for
    mxfp8), the output head and everything else in BF16. The recipe is the one of the model's
    `FP8Linear` layers (a model converted by `fp8lm.initialize`), else ``recipe`` (an
    `fp8lm.Recipe` or its name; None: per-tensor scales). ``fused``: groups of linear-layer
    names whose weights the trained model computed as one operand, stacked along the output rows
    in this order (fused k/v or gate/up projections split for the Hugging Face class): they are
    quantized together, each getting its share of the operand's payload and scales.
    ``input_activations="fp8"`` (``hf-fp8`` only): the folder also declares the linear layers'
    inputs E4M3, scaled per batch in the recipe's blocks (`fp8lm.export.fp8.activation_args`:
    W8A8, as the model trained; serving engines' FP8 GEMMs need it, and vLLM's CPU build has no
    FP8 kernel without it); models with GPT-2 ``Conv1D`` layers are refused (transformers would
    not quantize their inputs). The folder appears complete or not at all; an existing non-empty
    ``out`` is refused unless ``overwrite``. Returns ``out``."""
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
    fp8_recipe = model_recipe(model, recipe) if format == "hf-fp8" else None
    scheme = weight_scheme(fp8_recipe)
    activations = _activations(model, format, fp8_recipe, input_activations)
    tensors, quantized = _weights(model, format == "hf-fp8", fp8_recipe, fused)
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    config.dtype = "bfloat16"
    if format == "hf-fp8":
        head = _head_names(model)
        transposed = any(_transposed(m) for m in quantized)
        config.quantization_config = quantization_config(head, transposed, scheme, activations)
    with atomic_folder(out, overwrite) as tmp:
        _save_tensors(tensors, tmp / WEIGHTS_NAME)
        config.save_pretrained(tmp)
        _generation_config(config, generation_config).save_pretrained(tmp)
        if tokenizer is not None:
            _as_transformers_tokenizer(tokenizer).save_pretrained(tmp)
        default = _default_readme(type(model).__name__, format, scheme)
        (tmp / "README.md").write_text(readme if readme is not None else default)
    return out


def _activations(model: nn.Module, format: str, recipe: Recipe | None, input_activations: str) -> dict | None:
    """The ``input_activations`` entry an export declares (None: BF16 inputs); one `ExportError`
    line for a request it cannot honour."""
    if input_activations not in ("bf16", "fp8"):
        raise ExportError(f"unknown input_activations {input_activations!r}: use bf16 or fp8")
    if input_activations == "bf16":
        return None
    if format != "hf-fp8":
        raise ExportError("FP8 input activations need FP8 weights: export with format 'hf-fp8'")
    if any(_transposed(m) for m in _linear_layers(model).values()):
        raise ExportError(
            "the model has GPT-2 Conv1D layers, whose inputs transformers does not quantize: export with "
            "--input-activations bf16, or train --arch llama (nn.Linear layers)"
        )
    return activation_args(recipe)


def model_recipe(model: nn.Module, recipe: Recipe | str | None = None) -> Recipe | None:
    """The recipe whose weight operands an ``hf-fp8`` export writes: the one of ``model``'s FP8
    layers (`FP8Linear`; one recipe for all), else ``recipe`` (None: none, per-tensor scales). One
    `ExportError` line where they disagree."""
    given = None if recipe is None else recipe_from(recipe, "save_pretrained")
    layers = {m.recipe for m in model.modules() if isinstance(m, FP8Linear)}
    if len(layers) > 1:
        names = ", ".join(sorted(r.name or "custom" for r in layers))
        raise ExportError(f"the model's FP8 layers use several recipes ({names}); an hf-fp8 export holds one")
    if not layers:
        return given
    (own,) = layers
    if given is not None and given != own:
        raise ExportError(
            f"recipe {given.name or 'custom'} was given but the model's FP8 layers compute with "
            f"{own.name or 'a custom recipe'}: pass that one or none"
        )
    return own


def require_hf(extra: str | None = None) -> None:
    """Raise one `ExportError` line when a package an export needs is missing."""
    for name in ("transformers", "safetensors", "tokenizers", *([extra] if extra else [])):
        if importlib.util.find_spec(name) is None:
            package = name.replace("_", "-")
            raise ExportError(f"exports need the {package!r} package: pip install {package} (or fp8lm[hf])")


def _weights(
    model: nn.Module, fp8: bool, recipe: Recipe | None, fused: Sequence[Sequence[str]]
) -> tuple[dict[str, torch.Tensor], list[nn.Module]]:
    """The tensors to write by name (BF16, or E4M3 + ``weight_scale`` for the linear layers when
    ``fp8``, as ``recipe``'s weight operands) and the linear modules quantized."""
    layers = _linear_layers(model) if fp8 else {}
    state = model.state_dict()
    keep = {name for name, _ in model.named_parameters()} | {
        name for name, _ in model.named_buffers() if name in state and not _is_fp8lm_state(model, name)
    }
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(keep & state.keys()):
        value = state[name].detach()
        if value.is_floating_point():
            tensors[name] = value.to(torch.bfloat16).contiguous().clone()
        else:
            tensors[name] = value.contiguous().clone()
    for group in _operand_groups(layers, fused) if fp8 else []:
        values = [state[f"{name}.weight"] for name in group]
        parts = quantize_weights(values, recipe, transposed=_transposed(layers[group[0]]))
        for name, (e4m3, weight_scale) in zip(group, parts):
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = e4m3, weight_scale
    return tensors, list(layers.values())


def _operand_groups(layers: dict[str, nn.Module], fused: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """The linear layers to quantize, each group one GEMM operand: the ``fused`` groups, then every
    other layer alone."""
    groups = [tuple(group) for group in fused]
    grouped = [name for group in groups for name in group]
    for name in grouped:
        if name not in layers:
            raise ExportError(f"fused names {name!r}, which is not one of the model's quantized linear layers")
    if len(set(grouped)) != len(grouped):
        raise ExportError("fused names a linear layer in more than one group; give each layer once")
    for group in groups:
        if len({_transposed(layers[name]) for name in group}) > 1:
            raise ExportError(f"fused group {group} mixes Conv1D and Linear layers; fuse layers of one kind")
    return groups + [(name,) for name in layers if name not in set(grouped)]


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


def _default_readme(architecture: str, format: str, scheme: WeightScheme) -> str:
    weights = "BF16" if format == "hf" else f"E4M3 linear-layer weights, {scheme.describe()} (compressed-tensors)"
    return f"# {architecture}\n\nExported with fp8lm (format `{format}`: {weights}).\n"
