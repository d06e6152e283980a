"""FP32 weights of FP8 GEMMs all-gathered by FSDP2 as E4M3 bytes (O1 under `fully_shard`).

At O1 an `FP8Linear`'s weight is a plain FP32 parameter: FSDP2 would all-gather it in FP32 (4 bytes
per element) although the layer only ever multiplies its E4M3 cast. `FP8GatheredWeight` is the
shard as FSDP2 holds it: a pass-through wrapper of the FP32 values, so that torch's optimizers,
``clip_grad_norm_``, state dicts and Distributed Checkpoint see an FP32 tensor, which adds FSDP2's
all-gather extension:

- ``fsdp_pre_all_gather`` sends the shard cast to E4M3 (uint8 on the wire, padded to FSDP's padded
  shard) with the scale of the whole weight's amax, agreed over the mesh
  (`fp8lm.distributed.precompute_fp8_scales`, or a MAX all-reduce of this weight's amax);
- ``fsdp_post_all_gather`` returns the gathered E4M3 `ScalingTensor`, which `FP8Linear` uses as its
  weight operand as is. That operand is exactly the one a single process casts from the full FP32
  weight (the cast is elementwise, the scale a function of the amax, and the amax of the whole is
  the largest of the shards'), so outputs and gradients are those of the unsharded layer.

The weight's gradient comes back through the gathered ScalingTensor as at O2 (an E4M3 gradient,
reduce-scattered by FSDP2), and the optimizer updates the FP32 values in place. `wrap_fp32_weights`
puts the wrappers in (`fp8lm.distributed.fully_shard` calls it before torch's ``fully_shard``); a
model that is not sharded keeps its plain weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from ..formats import E4M3
from ..ops.cast import amax as _amax
from ..scaling import compute_scale
from ..tensor import fsdp_gathered, fsdp_wire
from . import comm

__all__ = ["FP8GatheredWeight", "wrap_fp32_weights", "gathered_fp32_weights", "plain_state_dict"]

aten = torch.ops.aten

# Ops whose results stay the weight (the shard FSDP2 pads, views and replaces; ``.to()``; a
# detached Parameter): wrapped again. Every other op computes on the FP32 values and returns plain
# tensors (the optimizer's state, norms); in-place ops return the wrapper they wrote.
_KEEP_OPS = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}


class FP8GatheredWeight(torch.Tensor):
    """An FP32 weight shard that FSDP2 all-gathers as E4M3 with one scale agreed over the mesh; for
    every other use a plain tensor of its values (module docstring)."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=inner.device,
            requires_grad=False,
        )

    def __init__(self, inner: torch.Tensor):
        if isinstance(inner, FP8GatheredWeight) or not inner.dtype.is_floating_point:
            raise TypeError(
                f"FP8GatheredWeight wraps a plain floating-point tensor, got {type(inner).__name__} of {inner.dtype}"
            )
        self._inner = inner

    @property
    def inner(self) -> torch.Tensor:
        """The weight's values: the plain tensor this wraps (shared, not a copy)."""
        return self._inner

    def __repr__(self) -> str:  # type: ignore[override]  # must not dispatch
        return f"FP8GatheredWeight({self._inner!r})"

    # -- subclass protocol (torch.compile, pickling) --------------------------------------------
    def __tensor_flatten__(self):
        return ["_inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return FP8GatheredWeight(inner_tensors["_inner"])

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self._inner, isinstance(self, nn.Parameter), self.requires_grad))

    def __deepcopy__(self, memo):
        out = _rebuild(self._inner.clone(), isinstance(self, nn.Parameter), self.requires_grad)
        memo[id(self)] = out
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        written: dict[int, FP8GatheredWeight] = {}

        def unwrap(t: FP8GatheredWeight) -> torch.Tensor:
            written[id(t._inner)] = t
            return t._inner

        args, kwargs = tree_map_only(FP8GatheredWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func._schema.is_mutable:  # the tensors it wrote in place: their wrappers
            return tree_map_only(torch.Tensor, lambda t: written.get(id(t), t), out)
        if func in _KEEP_OPS:
            return tree_map_only(torch.Tensor, FP8GatheredWeight, out)
        return out

    # -- FSDP2 all-gather extension (torch.distributed.fsdp.fully_shard) -------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's rows as E4M3 bytes, padded to FSDP's padded shard, cast with the scale of
        the whole weight: the precomputed one (`precompute_fp8_scales`, kept on the sharded
        parameter) or else that of a MAX all-reduce of this weight's amax over ``mesh``."""
        holder = next((p for p in module.parameters() if getattr(p, "_local_tensor", None) is self), self)
        scale = getattr(holder, "fsdp_gather_scale", None)
        if scale is None:
            value_amax = self.shard_amax().reshape(1)
            comm.all_reduce(value_amax, torch.distributed.ReduceOp.MAX, mesh.get_group())
            scale = compute_scale(value_amax.reshape(()), E4M3)
        return (fsdp_wire(self._inner, scale, E4M3, outer_size, mesh.size()),), (E4M3.dtype, scale)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered weight: the ranks' E4M3 payloads as one ScalingTensor with the agreed
        scale, `FP8Linear`'s weight operand as is."""
        return fsdp_gathered(all_gather_outputs, metadata, param_dtype, out)

    def shard_amax(self) -> torch.Tensor:
        """The largest absolute value of this shard (0 when empty), float32."""
        return _amax(self._inner).float()


def _rebuild(inner: torch.Tensor, is_param: bool = False, requires_grad: bool = False) -> torch.Tensor:
    out = FP8GatheredWeight(inner)
    return nn.Parameter(out, requires_grad=requires_grad) if is_param else out.requires_grad_(requires_grad)


torch.serialization.add_safe_globals([FP8GatheredWeight, _rebuild])


def _local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param.detach()


def _managed(module: nn.Module, ignored: set[int]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(owner, name, parameter) of what torch's ``fully_shard(module)`` takes over: the parameters
    of ``module`` and its submodules except those under an already sharded submodule or ignored."""
    found, stack = [], [module]
    while stack:
        owner = stack.pop()
        found += [(owner, n, p) for n, p in owner._parameters.items() if p is not None and id(p) not in ignored]
        stack += [m for m in owner.children() if not isinstance(m, FSDPModule)]
    return found


def _wrapped(param: nn.Parameter) -> nn.Parameter:
    """``param`` (plain, or a tensor-parallel DTensor) with its values in an FP8GatheredWeight."""
    local = FP8GatheredWeight(_local(param))
    if isinstance(param, DTensor):
        local = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return nn.Parameter(local, requires_grad=param.requires_grad)


def wrap_fp32_weights(module: nn.Module, weight_ids: set[int], ignored_params=None) -> int:
    """Put the plain floating-point parameters of ``module`` whose ids are in ``weight_ids`` (the
    weights of its FP8 GEMMs with one scale per tensor) in `FP8GatheredWeight`s, for torch's
    ``fully_shard(module, ignored_params=...)`` to shard next; a weight held twice (tied) stays
    plain. Registers `plain_state_dict` on the owners. Returns how many it wrapped."""
    managed = _managed(module, {id(p) for p in ignored_params or ()})
    holders: dict[int, int] = {}
    for _, _, p in managed:
        holders[id(p)] = holders.get(id(p), 0) + 1
    count = 0
    for owner, name, p in managed:
        if id(p) in weight_ids and holders[id(p)] == 1 and type(_local(p)) is torch.Tensor and p.is_floating_point():
            owner.register_parameter(name, _wrapped(p))
            if not getattr(owner, "_fp8lm_plain_gathered_state", False):
                owner.register_state_dict_post_hook(plain_state_dict)
                owner._fp8lm_plain_gathered_state = True  # type: ignore[assignment]  # a flag
            count += 1
    return count


def gathered_fp32_weights(module: nn.Module) -> list[tuple[DTensor, FP8GatheredWeight]]:
    """(sharded parameter, local shard) of every FP8GatheredWeight parameter FSDP2 shards in ``module``."""
    return [
        (p, p._local_tensor)
        for p in module.parameters()
        if isinstance(p, DTensor) and isinstance(p._local_tensor, FP8GatheredWeight)
    ]


def plain_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post hook: ``module``'s FP8GatheredWeight parameters as DTensors (or tensors) of
    their plain FP32 values, sharing their storage, so that checkpoints hold plain FP32 tensors."""
    for name in module._parameters:
        key = prefix + name
        value = state_dict.get(key)
        local = value._local_tensor if isinstance(value, DTensor) else value
        if not isinstance(local, FP8GatheredWeight) or isinstance(value, nn.Parameter):  # keep_vars: the parameter
            continue
        if isinstance(value, DTensor):
            state_dict[key] = DTensor.from_local(
                local.inner,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        else:
            state_dict[key] = local.inner
