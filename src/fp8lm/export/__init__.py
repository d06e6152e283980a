"""Exports for serving: a model as a Hugging Face folder (``transformers``, vLLM, SGLang), its
weights in BF16 (``"hf"``) or its linear layers' weights in E4M3 with the scales of the recipe
the model computed with (``"hf-fp8"``, ``compressed-tensors``' "float-quantized" format, or
"mxfp8-quantized" for mxfp8).

The library layer: it takes a ``transformers`` model (`save_pretrained`); turning a training run
of the ``fp8lm`` command into one is the command's (``fp8lm export``). Needs ``transformers`` and
``safetensors`` (``pip install fp8lm[hf]``).
"""

from importlib import import_module

from .folder import ExportError, atomic_folder
from .formats import FORMATS

# The rest imports torch: loaded on first use, so the command line can name the formats and errors
# without it.
_LAZY = {
    "save_pretrained": "pretrained",
    "model_recipe": "pretrained",
    "require_hf": "pretrained",
    "WEIGHTS_NAME": "pretrained",
    "quantize_weight": "fp8",
    "quantize_weights": "fp8",
    "weight_scheme": "fp8",
    "WeightScheme": "fp8",
    "dequantize_weight": "fp8",
    "quantization_config": "fp8",
    "activation_args": "fp8",
}

__all__ = [
    "save_pretrained",
    "model_recipe",
    "require_hf",
    "FORMATS",
    "WEIGHTS_NAME",
    "ExportError",
    "atomic_folder",
    "quantize_weight",
    "quantize_weights",
    "weight_scheme",
    "WeightScheme",
    "dequantize_weight",
    "activation_args",
    "quantization_config",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'fp8lm.export' has no attribute {name!r}")
