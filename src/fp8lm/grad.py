"""Gradient tools that understand FP8 (`ScalingTensor`) gradients as well as plain ones.

torch's own ``clip_grad_norm_`` also works on ScalingTensor gradients (they dequantize on
use), but it dequantizes each gradient twice and requantizes it when scaling in place. Here
norms come from the payloads, and clipping a ScalingTensor gradient divides its scale instead of
rewriting its payload: exact, and O(1) per tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops.cast import amax, upcast
from .tensor import ScalingTensor

__all__ = ["clip_grad_norm_", "zero_grad", "grads_are_finite"]


def _params(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        return list(parameters.parameters())
    if isinstance(parameters, torch.optim.Optimizer):
        return [p for group in parameters.param_groups for p in group["params"]]
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _grads(parameters) -> list[torch.Tensor]:
    return [p.grad for p in _params(parameters) if p.grad is not None]


def _float_values(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's values as float32 (exact for every payload format fp8lm stores)."""
    if isinstance(grad, ScalingTensor):
        if grad.payload.element_size() == 1:
            return upcast(grad.payload, grad.scale_inv, torch.float32)
        return grad.dequantize(torch.float32)
    return grad.detach().float()


def grads_are_finite(parameters) -> bool:
    """True when every gradient of ``parameters`` (a module, an optimizer, or an iterable of
    tensors) is free of inf and NaN; parameters without a gradient are skipped."""
    grads = _grads(parameters)
    if not grads:
        return True
    amaxes = torch.stack([amax(_float_values(g)).to(grads[0].device) for g in grads])
    return bool(torch.isfinite(amaxes).all())


def clip_grad_norm_(
    parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale the gradients so their total ``norm_type``-norm is at most ``max_norm``, like
    ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping (float32).

    ``parameters``: a module, an iterable of tensors, or an optimizer. An optimizer with a
    ``clip_grad_norm_`` method of its own (every fp8lm optimizer: `fp8lm.optim.SkipsNonFiniteSteps`)
    does the clipping, so that `fp8lm.distributed.FP8ZeroOptimizer` clips by the global norm over its
    shards. ScalingTensor gradients are clipped by dividing their scale (exact, no requantization).
    When the total norm is not finite the gradients become NaN, so that the step is skipped.
    """
    own_clip = getattr(parameters, "clip_grad_norm_", None) if isinstance(parameters, torch.optim.Optimizer) else None
    if own_clip is not None:
        return own_clip(max_norm, norm_type, error_if_nonfinite)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}")
    grads = _grads(parameters)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    device = grads[0].device
    norms = torch.stack([torch.linalg.vector_norm(_float_values(g), norm_type).to(device) for g in grads])
    total = norms.amax() if norm_type == float("inf") else torch.linalg.vector_norm(norms, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
            "set error_if_nonfinite=False to clip anyway, or skip this step (fp8lm.grads_are_finite)"
        )
    # A non-finite norm (a non-finite gradient, or finite ones so large that float32 sums of squares
    # overflow) makes every gradient NaN rather than zero, as torch's 0 would: the step is then
    # skipped and counted by fp8lm's optimizers, as by a loop that checks the norm. No sync.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.full_like(coef, float("nan")))
    divided: set[int] = set()  # views of one gradient buffer share their scale: divide it once
    with torch.no_grad():
        for g in grads:
            if isinstance(g, ScalingTensor):
                if id(g.scale) not in divided:
                    scale = g.scale.div(coef.to(g.scale.device))
                    # a scale divided past float32 would dequantize to zeros: NaN skips the step instead
                    g.scale.copy_(torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan"))))
                    divided.add(id(g.scale))
            else:
                g.mul_(coef.to(g.device, g.dtype))
    return total


def zero_grad(parameters, set_to_none: bool = True) -> None:
    """Reset the gradients of ``parameters`` (a module, an optimizer, or an iterable of tensors):
    drop them (default) or zero them in place, keeping a ScalingTensor gradient's storage."""
    for p in _params(parameters):
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        elif isinstance(p.grad, ScalingTensor):
            p.grad.payload.zero_()
        else:
            p.grad.detach_().zero_()
