"""E4M3 weights with per-tensor scales in the ``compressed-tensors`` "float-quantized" format.

The scale is the one fp8lm's FP8 GEMM gives a weight (`fp8lm.scaling.compute_scale`: the power of
two ``2**floor(log2(448 / amax))``), so an exported weight is the E4M3 operand the model was
trained and evaluated with, bit for bit. ``compressed-tensors`` stores the dequantization factor:
``value = weight * weight_scale``, ``weight_scale = 1 / scale``.
"""

from __future__ import annotations

import torch

from ..formats import E4M3
from ..ops.cast import saturating_cast
from ..scaling import compute_scale

__all__ = ["quantize_weight", "dequantize_weight", "quantization_config"]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3, weight_scale)``: ``weight`` in E4M3 with one power-of-two scale for the tensor
    (``weight_scale`` of shape ``(1,)``, float32), rounded to nearest even."""
    value = weight.detach().float()
    scale = compute_scale(value.abs().amax(), E4M3)
    return saturating_cast(value, scale, E4M3), scale.reciprocal().reshape(1)


def dequantize_weight(
    e4m3: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values ``e4m3 * weight_scale`` stand for (as a reader of the format computes them)."""
    return (e4m3.float() * weight_scale.float()).to(dtype)


def quantization_config(ignore: list[str], dequantize: bool) -> dict:
    """The ``quantization_config`` entry of ``config.json``: FP8 (E4M3) weights of the linear layers,
    static per-tensor scales, activations unquantized; ``ignore``: module names kept in BF16.
    ``dequantize``: transformers reads the weights back into BF16 at load time, needed where the
    model's linear layers are GPT-2 ``Conv1D`` modules, which compressed-tensors' runtime does not
    quantize (serving engines such as vLLM build their own linear layers and ignore the flag)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    config: dict[str, object] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ignore,
    }
    if dequantize:
        config["dequantize"] = True
    return config
