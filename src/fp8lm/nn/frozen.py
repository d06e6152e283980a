"""Frozen low-precision models: a model that only runs forward (DPO's reference, a teacher) stored in
FP8, about one byte per parameter.

`freeze_fp8` converts in place: every convertible linear layer (see `linear_targets`) becomes an
`FP8Linear` whose weight is stored in ``weight_format`` (E4M3: one byte per element and a per-tensor
power-of-two scale), scaled just in time (``scaling="current"``: no amax history, so the frozen model
has no state that changes as it runs); embedding tables are stored in the same format. Norms and
biases (a tiny share of the parameters) keep their dtype, so the model runs with or without
autocast. Nothing requires gradients and the model is put in eval mode; it holds no gradients and
needs no optimizer state.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import E4M3, E5M2, FP16, Format, format_of
from ..tensor import ScalingTensor, quantize
from .convert import convert_linears, replace_parameters
from .linear import FP8Linear

__all__ = ["freeze_fp8"]


def _embedding_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]


def freeze_fp8(model: nn.Module, weight_format: Format | str = E4M3, multiple_of: int = 16) -> nn.Module:
    """Convert ``model`` in place to a frozen model with ``weight_format`` weights; returns the
    model to use (a new `FP8Linear` when ``model`` itself is a linear layer).

    Convert a copy (``freeze_fp8(copy.deepcopy(model))``) to keep the original. Linear layers whose
    sizes are not multiples of ``multiple_of`` keep their weights as they are.
    """
    fmt = format_of(weight_format)
    if fmt not in (E4M3, E5M2, FP16):
        raise ValueError(f"freeze_fp8 stores weights in a scaled format (E4M3, E5M2 or FP16), not {fmt.name}")
    if any(isinstance(m, FP8Linear) for m in model.modules()):
        raise ValueError(
            "freeze_fp8 converts a plain model, this one already has FP8Linear layers; "
            "freeze a copy made before fp8lm.initialize"
        )
    model.zero_grad(set_to_none=True)
    converted = convert_linears(model, multiple_of=multiple_of, weight_format=fmt, recipe="tensorwise-current")
    model = converted.get("", model)  # a model that is itself a linear layer is replaced whole
    tables = {
        id(w): nn.Parameter(quantize(w.detach(), fmt), requires_grad=False)
        for w in _embedding_weights(model)
        if not isinstance(w, ScalingTensor)
    }
    replace_parameters(model, tables)
    return model.requires_grad_(False).eval()
