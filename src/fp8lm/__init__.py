"""fp8lm: FP8 training for large language models on stock PyTorch.

Layers, bottom to top (each imports only those below it):
formats & scaling -> FP8 tensor & kernels -> nn modules -> optimizers -> distributed -> training app.
"""

from importlib import import_module

from .formats import BF16, E4M3, E5M2, FP16, FP32, Format
from .recipe import Recipe
from .scaling import ScalingMeta, compute_scale
from .tensor import ScalingTensor, quantize

__version__ = "0.1.0"

# Higher layers load on first use, so `import fp8lm` stays light and the core has no upward import.
_LAZY = {
    "initialize": "amp",
    "memory_report": "memory",
    "clip_grad_norm_": "grad",
    "zero_grad": "grad",
    "grads_are_finite": "grad",
}
_SUBPACKAGES = {"nn", "optim", "distributed", "train", "policy", "ops"}

__all__ = [
    "Format",
    "E4M3",
    "E5M2",
    "FP16",
    "BF16",
    "FP32",
    "Recipe",
    "compute_scale",
    "ScalingMeta",
    "ScalingTensor",
    "quantize",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBPACKAGES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fp8lm' has no attribute {name!r}")
