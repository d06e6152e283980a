"""Gradient tools that understand FP8 (`ScalingTensor`) gradients as well as plain ones.

torch's own ``clip_grad_norm_`` also works on ScalingTensor gradients (they dequantize on
use), but it dequantizes each gradient twice and requantizes it when scaling in place. Here
norms come from the payloads, and clipping a ScalingTensor gradient divides its scale instead of
rewriting its payload: exact, and O(1) per tensor.

`QuantizeGrad` is the post-accumulate-grad hook that stores a parameter's gradient in its policy's
format (`fp8lm.initialize` installs it; `fp8lm.distributed.fully_shard` moves it to FSDP2's sharded
parameters, whose gradients it then stores shard by shard).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .formats import Format
from .ops.cast import amax, upcast
from .tensor import ScalingTensor, quantize

__all__ = ["clip_grad_norm_", "zero_grad", "grads_are_finite", "QuantizeGrad", "stores_grad_in_16_bits"]


class QuantizeGrad:
    """Post-accumulate-grad hook: store the parameter's gradient in ``fmt`` (a module-level class,
    so models with the hook still pickle). For an FP8 layer's weight (``layer``: an object with a
    ``high_precision`` flag), not while the layer has fallen back to high precision. A DTensor
    gradient (FSDP2's shard, which FSDP2 hands its sharded parameter's hooks after each
    reduce-scatter) keeps its layout: this rank's shard is stored in ``fmt`` with its own scale."""

    def __init__(self, fmt: Format, layer: object | None = None):
        self.fmt = fmt
        self.layer = layer

    def __call__(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        if isinstance(local, ScalingTensor) and local.payload.dtype == self.fmt.dtype:
            return
        if getattr(self.layer, "high_precision", False):
            return
        stored = quantize(local.detach(), self.fmt)
        value = ScalingTensor(stored.payload, stored.scale, param.dtype)
        if isinstance(grad, DTensor):
            param.grad = DTensor.from_local(
                value, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
            )
        else:
            param.grad = value


def stores_grad_in_16_bits(param: torch.Tensor) -> bool:
    """Whether a `QuantizeGrad` hook on ``param`` stores its gradient in a 16-bit format (BF16 or
    FP16: the output head's, whose rows of rare tokens one E4M3 scale per tensor would zero)."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    return any(isinstance(h, QuantizeGrad) and h.fmt.bytes == 2 for h in hooks.values())


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
    parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    group=None,
    stage_size: int = 1,
    ep_params=(),
    ep: int = 1,
) -> torch.Tensor:
    """Scale the gradients so their total ``norm_type``-norm is at most ``max_norm``, like
    ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping (float32).

    ``parameters``: a module, an iterable of tensors, or an optimizer. An optimizer with a
    ``clip_grad_norm_`` method of its own (every fp8lm optimizer: `fp8lm.optim.SkipsNonFiniteSteps`)
    does the clipping, so that `fp8lm.distributed.FP8ZeroOptimizer` clips by the global norm over its
    shards. ScalingTensor gradients are clipped by dividing their scale (exact, no requantization).
    When the total norm is not finite the gradients become NaN, so that the step is skipped.

    Over ranks: ``group`` is the process group whose ranks hold different parts of the model
    (pipeline stages, shards; not data-parallel replicas, whose gradients are equal), and
    ``stage_size`` how many of its ranks hold the same parameters as this one (the sharded
    data-parallel and tensor-parallel ranks of a stage; `ParallelMesh.clip_options` gives both).
    Each rank adds its local gradients' ``|g|^p``, a plain gradient's divided by ``stage_size``
    (every such rank holds it whole) and a DTensor's by ``stage_size`` over its number of shards,
    and the sums are added over ``group``: the norm of the whole gradients, the same on every rank.
    DTensor gradients without a ``group`` are reduced over their own mesh. ``ep_params`` are split
    ``ep`` ways among the ranks of a stage (expert parallelism: each rank of an expert-parallel group
    holds 1/``ep`` of the experts, whole): their gradients' sums are divided by ``ep`` times less.
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
    groups = [group] if group is not None else []
    if group is None and any(isinstance(g, DTensor) for g in grads):
        groups, stage_size = _own_mesh(grads)
    if groups:
        split = {id(p.grad) for p in _params(ep_params) if p.grad is not None}
        total = _spread_norm(grads, norm_type, groups, stage_size, split, ep)
    elif not grads:
        return torch.zeros((), dtype=torch.float32)
    else:
        device = grads[0].device
        norms = torch.stack([torch.linalg.vector_norm(_float_values(g), norm_type).to(device) for g in grads])
        total = norms.amax() if norm_type == float("inf") else torch.linalg.vector_norm(norms, norm_type)
    if not grads:
        return total
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
            "set error_if_nonfinite=False to clip anyway, or skip this step (fp8lm.grads_are_finite)"
        )
    # A non-finite norm (a non-finite gradient, or finite ones so large that float32 sums of squares
    # overflow) makes every gradient NaN rather than zero, as torch's 0 would: the step is then
    # skipped and counted by fp8lm's optimizers, as by a loop that checks the norm. No sync.
    if groups:  # in float64, rounded once to float32 (as fp8lm's distributed clips always have)
        coef = torch.clamp(max_norm / (total.double() + 1e-6), max=1.0).float()
    else:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.full_like(coef, float("nan")))
    divided: set[int] = set()  # views of one gradient buffer share their scale: divide it once
    with torch.no_grad():
        for g in grads:
            g = g.to_local() if isinstance(g, DTensor) else g  # scaled in place: the DTensor's values
            if isinstance(g, ScalingTensor):
                if id(g.scale) not in divided:
                    scale = g.scale.div(coef.to(g.scale.device))
                    # a scale divided past float32 would dequantize to zeros: NaN skips the step instead
                    g.scale.copy_(torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan"))))
                    divided.add(id(g.scale))
            else:
                g.mul_(coef.to(g.device, g.dtype))
    return total


def _spread_norm(
    grads: list[torch.Tensor],
    norm_type: float,
    groups: list,
    stage_size: int,
    split: frozenset[int] | set[int] = frozenset(),
    ep: int = 1,
) -> torch.Tensor:
    """The norm of gradients spread over the ranks of ``groups`` (reduced over each in turn; see
    `clip_grad_norm_`), on the gradients' device; those in ``split`` (by id) are split ``ep`` ways."""
    from .distributed import comm  # the one place that hands tensors to torch.distributed (a layer up)

    device = grads[0].device if grads else comm.group_device(groups[0])
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads:
        values = _float_values(g.to_local() if isinstance(g, DTensor) else g).to(device)
        if norm_type == float("inf"):
            total = torch.maximum(total, values.abs().amax().reshape(1) if values.numel() else total)
        else:
            pieces = _shards(g) * (ep if id(g) in split else 1)
            total = total + values.abs().pow(norm_type).sum() / (stage_size // pieces)
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    for group in groups:
        comm.all_reduce(total, op=op, group=group)
    if norm_type == float("inf"):
        return total[0]
    return total[0].sqrt() if norm_type == 2.0 else total[0].pow(1.0 / norm_type)


def _shards(grad: torch.Tensor) -> int:
    """Into how many different pieces a gradient is cut (1 for a plain tensor): any placement but
    Replicate shards (FSDP2 over a tensor-parallel dimension is a ``_StridedShard``)."""
    if not isinstance(grad, DTensor):
        return 1
    return math.prod(grad.device_mesh.size(i) for i, pl in enumerate(grad.placements) if not pl.is_replicate())


def _own_mesh(grads: list[torch.Tensor]) -> tuple[list, int]:
    """The groups (one per mesh dimension) and stage size of DTensor gradients that all live on
    one mesh (FSDP2 alone)."""
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    if len(meshes) > 1 or any(not isinstance(g, DTensor) for g in grads):
        raise ValueError(
            "clip_grad_norm_: the gradients are DTensors on several meshes, or mixed with plain tensors; pass "
            "group= and stage_size= (fp8lm.distributed.ParallelMesh.clip_options() gives them)"
        )
    mesh = meshes.pop()
    return [mesh.get_group(i) for i in range(mesh.ndim)], mesh.size()


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
