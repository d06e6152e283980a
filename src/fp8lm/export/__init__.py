"""Exports for serving: a model as a Hugging Face folder (``transformers``, vLLM, SGLang), its
weights in BF16 (``"hf"``) or its linear layers' weights in E4M3 with their scales
(``"hf-fp8"``, the ``compressed-tensors`` "float-quantized" format).

The library layer: it takes a ``transformers`` model (`save_pretrained`); turning a training run
of the ``fp8lm`` command into one is the command's (``fp8lm export``). Needs ``transformers`` and
``safetensors`` (``pip install fp8lm[hf]``).
"""

from .folder import ExportError, atomic_folder
from .fp8 import dequantize_weight, quantization_config, quantize_weight
from .pretrained import FORMATS, WEIGHTS_NAME, require_hf, save_pretrained

__all__ = [
    "save_pretrained",
    "require_hf",
    "FORMATS",
    "WEIGHTS_NAME",
    "ExportError",
    "atomic_folder",
    "quantize_weight",
    "dequantize_weight",
    "quantization_config",
]
