"""FP32 weights all-gathered by FSDP2 in the format their GEMM reads (O1 under `fully_shard`):
E4M3 bytes for an FP8 GEMM's weight, BF16 (or FP16) for a high-precision GEMM's under autocast.

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
reduce-scattered by FSDP2), and the optimizer updates the FP32 values in place.

`AutocastGatheredWeight` is the same wrapper for the FP32 weight of a layer whose GEMM runs in high
precision under ``torch.autocast`` (O1's output head): its all-gather sends the shard cast to the
autocast dtype (BF16: 2 bytes per element), exactly the cast autocast makes of the whole FP32
weight at the GEMM, and returns it as a ScalingTensor of scale 1 presenting FP32, whose gradient
is FP32 like the other parameters'. Outside that autocast the layer would multiply the rounded
weight: hence an opt-in (``fully_shard(..., autocast_dtype=torch.bfloat16)``).

`BlockGatheredWeight` is the wrapper for the FP32 weight of a layer under a fine-grained recipe
(`fp8lm.Recipe.fine_grained`) whose shards hold whole blocks of its forward weight operand
(`fp8lm.block_tensor.shards_whole_blocks`): its all-gather sends the shard as that operand, E4M3
(nvfp4: packed E2M1) bytes with the scales of its rows or blocks, as an O2 weight's does
(`fp8lm.block_tensor.gather_inputs`), and returns the gathered `BlockScaledTensor`, the operand a
single process quantizes from the whole FP32 weight, bit for bit.

While the layer of an `FP8GatheredWeight` or `BlockGatheredWeight` is switched to high precision
(``high_precision``: a fallback, precision annealing; `fp8lm.tensor.fsdp_gather_fp8`), its
all-gather sends the FP32 values as they are (`exact_gather_inputs`), what one process multiplies.

`wrap_fp32_weights` puts the wrappers in (`fp8lm.distributed.fully_shard` calls it before torch's
``fully_shard``); a model that is not sharded keeps its plain weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from .. import block_tensor
from ..formats import E4M3, format_of
from ..ops.cast import amax as _amax
from ..recipe import Recipe
from ..scaling import compute_scale
from ..tensor import fsdp_gather_fp8, fsdp_gathered, fsdp_holder, fsdp_wire
from . import comm

__all__ = [
    "GatheredWeight",
    "FP8GatheredWeight",
    "AutocastGatheredWeight",
    "BlockGatheredWeight",
    "AUTOCAST_DTYPES",
    "wrap_fp32_weights",
    "gathered_fp32_weights",
    "plain_state_dict",
]

# The autocast dtypes an `AutocastGatheredWeight` gathers in: 2-byte floats (autocast's casts).
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)

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


class GatheredWeight(torch.Tensor):
    """An FP32 weight shard that FSDP2 all-gathers in another format (`FP8GatheredWeight`,
    `AutocastGatheredWeight`); for every other use a plain tensor of its values (module docstring)."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, *args):
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
        if isinstance(inner, GatheredWeight) or not inner.dtype.is_floating_point:
            raise TypeError(
                f"{type(self).__name__} wraps a plain floating-point tensor, got {type(inner).__name__} of {inner.dtype}"
            )
        self._inner = inner

    @property
    def inner(self) -> torch.Tensor:
        """The weight's values: the plain tensor this wraps (shared, not a copy)."""
        return self._inner

    def _context(self) -> tuple:
        """What besides the values makes this wrapper (the arguments after ``inner``)."""
        return ()

    def rewrap(self, inner: torch.Tensor) -> GatheredWeight:
        """``inner`` in a wrapper like this one."""
        return type(self)(inner, *self._context())

    def __repr__(self) -> str:  # type: ignore[override]  # must not dispatch
        return f"{type(self).__name__}({self._inner!r})"

    # -- subclass protocol (torch.compile, pickling) --------------------------------------------
    def __tensor_flatten__(self):
        return ["_inner"], (type(self), self._context())

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        cls, context = ctx
        return cls(inner_tensors["_inner"], *context)

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self._inner, isinstance(self, nn.Parameter), self.requires_grad, *self._context()))

    def __deepcopy__(self, memo):
        out = _rebuild(self._inner.clone(), isinstance(self, nn.Parameter), self.requires_grad, *self._context())
        memo[id(self)] = out
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        written: dict[int, GatheredWeight] = {}

        def unwrap(t: GatheredWeight) -> torch.Tensor:
            written[id(t._inner)] = t
            return t._inner

        args, kwargs = tree_map_only(GatheredWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func._schema.is_mutable:  # the tensors it wrote in place: their wrappers
            return tree_map_only(torch.Tensor, lambda t: written.get(id(t), t), out)
        if func in _KEEP_OPS:
            like = next(iter(written.values()))
            return tree_map_only(torch.Tensor, like.rewrap, out)
        return out


class FP8GatheredWeight(GatheredWeight):
    """An FP32 weight shard that FSDP2 all-gathers as E4M3 with one scale agreed over the mesh; for
    every other use a plain tensor of its values (module docstring)."""

    # -- FSDP2 all-gather extension (torch.distributed.fsdp.fully_shard) -------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's rows as E4M3 bytes, padded to FSDP's padded shard, cast with the scale of
        the whole weight: the precomputed one (`precompute_fp8_scales`, kept on the sharded
        parameter) or else that of a MAX all-reduce of this weight's amax over ``mesh``."""
        holder = fsdp_holder(module, self)
        if not fsdp_gather_fp8(holder, module):  # the layer multiplies in high precision: exact values
            return exact_gather_inputs(self._inner, outer_size, mesh.size())
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


class AutocastGatheredWeight(GatheredWeight):
    """An FP32 weight shard of a high-precision GEMM that runs under ``torch.autocast(dtype)``:
    FSDP2 all-gathers it cast to ``dtype`` (BF16 or FP16), the cast autocast makes at the GEMM;
    for every other use a plain tensor of its values (module docstring)."""

    gather_dtype: torch.dtype

    def __init__(self, inner: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        super().__init__(inner)
        if dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"AutocastGatheredWeight gathers in torch.bfloat16 or torch.float16, got {dtype}")
        self.gather_dtype = dtype

    def _context(self) -> tuple:
        return (self.gather_dtype,)

    # -- FSDP2 all-gather extension (torch.distributed.fsdp.fully_shard) -------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's rows cast to the autocast dtype (round to nearest even, as autocast casts),
        padded to FSDP's padded shard."""
        return (fsdp_wire_cast(self._inner, self.gather_dtype, outer_size, mesh.size()),), (
            self.gather_dtype,
            torch.ones((), dtype=torch.float32, device=self._inner.device),
        )

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered weight: the ranks' rows as one ScalingTensor of the autocast dtype with
        scale 1, presenting FP32 (the values autocast casts back to that dtype exactly)."""
        return fsdp_gathered(all_gather_outputs, metadata, param_dtype, out)


class BlockGatheredWeight(GatheredWeight):
    """An FP32 weight shard of a layer under a fine-grained ``recipe``, holding whole blocks of its
    forward weight operand: FSDP2 all-gathers it as that operand (the payload and the scales of
    its rows or blocks); for every other use a plain tensor of its values (module docstring)."""

    recipe: Recipe

    def __init__(self, inner: torch.Tensor, recipe: Recipe):
        super().__init__(inner)
        if not isinstance(recipe, Recipe) or not recipe.fine_grained:
            raise ValueError(f"BlockGatheredWeight gathers in a fine-grained recipe's blocks, got {recipe!r}")
        self.recipe = recipe

    def _context(self) -> tuple:
        return (self.recipe,)

    # -- FSDP2 all-gather extension (torch.distributed.fsdp.fully_shard) -------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's rows as the recipe's forward weight operand: payload bytes and the scales
        of its rows or blocks (nvfp4: with the whole weight's amax, the one `precompute_fp8_scales`
        agreed, or else agreed over ``mesh`` first)."""
        holder = fsdp_holder(module, self)
        if not fsdp_gather_fp8(holder, module):  # the layer multiplies in high precision: exact values
            return exact_gather_inputs(self._inner, outer_size, mesh.size())
        amax = getattr(holder, "fsdp_gather_amax", None)
        return block_tensor.gather_inputs(self._inner.float(), self.recipe, mesh.get_group(), amax)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered weight: the ranks' payloads and scales as one `BlockScaledTensor`, the
        layer's forward weight operand as is (later gathers refill its buffers in place)."""
        if metadata[0] != block_tensor.GATHER_TAG:  # `exact_gather_inputs`
            return fsdp_gathered(all_gather_outputs, metadata, param_dtype, out)
        if out is None:
            return block_tensor.gathered(all_gather_outputs, metadata, param_dtype)
        block_tensor.refresh(getattr(out, "_local_tensor", out), all_gather_outputs, metadata)
        return None


def exact_gather_inputs(shard: torch.Tensor, outer_size, ranks: int) -> tuple[tuple, tuple]:
    """FSDP2's all-gather inputs and metadata for a wrapped weight whose layer multiplies in high
    precision now (a fallback, precision annealing: `fp8lm.tensor.fsdp_gather_fp8` False): the
    FP32 values as they are, gathered as a ScalingTensor of scale 1 (what the unsharded layer
    multiplies; 4 bytes per element, for the steps the layer spends so)."""
    one = torch.ones((), dtype=torch.float32, device=shard.device)
    return (fsdp_wire_cast(shard, torch.float32, outer_size, ranks),), (torch.float32, one)


def fsdp_wire_cast(shard: torch.Tensor, dtype: torch.dtype, outer_size, ranks: int) -> torch.Tensor:
    """A rank's all-gather input: ``shard`` (its rows of a parameter of ``outer_size``) cast to
    ``dtype`` as ``Tensor.to`` casts, zero-padded to FSDP's padded shard of ``ceil(dim 0 / ranks)`` rows."""
    format_of(dtype)  # a known format: the gathered ScalingTensor's payload
    rows = -(-outer_size[0] // ranks)
    padded = torch.zeros((rows, *outer_size[1:]), dtype=dtype, device=shard.device)
    if shard.numel() > 0:
        padded[: shard.shape[0]] = shard
    return padded


def _rebuild(inner: torch.Tensor, is_param: bool = False, requires_grad: bool = False, *context) -> torch.Tensor:
    out: GatheredWeight
    if not context:
        out = FP8GatheredWeight(inner)
    elif isinstance(context[0], Recipe):
        out = BlockGatheredWeight(inner, *context)
    else:
        out = AutocastGatheredWeight(inner, *context)
    return nn.Parameter(out, requires_grad=requires_grad) if is_param else out.requires_grad_(requires_grad)


torch.serialization.add_safe_globals([FP8GatheredWeight, AutocastGatheredWeight, BlockGatheredWeight, _rebuild])


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


def _wrapped(param: nn.Parameter, gather: torch.dtype | Recipe | None) -> nn.Parameter:
    """``param`` (plain, or a tensor-parallel DTensor) with its values in an FP8GatheredWeight
    (``gather`` None), an AutocastGatheredWeight of the dtype ``gather`` or a BlockGatheredWeight
    of the recipe ``gather``."""
    values = _local(param)
    local: torch.Tensor
    if gather is None:
        local = FP8GatheredWeight(values)
    elif isinstance(gather, Recipe):
        local = BlockGatheredWeight(values, gather)
    else:
        local = AutocastGatheredWeight(values, gather)
    if isinstance(param, DTensor):
        local = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return nn.Parameter(local, requires_grad=param.requires_grad)


def wrap_fp32_weights(
    module: nn.Module,
    weight_ids: set[int],
    ignored_params=None,
    cast_to: dict[int, torch.dtype] | None = None,
    blocks: dict[int, Recipe] | None = None,
) -> int:
    """Put the plain floating-point parameters of ``module`` whose ids are in ``weight_ids`` (the
    weights of its FP8 GEMMs with one scale per tensor) in `FP8GatheredWeight`s, those whose ids
    ``cast_to`` maps to an autocast dtype (the weights of high-precision GEMMs that run under that
    autocast) in `AutocastGatheredWeight`s, and those whose ids ``blocks`` maps to a fine-grained
    recipe (weights whose shards will hold whole blocks of its operand) in `BlockGatheredWeight`s,
    for torch's ``fully_shard(module, ignored_params=...)`` to shard next; a weight held twice
    (tied) stays plain. Registers `plain_state_dict` on the owners. Returns how many it wrapped."""
    cast_to, blocks = cast_to or {}, blocks or {}
    managed = _managed(module, {id(p) for p in ignored_params or ()})
    holders: dict[int, int] = {}
    for _, _, p in managed:
        holders[id(p)] = holders.get(id(p), 0) + 1
    count = 0
    for owner, name, p in managed:
        gather = blocks.get(id(p), cast_to.get(id(p)))
        wanted = id(p) in weight_ids or gather is not None
        if wanted and holders[id(p)] == 1 and type(_local(p)) is torch.Tensor and p.is_floating_point():
            owner.register_parameter(name, _wrapped(p, None if id(p) in weight_ids else gather))
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
    """State-dict post hook: ``module``'s GatheredWeight parameters as DTensors (or tensors) of
    their plain FP32 values, sharing their storage, so that checkpoints hold plain FP32 tensors."""
    for name in module._parameters:
        key = prefix + name
        value = state_dict.get(key)
        local = value._local_tensor if isinstance(value, DTensor) else value
        if not isinstance(local, GatheredWeight) or isinstance(value, nn.Parameter):  # keep_vars: the parameter
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
