"""fp8lm on FSDP2 (`torch.distributed.fsdp.fully_shard`): FP8 weight all-gather and FP8 gradient
reduce-scatter, through FSDP2's own extension points.

- **All-gather**: `ScalingTensor` shards implement FSDP2's ``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather`` (in `fp8lm.tensor`): the weight of an FP8 GEMM travels as E4M3 bytes
  with one scale agreed over the mesh, and the gathered ScalingTensor is FP8Linear's operand as is
  (and each expert's of an `FP8GroupedLinear`, whose experts are parameters of their own).
  `precompute_fp8_scales` agrees the scales of all weights with one MAX all-reduce per step.
  Under a fine-grained recipe each rank sends its rows as the recipe's E4M3 operand with the
  scales of its rows or blocks (`fp8lm.block_tensor`), where its shard holds whole blocks; an
  expert's weight too.
- **Reduce-scatter**: `FP8ReduceScatter` (installed with ``FSDPModule.set_custom_reduce_scatter``)
  sends every chunk of FSDP's flat gradient buffer as E4M3 with its own scale, sums in FP32 on the
  owning rank and divides by the world size after the sum (`fp8_reduce_scatter`), so nothing
  saturates.
- **O1's FP32 weights** of FP8 GEMMs are sharded as `FP8GatheredWeight`s (`fp32_gather`): FP32 for
  the optimizer and checkpoints, all-gathered as E4M3 bytes with the agreed scale like the above,
  the gathered operand exactly the one a single process casts. With ``autocast_dtype`` (the forward
  runs under BF16 autocast), the FP32 weights of FP8Linear layers kept in high precision (O1's
  output head) are `AutocastGatheredWeight`s, all-gathered in BF16: the cast autocast makes anyway.
- **Layers switched to high precision** (a fallback, precision annealing): FSDP2 keeps a
  parameter's all-gather buffers from its first all-gather, so the format is fixed there;
  `refresh_gathers` (before each forward of a module `fully_shard` sharded) lets go of a switched
  layer's, and its weight travels as stored, its gradient in BF16, until it is switched back.
- **Gradient formats**: the `QuantizeGrad` hooks of `fp8lm.initialize` (each parameter's gradient
  in its policy's format) move to FSDP2's sharded parameters, whose post-accumulate-grad hooks
  FSDP2 calls after each reduce-scatter: every rank's gradient shard is stored in the policy's
  format with its own scale, as one process stores the whole gradient.
- `fully_shard` is torch's, plus the above and counted communication (`comm_stats`).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
from torch.distributed.tensor import DTensor

from ..formats import E4M3, Format, format_of
from ..grad import QuantizeGrad
from ..nn.grouped import FP8GroupedLinear
from ..nn.linear import FP8Linear
from ..ops.cast import amax as _amax
from ..recipe import Recipe
from ..scaling import compute_scale
from ..tensor import (
    ScalingTensor,
    block_gather_recipe,
    forget_fsdp_gather,
    fsdp_gather_format,
    fsdp_gather_fp8,
    fsdp_gather_recipe,
    fsdp_shard_amax,
    gemm_layer_of,
    multiplies_in_fp8,
    switched_to_high_precision,
)
from . import comm
from .collectives import fp8_reduce_scatter
from .fp32_gather import AUTOCAST_DTYPES, BlockGatheredWeight, gathered_fp32_weights, wrap_fp32_weights
from .reduction import BF16Reduction, FlatLayout, sent_in_bf16

__all__ = [
    "fully_shard",
    "precompute_fp8_scales",
    "refresh_gathers",
    "FP8ReduceScatter",
    "CountedAllGather",
    "CountedReduceScatter",
]


# The reduce-scatter `fully_shard` installed on each module it sharded, and which of the module's
# layers were switched to high precision when its spans were made (`_refresh_group` remakes them).
_REDUCE_SCATTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _PlainAllocation:
    """FSDP2's ``Comm.allocate``: a fresh buffer per call."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountedAllGather(_PlainAllocation):
    """FSDP2's all-gather through `fp8lm.distributed.comm`, so `comm_stats` counts its bytes."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        return comm.all_gather(output_tensor, input_tensor, group, async_op=async_op)


class CountedReduceScatter(_PlainAllocation):
    """FSDP2's own gradient reduce-scatter (in its ``MixedPrecisionPolicy.reduce_dtype``) through
    `fp8lm.distributed.comm`, so `comm_stats` counts its bytes."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        return comm.reduce_scatter(output_tensor, input_tensor, op, group, async_op=async_op)


class FP8ReduceScatter(_PlainAllocation):
    """FSDP2's gradient reduce-scatter in FP8: each of the ``world_size`` chunks of the flat
    gradient buffer is quantized to ``fmt`` with its own scale, summed in FP32 by the rank that owns
    it, and (for FSDP's mean) divided by the world size after the sum. Error bound: that of
    `fp8_all_reduce_error_bound` for the reduce-scatter half (docs/distributed.md).

    ``wide``: (start, end) spans of each rank's chunk sent in BF16 instead (summed in FP32 all the
    same): the gradients the policy stores in 16 bits (the output head's), which ``fully_shard``
    finds. They hold while the buffer is ``chunk_numel`` long per rank (every parameter of the group
    has a gradient); another length sends all of it in ``fmt``."""

    def __init__(self, fmt: Format | str = E4M3, wide: Sequence[tuple[int, int]] = (), chunk_numel: int = 0):
        self.fmt = format_of(fmt)
        if not self.fmt.is_fp8:
            raise ValueError(f"FP8ReduceScatter sends FP8 payloads; fmt must be E4M3 or E5M2, got {self.fmt}")
        self.wide, self.chunk_numel = tuple(wide), chunk_numel

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(
                f"FP8ReduceScatter sums or averages, got reduce op {op}; "
                "leave fully_shard's gradient_divide_factor unset"
            )
        average = op == dist.ReduceOp.AVG
        world = dist.get_world_size(group)
        if self.wide and input_tensor.numel() == world * self.chunk_numel:
            shard = _mixed_reduce_scatter(
                input_tensor.view(world, -1), self._wide_mask(input_tensor), group, self.fmt, average
            )
        else:
            shard = fp8_reduce_scatter(input_tensor, group, self.fmt, average=average)
        output_tensor.copy_(shard)
        return None

    def _wide_mask(self, input_tensor: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(self.chunk_numel, dtype=torch.bool, device=input_tensor.device)
        for start, end in self.wide:
            mask[start:end] = True
        return mask


def _mixed_reduce_scatter(rows: torch.Tensor, wide: torch.Tensor, group, fmt: Format, average: bool) -> torch.Tensor:
    """This rank's chunk of the sum (or mean) of ``rows`` (one row per rank) over the ranks, in
    FP32: the columns of ``wide`` sent as BF16 (`BF16Reduction`), the others as
    `fp8_reduce_scatter` sends them."""
    shard = torch.empty(rows.shape[1], dtype=torch.float32, device=rows.device)
    narrow = ~wide
    if bool(narrow.any()):
        shard[narrow] = fp8_reduce_scatter(rows[:, narrow].reshape(-1), group, fmt, average=average)
    sent = rows[:, wide].reshape(-1)  # each rank's columns, in rank order: one chunk per rank
    layout = FlatLayout.contiguous([sent.numel()], rows.shape[0])
    shard[wide] = BF16Reduction([sent], layout, group, average=average).start().reduce()
    return shard


def _sharded_scaling_tensors(module: nn.Module) -> list[tuple[nn.Module, DTensor, ScalingTensor]]:
    """(owning module, parameter, local shard) of every FSDP-sharded ScalingTensor parameter."""
    found = []
    for owner in module.modules():
        for p in owner.parameters(recurse=False):
            # The DTensor's own local tensor (to_local() returns a new view): the object FSDP2 calls.
            if isinstance(p, DTensor) and isinstance(p._local_tensor, ScalingTensor):
                found.append((owner, p, p._local_tensor))
    return found


def _fp8_gemm_weights(module: nn.Module) -> set[int]:
    """The ids of the weights of every FP8 GEMM with one scale per tensor in ``module``: FP8Linear's
    (under a tensorwise recipe), and each expert's of an FP8GroupedLinear (the same)."""
    ids = set()
    for m in module.modules():
        if isinstance(m, FP8Linear) and m.fp8_enabled:
            recipe = getattr(m, "recipe", None)
            if isinstance(recipe, Recipe) and not recipe.fine_grained:
                ids.add(id(m.weight))
        elif isinstance(m, FP8GroupedLinear) and m.fp8_enabled and not m.recipe.fine_grained:
            ids.update(id(w) for _, w in m.held_weights())
    return ids


def _block_gathered_weights(module: nn.Module, mesh) -> dict[int, Recipe]:
    """id -> recipe for every plain FP32 weight (O1) of an FP8 GEMM under a fine-grained recipe
    in ``module`` (FP8Linear's, each expert's of an FP8GroupedLinear) whose shards over ``mesh``
    (FSDP2's; None: the whole world) will hold whole blocks of its forward operand. A 2-D mesh, a
    tensor-parallel weight and one rank (where FSDP2 gathers nothing) are left out: the weight is
    gathered in FP32 there, as an O2 weight is in its stored format
    (`fp8lm.tensor.fsdp_gather_recipe`)."""
    if mesh is not None and mesh.ndim != 1:
        return {}
    ranks = mesh.size() if mesh is not None else dist.get_world_size()
    found = {}
    for m in module.modules():
        if not isinstance(m, (FP8Linear, FP8GroupedLinear)) or not m.fp8_enabled:
            continue
        weights = [w for _, w in m.held_weights()] if isinstance(m, FP8GroupedLinear) else [m.weight]
        for w in weights:
            recipe = block_gather_recipe(m, w.shape, ranks)
            if recipe is not None and type(w) is nn.Parameter and w.dtype == torch.float32:
                found[id(w)] = recipe
    return found


def _autocast_gemm_weights(module: nn.Module, dtype: torch.dtype) -> dict[int, torch.dtype]:
    """id -> ``dtype`` for the weight of every FP8Linear in ``module`` whose GEMMs run in high
    precision (``fp8_enabled`` False: ``F.linear``, which ``torch.autocast(dtype)`` computes on the
    weight cast to ``dtype``)."""
    return {id(m.weight): dtype for m in module.modules() if isinstance(m, FP8Linear) and not m.fp8_enabled}


def _choose_gather_formats(module: nn.Module) -> None:
    """E4M3 for the weight of every FP8 GEMM with one scale per tensor (a format is fixed at the
    shard's first all-gather). A fine-grained recipe's weight is gathered in its blocks where its
    shards hold whole blocks, else in its own format (`fp8lm.tensor.fsdp_gather_recipe`)."""
    fp8_weights = _fp8_gemm_weights(module)
    for owner, param, shard in _sharded_scaling_tensors(module):
        fp8 = fsdp_gather_fp8(param, owner)  # not while its layer multiplies in high precision
        fsdp_gather_format(param, shard, E4M3 if fp8 and id(param) in fp8_weights else None)


def refresh_gathers(module: nn.Module) -> int:
    """Let FSDP2 all-gather anew, in the format its layer multiplies now, the weight of every FP8
    layer in ``module`` switched between FP8 and high precision (``high_precision``: a fallback,
    precision annealing; ``fp8_enabled``) since its format was fixed. Returns how many it let go.

    FSDP2 keeps a parameter's all-gather buffers and unsharded parameter from its first
    all-gather, so the format is fixed there (`fp8lm.tensor.fsdp_gather_fp8`): without this, a
    layer switched to high precision would go on multiplying the E4M3 (nvfp4: 4-bit) weight
    gathered for its FP8 GEMMs. This drops those buffers (between steps: parameters sharded, no
    unsharded gradient pending; others wait for the next call), and the next all-gather sends the
    stored values (O2's FP16, O3's E4M3, O1's FP32). `fully_shard` calls it before each forward of
    each sharded module, and `precompute_fp8_scales` first; after torch's own ``fully_shard``, call
    it (or `precompute_fp8_scales`) after switching layers."""
    count = 0
    for sharded in module.modules():
        if isinstance(sharded, FSDPModule):
            count += _refresh_group(sharded)
    return count


def _refresh_group(sharded: FSDPModule) -> int:
    """`refresh_gathers` for the parameters of one ``fully_shard`` call (``sharded``'s own group),
    and the spans of its `FP8ReduceScatter` (a switched layer's gradient is reduced in BF16)."""
    members = _group_layers(sharded)
    count = 0
    for fsdp_param, layer in members:
        holder = fsdp_param.sharded_param
        fixed = getattr(holder, "fsdp_gather_fp8", None)
        if layer is None or fixed in (None, multiplies_in_fp8(layer)) or not _between_steps(fsdp_param):
            continue
        count += 1
        # FSDP2 makes the buffers and the unsharded parameter again at its next all-gather
        # (``init_all_gather_outputs`` / ``init_unsharded_param`` do when these are empty).
        fsdp_param.all_gather_outputs = []
        fsdp_param._unsharded_inner_tensors = []
        if hasattr(fsdp_param, "_unsharded_param"):
            del fsdp_param._unsharded_param
        forget_fsdp_gather(holder)
    reduce_scatter, spans_for = _REDUCE_SCATTERS.get(sharded, (None, None))
    switched = tuple(switched_to_high_precision(layer) for _, layer in members)
    if isinstance(reduce_scatter, FP8ReduceScatter) and spans_for != switched:
        spans, chunk_numel = _wide_spans(sharded)  # a layer's plain FP32 weight (O1) switches too
        reduce_scatter.wide, reduce_scatter.chunk_numel = tuple(spans), chunk_numel
        _REDUCE_SCATTERS[sharded] = (reduce_scatter, switched)
    return count


# Each sharded module's (FSDPParam, the FP8 layer whose weight it is, or None), made at first use:
# both are fixed once ``fully_shard`` has run.
_GROUP_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group_layers(sharded: FSDPModule) -> list:
    members = _GROUP_LAYERS.get(sharded)
    if members is None:
        group = sharded._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        params = group.fsdp_params if group is not None else []
        members = [(p, gemm_layer_of(p._module_info.module, p.sharded_param)) for p in params]
        _GROUP_LAYERS[sharded] = members
    return members


def _between_steps(fsdp_param) -> bool:
    """Whether FSDP2 holds ``fsdp_param`` sharded with no unsharded gradient waiting to be reduced
    (not within a forward or backward, nor between micro-batches without gradient sync)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return (
        fsdp_param.sharded_state == ShardedState.SHARDED
        and fsdp_param.unsharded_accumulated_grad is None
        and (unsharded is None or unsharded.grad is None)
    )


@torch.compiler.disable
def _refresh_before_forward(sharded: nn.Module, args) -> None:
    """Forward pre-hook of a module `fully_shard` sharded (run before FSDP2's own, which gathers):
    `refresh_gathers` over it, so that a layer switched since the last step gathers anew. The root
    module's does it for all (FSDP2 names the root at its first forward); the others' skip."""
    if sharded._get_fsdp_state()._is_root is not False:  # type: ignore[operator]
        refresh_gathers(sharded)


class OwnGradStorage:
    """Post-accumulate-grad hook of a sharded parameter whose gradient has no stored format of its
    own (FP32: 1-D parameters, O1's embeddings), in an FSDP2 group whose other gradients are
    stored in their formats: copy the shard out of FSDP2's flat FP32 reduce-scatter output, so
    that the buffer is freed (a view of it would keep all of it alive, stored formats or not)."""

    def __call__(self, param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and grad._local_tensor._base is not None:
            param.grad = DTensor.from_local(
                grad._local_tensor.clone(),
                grad.device_mesh,
                grad.placements,
                run_check=False,
                shape=grad.shape,
                stride=grad.stride(),
            )


def _grad_format_hooks(module: nn.Module) -> dict[tuple[int, str], tuple[int, list[QuantizeGrad]]]:
    """The `QuantizeGrad` hooks (maybe none) of each of ``module``'s parameters that FSDP2 has not
    sharded yet (plain ones, and tensor-parallel DTensors), with the parameter's id, by (id of the
    owning module, attribute name): where FSDP2 puts the sharded one."""
    managed = {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    found = {}
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None and id(p) not in managed:
                hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
                found[(id(owner), name)] = (id(p), [h for h in hooks.values() if isinstance(h, QuantizeGrad)])
    return found


def _move_grad_format_hooks(module: nn.Module, hooks: dict[tuple[int, str], tuple[int, list[QuantizeGrad]]]) -> None:
    """Register ``hooks`` on the sharded parameters that replaced their parameters (once for a
    parameter held by several modules), and `OwnGradStorage` on the others when any has a format;
    a parameter FSDP2 did not shard (ignored: the same object) keeps its own hooks."""
    if not any(found for _, found in hooks.values()):
        return
    moved = set()
    for owner in module.modules():
        for name, p in owner._parameters.items():
            key = (id(owner), name)
            if key not in hooks or hooks[key][0] == id(p) or not isinstance(p, DTensor):
                continue
            if p.requires_grad and id(p) not in moved:
                moved.add(id(p))
                for hook in hooks[key][1] or [OwnGradStorage()]:
                    p.register_post_accumulate_grad_hook(hook)


def _wide_spans(sharded: nn.Module) -> tuple[list[tuple[int, int]], int]:
    """The (start, end) spans, in each rank's chunk of the group's flat gradient buffer, of the
    parameters whose gradient-format hook stores 16 bits (BF16, FP16: the output head's), and the
    chunk's length (FSDP2 lays the chunk out as its parameters' padded shards, in its order)."""
    spans, offset = [], 0
    for fsdp_param, layer in _group_layers(sharded):
        numel = fsdp_param.padded_sharded_param_size.numel()
        if _reduced_wide(fsdp_param, layer):
            spans.append((offset, offset + numel))
        offset += numel
    return spans, offset


def _reduced_wide(fsdp_param, layer: nn.Module | None) -> bool:
    """Whether `FP8ReduceScatter` sends this parameter's gradient in BF16 (`sent_in_bf16`: the
    output head's, a switched layer's); `fully_shard` moved the gradient-format hooks to the
    sharded parameter."""
    return sent_in_bf16(fsdp_param.sharded_param, layer)


def fully_shard(
    module: nn.Module, *, fp8_reduce_scatter: bool = True, autocast_dtype: torch.dtype | None = None, **kwargs
):
    """`torch.distributed.fsdp.fully_shard` (same arguments and return value) with FP8 weight
    all-gather for FP8Linear weights, FP8 gradient reduce-scatter (``fp8_reduce_scatter=False``
    keeps FSDP's own, in its ``MixedPrecisionPolicy.reduce_dtype``) and counted communication.
    Call it on each block, then on the whole model, as with torch's. On a model without fp8lm
    layers it is torch's FSDP2 (with ``fp8_reduce_scatter=False``), counted. Plain FP32 weights of
    FP8 GEMMs (O1) become `FP8GatheredWeight` shards, all-gathered as E4M3: the parameters change
    (as torch's ``fully_shard`` changes them anyway), so make or re-point the optimizer after;
    not with an int ``reshard_after_forward``, which FSDP2 does not run with all-gather extensions.
    The gradient-format hooks of `fp8lm.initialize` move to the sharded parameters.
    ``autocast_dtype`` (torch.bfloat16 or torch.float16; only when every forward of the model runs
    under ``torch.autocast`` of that dtype): plain FP32 weights of FP8Linear layers kept in high
    precision (O1's output head) become `AutocastGatheredWeight` shards, all-gathered in that dtype,
    the values autocast multiplies anyway (a forward outside it would multiply the rounded weights)."""
    if autocast_dtype is not None and autocast_dtype not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast_dtype is the dtype of the torch.autocast the forward runs under: torch.bfloat16 or "
            f"torch.float16, got {autocast_dtype}; leave it None without autocast"
        )
    grad_hooks = _grad_format_hooks(module)  # before the FP32 weights are wrapped (new parameters)
    reshard = kwargs.get("reshard_after_forward")
    if reshard is None or isinstance(reshard, bool):  # an int reshards to fewer ranks: no all-gather extensions then
        cast_to = _autocast_gemm_weights(module, autocast_dtype) if autocast_dtype is not None else {}
        blocks = _block_gathered_weights(module, kwargs.get("mesh"))
        wrap_fp32_weights(module, _fp8_gemm_weights(module), kwargs.get("ignored_params"), cast_to, blocks)
    sharded = torch_fully_shard(module, **kwargs)
    sharded.register_forward_pre_hook(_refresh_before_forward, prepend=True)  # before FSDP2's gather
    _choose_gather_formats(sharded)
    _move_grad_format_hooks(sharded, grad_hooks)
    sharded.set_custom_all_gather(CountedAllGather())
    reduce_scatter = FP8ReduceScatter(E4M3, *_wide_spans(sharded)) if fp8_reduce_scatter else CountedReduceScatter()
    sharded.set_custom_reduce_scatter(reduce_scatter)
    _REDUCE_SCATTERS[sharded] = (reduce_scatter, None)
    return sharded


def _fsdp_group(mesh):
    """The ranks FSDP2 gathers a parameter over: its whole mesh, or the first dimension of a
    2-D ``(dp, tp)`` mesh (a tensor-parallel shard is gathered over ``dp`` alone)."""
    return mesh.get_group(0) if mesh.ndim > 1 else mesh.get_group()


@torch.no_grad()
def precompute_fp8_scales(model: nn.Module) -> None:
    """Agree the all-gather scale of every sharded ScalingTensor weight of ``model`` (and every
    `FP8GatheredWeight`, O1's FP32 weights), and the per-tensor amax of every weight gathered in
    nvfp4's blocks, with one MAX all-reduce of their amaxes per FSDP group (instead of one per
    weight in each all-gather, forward and backward). Call it before the first forward and after
    every optimizer step; the scales hold until the next call. Layers switched between FP8 and high
    precision since their weight's format was fixed gather anew (`refresh_gathers`)."""
    refresh_gathers(model)
    _choose_gather_formats(model)
    by_group: dict = defaultdict(list)
    for owner, param, shard in _sharded_scaling_tensors(model):
        group = _fsdp_group(param.device_mesh)
        recipe = fsdp_gather_recipe(param, owner, param.shape, dist.get_world_size(group))
        if recipe is None:
            by_group[group].append((param, fsdp_shard_amax(shard), fsdp_gather_format(param, shard)))
        elif recipe.granularity == "nvfp4":
            by_group[group].append((param, fsdp_shard_amax(shard), None))
    for param, local in gathered_fp32_weights(model):
        by_group[_fsdp_group(param.device_mesh)].append((param, local.shard_amax(), E4M3))
    for param, local in _nvfp4_block_gathered(model):
        by_group[_fsdp_group(param.device_mesh)].append((param, _amax(local.inner).float(), None))
    for group, members in by_group.items():
        amaxes = torch.stack([value_amax for _, value_amax, _ in members])
        comm.all_reduce(amaxes, dist.ReduceOp.MAX, group)
        for (param, _, fmt), value_amax in zip(members, amaxes, strict=True):
            # Kept on the parameter, whose local tensor FSDP2 may replace.
            if fmt is None:  # nvfp4's tensor amax (`fp8lm.block_tensor.gather_inputs`)
                param.fsdp_gather_amax = value_amax  # type: ignore[attr-defined]
            else:
                param.fsdp_gather_scale = compute_scale(value_amax, fmt)  # type: ignore[attr-defined]


def _nvfp4_block_gathered(module: nn.Module) -> list[tuple[DTensor, BlockGatheredWeight]]:
    """(sharded parameter, local shard) of every O1 FP32 weight gathered in nvfp4's blocks."""
    return [
        (p, p._local_tensor)
        for p in module.parameters()
        if isinstance(p, DTensor)
        and isinstance(p._local_tensor, BlockGatheredWeight)
        and p._local_tensor.recipe.granularity == "nvfp4"
    ]
