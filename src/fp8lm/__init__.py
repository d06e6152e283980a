"""fp8lm: FP8 training for large language models on stock PyTorch.

Layers, bottom to top (each imports only those below it):
formats & scaling -> FP8 tensor & kernels -> nn modules -> optimizers -> distributed -> training app.
"""

from importlib import import_module

__version__ = "0.1.0"

# Every name loads on first use: `import fp8lm` imports no torch (the `fp8lm` command answers
# `--help` at once), and the core has no upward import.
_LAZY = {
    "Format": "formats",
    "E4M3": "formats",
    "E5M2": "formats",
    "FP16": "formats",
    "BF16": "formats",
    "FP32": "formats",
    "Recipe": "recipe",
    "fake_quantize": "ops.finegrained",
    "compute_scale": "scaling",
    "ScalingMeta": "scaling",
    "ScalingTensor": "tensor",
    "quantize": "tensor",
    "allow_dequantize_fallback": "tensor",
    "initialize": "amp",
    "memory_report": "memory",
    "clip_grad_norm_": "grad",
    "zero_grad": "grad",
    "grads_are_finite": "grad",
}
_SUBPACKAGES = {
    "nn",
    "optim",
    "distributed",
    "train",
    "policy",
    "ops",
    "formats",
    "recipe",
    "scaling",
    "tensor",
    "amp",
    "memory",
    "grad",
    "telemetry",
    "fallback",
}

__all__ = [*_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBPACKAGES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fp8lm' has no attribute {name!r}")
