"""`ScalingTensor`: a low-precision payload with a per-tensor scale, as a real `torch.Tensor`.

A ScalingTensor presents itself as a tensor of its high-precision dtype (``.dtype``, shape,
strides, device) while storing only ``payload`` (FP8 or FP16) and a float32 ``scale`` with
``value = payload / scale``. It is a wrapper subclass whose `__torch_dispatch__` handles an explicit
table of aten ops (`SUPPORTED_OPS`, listed in docs/api.md):

- views, copies, ``detach``, ``split``, ``cat`` of equally scaled tensors, ``.to(device)``,
  ``clone``, ``new_zeros``, ``deepcopy`` and ``torch.save`` keep the payload and the scale;
- the value ops that code which does not know about fp8lm runs on its tensors (the GEMM of a layer
  left in high precision, torch.optim's updates, ``clip_grad_norm_``'s norm, comparisons) see the
  dequantized values and return plain tensors;
- the in-place value ops of torch's optimizers and of gradient accumulation (``p.add_(u)``,
  ``grad += g``, ``lerp_``, ``addcdiv_``) dequantize, apply the op and requantize with a fresh
  scale from the result's amax, in place; ``copy_`` and ``mul_`` by a positive number keep the
  payload where they can.

Any other op raises ``NotImplementedError`` naming it: dequantizing silently would hide a
full-precision copy (and, in place, a requantization) in code meant to stay in low precision. Code
that needs such an op on a ScalingTensor opts in with `allow_dequantize_fallback`, or calls
``dequantize()`` first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import block_tensor
from .formats import E4M3, Format, format_of
from .ops.cast import FP8_DTYPES, saturating_cast, upcast
from .ops.cast import amax as _amax
from .recipe import Recipe
from .scaling import compute_scale

__all__ = [
    "ScalingTensor",
    "quantize",
    "SUPPORTED_OPS",
    "OP_KINDS",
    "allow_dequantize_fallback",
    "fsdp_gather_format",
    "fsdp_gather_fp8",
    "fsdp_gather_recipe",
    "forget_fsdp_gather",
    "gemm_layer_of",
    "gemm_layers_by_weight",
    "multiplies_in_fp8",
    "switched_to_high_precision",
    "fsdp_gathered",
    "fsdp_unsharded",
    "fsdp_wire",
    "fsdp_shard_amax",
]

aten = torch.ops.aten

# Ops that move or re-view elements without changing values: applied to the payload, the
# result keeps the scale. Views share the scale tensor (so an in-place requantize of the base is
# seen by its views); copies get their own.
_VIEW_OPS = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.as_strided.default,
    aten.narrow.default,
    aten.chunk.default,
}
_COPY_OPS = {aten.clone.default}
# new_zeros / new_empty of a ScalingTensor: a ScalingTensor of the same payload format (zeros are
# exact at any scale), so a padded FSDP2 shard keeps its low-precision storage.
_NEW_OPS = {aten.new_zeros.default, aten.new_empty.default}
# Ops that write a ScalingTensor keeping its payload where they can (`_copy_into`, `_fold_into_scale`).
_MUL_OPS = {aten.mul_.Tensor, aten.mul_.Scalar}
_WRITE_OPS = {aten.copy_.default, *_MUL_OPS}
# Ops that read only a tensor's shape, dtype and device: they run on an empty plain tensor of the
# same metadata (no dequantized copy) and return plain tensors.
_METADATA_OPS = {
    aten.zeros_like.default,
    aten.empty_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.is_same_size.default,
}
# Questions about the storage (DCP asks whether a tensor is pinned): answered by the payload's.
_PAYLOAD_QUERY_OPS = {aten.is_pinned.default}
# Value ops that code unaware of fp8lm runs on its tensors: a layer kept in high precision (its
# GEMM or lookup with a ScalingTensor weight), torch.optim's and clip_grad_norm_'s arithmetic,
# comparisons in checks. They compute with the dequantized values and return plain tensors.
_VALUE_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.embedding.default,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.div.Tensor,
    aten.neg.default,
    aten.abs.default,
    aten.sqrt.default,
    aten.addcmul.default,
    aten.addcdiv.default,
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.amax.default,
    aten.linalg_vector_norm.default,
    aten._foreach_norm.Scalar,  # torch's clip_grad_norm_ on DTensor gradients (FSDP2's shards)
    aten.eq.Tensor,
    aten.ne.Tensor,
    aten.equal.default,
    aten.isfinite.default,
    aten.isnan.default,
    aten.isinf.default,
    aten.maximum.default,
}
# Value ops of other libraries, by name (their library loads with its package): FSDP2's copy of
# the gradients into its reduce-scatter buffer, and the functional collectives with which a
# DTensor of ScalingTensor shards is redistributed (a full state dict gathers it): they carry the
# dequantized values.
_NAMED_VALUE_OPS = {
    "fsdp.chunk_cat.default",
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "_c10d_functional.broadcast.default",
}
# Ops whose result is the dequantized values' (a cat of differently scaled tensors too).
_READ_OPS = {*_VALUE_OPS, aten.cat.default}
# In-place value ops of torch's optimizers (SGD, Adam, AdamW) and of gradient accumulation on a
# ScalingTensor: dequantize, apply, requantize with a scale fitted to the result (`_inplace`).
_INPLACE_OPS = {
    aten.add_.Tensor,
    aten.add_.Scalar,
    aten.sub_.Tensor,
    aten.div_.Tensor,
    aten.div_.Scalar,
    aten.addcmul_.default,
    aten.addcdiv_.default,
    aten.lerp_.Scalar,
    aten.lerp_.Tensor,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.clamp_.default,
    aten._foreach_mul_.Tensor,  # torch's clip_grad_norm_ on DTensor gradients (FSDP2's shards)
}

OP_KINDS: Mapping[str, str] = {
    "view": "applied to the payload; the result is a ScalingTensor sharing the scale",
    "copy": "applied to the payload; the result is a ScalingTensor with its own scale (`_to_copy` to "
    "another dtype and `cat` of differently scaled tensors return plain tensors)",
    "write": "writes payload and scale, keeping the payload where it can (`copy_` of the same format, "
    "`mul_` by a positive number folded into the scale); else requantizes",
    "metadata": "reads only shape, dtype and device (`is_pinned`: the payload's storage); plain result",
    "value": "computes with the dequantized values; plain result",
    "inplace": "dequantizes, applies the op and requantizes in place with a scale from the result's amax",
}
# The name of every op a ScalingTensor handles, by kind (`OP_KINDS`); docs/api.md lists them.
_OPS_BY_KIND: dict[str, set] = {
    "view": _VIEW_OPS,
    "copy": {*_COPY_OPS, *_NEW_OPS, aten._to_copy.default, aten.cat.default},
    "write": _WRITE_OPS,
    "metadata": {*_METADATA_OPS, *_PAYLOAD_QUERY_OPS},
    "value": {*_VALUE_OPS, *_NAMED_VALUE_OPS},
    "inplace": _INPLACE_OPS,
}
SUPPORTED_OPS: Mapping[str, frozenset[str]] = {
    kind: frozenset(str(op) for op in ops) for kind, ops in _OPS_BY_KIND.items()
}

_FALLBACK: ContextVar[bool] = ContextVar("fp8lm_dequantize_fallback", default=False)


@contextlib.contextmanager
def allow_dequantize_fallback(enabled: bool = True) -> Iterator[None]:
    """Within this context (or a function it decorates), an op that `SUPPORTED_OPS` does not list
    runs on a ScalingTensor's dequantized values instead of raising, and an in-place one
    requantizes its result in place: for code that does not know about fp8lm and needs such an
    op. ``enabled=False`` turns a surrounding opt-in off."""
    token = _FALLBACK.set(enabled)
    try:
        yield
    finally:
        _FALLBACK.reset(token)


def _supported(func) -> bool:
    """Whether ``func`` is an op that reads a ScalingTensor's values or writes them in place."""
    return func in _READ_OPS or func in _INPLACE_OPS or func in _MUL_OPS or str(func) in _NAMED_VALUE_OPS


def _unsupported(func) -> NotImplementedError:
    inplace = " and requantize in place" if func._schema.is_mutable else ""
    return NotImplementedError(
        f"fp8lm: ScalingTensor does not support {func} (docs/api.md lists the ops it does); call "
        f".dequantize() first, or run it under fp8lm.allow_dequantize_fallback() to compute with the "
        f"dequantized values{inplace}"
    )


class ScalingTensor(torch.Tensor):
    """A tensor stored as ``payload`` (e.g. float8_e4m3fn) with ``value = payload / scale``."""

    _data: torch.Tensor
    _scale: torch.Tensor
    # For a view of part of another ScalingTensor (``t[0]``): the payload it shares its scale
    # with (views made inside __torch_dispatch__ are not tracked by autograd: no ``_base``).
    _shared_with: torch.Tensor | None = None
    # The exact amax of the payload as its writer measured it, with the payload's version then
    # (`note_payload_amax`). Kept on this object only: copies and pickles do not carry it.
    _noted_amax: tuple[int, torch.Tensor] | None = None

    @staticmethod
    def __new__(cls, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            payload.shape,
            strides=payload.stride(),
            storage_offset=payload.storage_offset(),
            dtype=dtype,
            device=payload.device,
            requires_grad=False,
        )

    def __init__(self, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        format_of(payload.dtype)  # raises on a payload dtype that is not a known format
        if not dtype.is_floating_point:
            raise TypeError(f"a ScalingTensor presents a floating-point dtype, got {dtype}")
        self._data = payload
        self._scale = torch.as_tensor(scale, dtype=torch.float32, device=payload.device)

    # -- public accessors -------------------------------------------------------------------
    @property
    def payload(self) -> torch.Tensor:
        """The stored low-precision values (``value * scale``)."""
        return self._data

    @property
    def scale(self) -> torch.Tensor:
        """float32 scale: ``payload = cast(value * scale)``."""
        return self._scale

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._scale.reciprocal()

    @property
    def fmt(self) -> Format:
        return format_of(self._data.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values as a plain tensor of ``dtype``."""
        if self._data.dtype in FP8_DTYPES and not torch.compiler.is_compiling():
            wide = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
            return upcast(self._data, self.scale_inv, wide).to(dtype)
        return (self._data.to(torch.float32) / self._scale).to(dtype)

    def requantize_(self, value: torch.Tensor) -> ScalingTensor:
        """Store ``value`` in place, with a scale fitted to its amax (just-in-time scaling). A view
        (``t[0]``) shares its scale with the rest of its base: the whole base is stored again with
        the scale fitted to its new values, so the other elements keep theirs."""
        value_amax = _amax(value)
        if self._shared_with is not None and self._partial_view():
            scale = _requantize_shared_(self._data, self._shared_with, self._scale, value, self.fmt)
        else:
            scale = compute_scale(value_amax, self.fmt, previous=self._scale)
            self._data.copy_(saturating_cast(value, scale, self.fmt))
        self._scale.copy_(scale)
        _count_write(self)
        if isinstance(self, torch.nn.Parameter) and not torch.compiler.is_compiling():
            # For FP8Linear's weight cast (gradients have no reader of it). Rounding is monotonic,
            # so the payload's amax is the rounded amax: no second pass.
            self.note_payload_amax(saturating_cast(value_amax, scale, self.fmt).float())
        return self

    def note_payload_amax(self, amax: torch.Tensor) -> None:
        """Record ``amax`` (a 0-dim float32 tensor on the payload's device) as the exact
        ``payload.abs().amax()`` of the payload as it is now: the writer that measured it (the FP8
        optimizer, `requantize_`) hands it to readers (`fp8lm.nn.FP8Linear` scaling the weight to
        FP8), which then need not read the whole payload again."""
        self._noted_amax = (self._data._version, amax)

    def known_payload_amax(self) -> torch.Tensor | None:
        """The amax noted for the payload (`note_payload_amax`), or None when none was noted or the
        payload changed since: any in-place write of the payload bumps its version."""
        noted = self._noted_amax
        return noted[1] if noted is not None and noted[0] == self._data._version else None

    def _partial_view(self) -> bool:
        """Whether other elements (of the tensor this is a view of) share the scale."""
        return self._shared_with is not None and self._shared_with.numel() > self._data.numel()

    def __repr__(self) -> str:  # type: ignore[override]  # must not dispatch: keep to the payload and scale
        if is_fake(self._scale):  # shapes only (compile-time logging prints traced metadata)
            scale = "?"
        else:
            value = self._scale.item()  # a symbolic float while torch.compile traces
            scale = f"{value:g}" if isinstance(value, float) else str(value)
        return (
            f"ScalingTensor(fmt={self.fmt.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, scale={scale})"
        )

    # -- subclass protocol (torch.compile, FSDP2, DCP) --------------------------------------
    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return ScalingTensor(inner_tensors["_data"], inner_tensors["_scale"], dtype)

    def __reduce_ex__(self, protocol):
        # Pickle (torch.save, deepcopy, multiprocessing) as payload + scale + dtype; an
        # nn.Parameter stays one (with its requires_grad), so pickled models still train.
        return (_rebuild, (self._data, self._scale, self.dtype, *_param_flags(self)))

    def __deepcopy__(self, memo):
        out = _rebuild(self._data.clone(), self._scale.clone(), self.dtype, *_param_flags(self))
        memo[id(self)] = out
        return out

    # -- FSDP2 all-gather extension (torch.distributed.fsdp.fully_shard) ---------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard as sent by FSDP2's all-gather: a payload of the shard's gather format
        (E4M3 for the weight of an FP8 GEMM, with fp8lm's or torch's `fully_shard`; else its own format),
        padded to FSDP's padded shard size, all ranks with one agreed scale. The scale is the
        precomputed one (`fp8lm.distributed.precompute_fp8_scales`, one batched all-reduce for a
        whole model) or else a MAX all-reduce of this parameter's amax over ``mesh``."""
        # The choices live on the sharded parameter: FSDP2 replaces a padded shard's local tensor.
        holder = fsdp_holder(module, self)
        recipe = fsdp_gather_recipe(holder, module, outer_size, mesh.size())
        if recipe is not None:  # the recipe's operand with the scales of this rank's blocks
            amax = getattr(holder, "fsdp_gather_amax", None)  # nvfp4's, agreed by precompute_fp8_scales
            return block_tensor.gather_inputs(self.dequantize(torch.float32), recipe, mesh.get_group(), amax)
        fmt = fsdp_gather_format(holder, self, _fp8_gemm_weight_format(module, holder))
        scale = getattr(holder, "fsdp_gather_scale", None)
        if scale is None:
            value_amax = fsdp_shard_amax(self).reshape(1)
            torch.distributed.all_reduce(value_amax, torch.distributed.ReduceOp.MAX, group=mesh.get_group())
            scale = compute_scale(value_amax.reshape(()), fmt)
        return (fsdp_wire(self._data, scale / self._scale, fmt, outer_size, mesh.size()),), (fmt.dtype, scale)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered parameter: the ranks' payloads as one ScalingTensor with the agreed scale,
        used by `FP8Linear` as its FP8 operand directly; under a fine-grained recipe the
        `fp8lm.block_tensor.BlockScaledTensor` of the ranks' blocks."""
        if metadata[0] == block_tensor.GATHER_TAG:
            if out is None:
                return block_tensor.gathered(all_gather_outputs, metadata, param_dtype)
            # A later all-gather refilled its payload and scale bytes in place.
            block_tensor.refresh(getattr(out, "_local_tensor", out), all_gather_outputs, metadata)
            return None
        return fsdp_gathered(all_gather_outputs, metadata, param_dtype, out)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _VIEW_OPS or func in _COPY_OPS:
            if func is aten.detach.default:  # autograd detaches every gradient it stores: skip the pytree walk
                src = args[0]
                return _view(src, src._data.detach())
            return _payload_op(func, args, kwargs, copy=func in _COPY_OPS)
        if func is aten._to_copy.default:
            return _to_copy(args[0], **kwargs)
        if func in _NEW_OPS and isinstance(args[0], ScalingTensor):  # FSDP2 pads shards with new_zeros
            src = args[0]
            payload = func(src._data, *args[1:], **{**kwargs, "dtype": src._data.dtype})
            return ScalingTensor(payload, src._scale.clone(), kwargs.get("dtype") or src.dtype)
        if func is aten.copy_.default:
            return _copy_into(args[0], args[1])
        if func is aten.cat.default:
            out = _cat_payloads(*args, **kwargs)
            if out is not None:
                return out
        if func in _MUL_OPS and _fold_into_scale(args):
            return args[0]
        if func in _PAYLOAD_QUERY_OPS:
            return func(args[0]._data, *args[1:], **kwargs)
        if func in _METADATA_OPS:
            return func(*tree_map(_empty_like_leaf, args), **kwargs)
        if not (_supported(func) or _FALLBACK.get()):
            raise _unsupported(func)
        if func._schema.is_mutable:
            return _inplace(func, args, kwargs)
        args, kwargs = tree_map(_dequantize_leaf, (args, kwargs))
        return func(*args, **kwargs)


# Factors folded into the scale: far from under- or overflowing it.
_FOLDED_FACTORS = (2.0**-20, 2.0**20)


def _fold_into_scale(args) -> bool:
    """``t.mul_(c)`` of a whole ScalingTensor by a positive number: divide its scale by ``c`` and
    keep the payload (True), else False. Requantizing instead would round ``t * c`` to the payload
    format on its own: a factor within half a code of 1 (AdamW's decoupled weight decay,
    ``1 - lr * wd``, on an FP16 weight) would then round back to ``t`` and never act. Folded, it is
    exact and the next write that requantizes (the update) rounds once, with the factor in it."""
    t, factor = args[0], args[1]
    if isinstance(factor, torch.Tensor):  # a wrapped Python number: a 0-dim CPU tensor
        if factor.dim() != 0 or factor.device.type != "cpu" or isinstance(factor, ScalingTensor):
            return False
        factor = factor.item()
    if not isinstance(t, ScalingTensor) or not isinstance(factor, (int, float)):
        return False
    if not _FOLDED_FACTORS[0] <= factor <= _FOLDED_FACTORS[1]:  # also refuses NaN, 0 and negatives
        return False
    if t._partial_view() and not _only_nonzeros_in_view(t):  # the scale is the other elements' too
        return False
    t._scale.div_(factor)
    if not torch.compiler.is_compiling():  # the payload (and an amax noted for it) is unchanged
        torch.autograd.graph.increment_version([t._scale])
    return True


def _only_nonzeros_in_view(t: ScalingTensor) -> bool:
    """Whether every nonzero element that shares ``t``'s scale is in ``t`` (an FSDP2 shard over a
    zero-padded buffer): scaling them all by one factor is then scaling ``t``."""
    assert t._shared_with is not None  # a view
    shared, own = (x.to(torch.float16) if x.dtype in FP8_DTYPES else x for x in (t._shared_with, t._data))
    return bool(torch.count_nonzero(shared) == torch.count_nonzero(own))  # no float8 kernel: FP16 is exact


def _param_flags(t: torch.Tensor) -> tuple[bool, bool]:
    return isinstance(t, torch.nn.Parameter), t.requires_grad


def _rebuild(
    payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, is_param: bool = False, requires_grad: bool = False
) -> torch.Tensor:
    out = ScalingTensor(payload, scale, dtype)
    return torch.nn.Parameter(out, requires_grad=requires_grad) if is_param else out.requires_grad_(requires_grad)


# Saved ScalingTensors load with torch.load(weights_only=True).
torch.serialization.add_safe_globals([ScalingTensor, _rebuild])


def _dequantize_leaf(x):
    return x.dequantize(x.dtype) if isinstance(x, ScalingTensor) else x


def _empty_like_leaf(x):
    if not isinstance(x, ScalingTensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _the_scaling_tensor(args) -> ScalingTensor:
    return next(a for a in tree_flatten(args)[0] if isinstance(a, ScalingTensor))


def _view(src: ScalingTensor, payload: torch.Tensor) -> ScalingTensor:
    """A ScalingTensor over ``payload``, a view of ``src``'s payload, sharing its scale."""
    out = ScalingTensor(payload, src._scale, src.dtype)
    out._shared_with = src._data if src._shared_with is None else src._shared_with
    return out


def _payload_op(func, args, kwargs, copy: bool):
    src = _the_scaling_tensor(args)
    out = func(*tree_map(lambda x: x._data if isinstance(x, ScalingTensor) else x, args), **kwargs)
    if copy:
        return tree_map(
            lambda t: ScalingTensor(t, src._scale.clone(), src.dtype) if isinstance(t, torch.Tensor) else t, out
        )
    return tree_map(lambda t: _view(src, t) if isinstance(t, torch.Tensor) else t, out)


def _to_copy(x: ScalingTensor, dtype=None, device=None, **kwargs):
    if dtype is None or dtype == x.dtype:
        device = x.device if device is None else device
        return ScalingTensor(x._data.to(device, copy=True), x._scale.to(device, copy=True), x.dtype)
    return x.dequantize(dtype).to(device if device is not None else x.device)


def _count_write(t: ScalingTensor) -> None:
    """Count an in-place write of ``t``'s payload and scale in their versions, as an in-place op
    outside ``__torch_dispatch__`` would (inside it, below autograd, copies do not), so that
    what is derived from them (`fp8lm.nn.FP8Linear`'s FP8 weight) sees the change."""
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version([t._data, t._scale])


def _requantize_shared_(
    view: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, value: torch.Tensor, fmt: Format
) -> torch.Tensor:
    """Write ``value`` into the payload ``view`` of ``base``, which shares ``scale``: the base's
    values with ``value`` in the view's place, stored with a scale fitted to their amax (returned,
    not yet written to ``scale``). Power-of-two scales keep the other elements exact unless the
    new scale pushes them below the format's smallest value."""
    values = torch.empty_strided(base.shape, base.stride(), dtype=torch.float32, device=base.device)
    values.copy_(base).div_(scale)
    offset = view.storage_offset() - base.storage_offset()
    values.as_strided(view.shape, view.stride(), values.storage_offset() + offset).copy_(value)
    new_scale = compute_scale(_amax(values), fmt, previous=scale)
    base.copy_(saturating_cast(values, new_scale, fmt))
    return new_scale


def _copy_into(dst, src):
    if isinstance(dst, ScalingTensor):
        if (
            isinstance(src, ScalingTensor)
            and src._data.dtype == dst._data.dtype
            and (not dst._partial_view() or torch.equal(src._scale, dst._scale))
        ):
            dst._data.copy_(src._data)
            dst._scale.copy_(src._scale)
            _count_write(dst)
        else:
            dst.requantize_(_dequantize_leaf(src))
        return dst
    return dst.copy_(src.dequantize(dst.dtype))


def _cat_payloads(tensors, dim=0):
    """cat of ScalingTensors sharing a payload dtype and a scale value stays quantized."""
    if not all(isinstance(t, ScalingTensor) for t in tensors):
        return None
    first = tensors[0]
    same = all(
        t._data.dtype == first._data.dtype and t.dtype == first.dtype and torch.equal(t._scale, first._scale)
        for t in tensors[1:]
    )
    if not same:
        return None
    return ScalingTensor(torch.cat([t._data for t in tensors], dim), first._scale.clone(), first.dtype)


def _inplace(func, args, kwargs):
    """Run a mutating op on dequantized copies of the ScalingTensors it writes, then requantize."""
    written: dict[int, ScalingTensor] = {}
    flat, spec = tree_flatten((args, kwargs))
    schema_args = func._schema.arguments
    write_positions = {i for i, a in enumerate(schema_args) if a.alias_info is not None and a.alias_info.is_write}
    write_names = {schema_args[i].name for i in write_positions}
    # Which flat leaves are written: the leaves under written positional args or kwargs.
    written_ids: set[int] = set()
    for i, a in enumerate(args):
        if i in write_positions:
            written_ids.update(id(t) for t in tree_flatten(a)[0] if isinstance(t, ScalingTensor))
    for k, v in kwargs.items():
        if k in write_names:
            written_ids.update(id(t) for t in tree_flatten(v)[0] if isinstance(t, ScalingTensor))
    temps = {}
    new_flat = []
    for leaf in flat:
        if isinstance(leaf, ScalingTensor):
            tmp = leaf.dequantize(leaf.dtype)
            if id(leaf) in written_ids:
                temps[id(tmp)] = (tmp, leaf)
                written[id(leaf)] = leaf
            new_flat.append(tmp)
        else:
            new_flat.append(leaf)
    new_args, new_kwargs = tree_unflatten(new_flat, spec)
    out = func(*new_args, **new_kwargs)
    for tmp, target in temps.values():
        target.requantize_(tmp)
    return tree_map(lambda t: temps[id(t)][1] if isinstance(t, torch.Tensor) and id(t) in temps else t, out)


def fsdp_holder(module: torch.nn.Module, shard: torch.Tensor) -> torch.Tensor:
    """The sharded parameter of ``module`` whose local tensor is ``shard`` (FSDP2's
    ``fsdp_pre_all_gather`` gets the shard): where a gather's choices live, since FSDP2 replaces
    a padded shard's local tensor; ``shard`` itself when none is."""
    return next((p for p in module.parameters() if getattr(p, "_local_tensor", None) is shard), shard)


def fsdp_wire(shard: torch.Tensor, scale: torch.Tensor, fmt: Format, outer_size, ranks: int) -> torch.Tensor:
    """A rank's all-gather input for FSDP2: ``shard`` (its rows of a parameter of ``outer_size``)
    cast to ``fmt`` with ``scale``, zero-padded to FSDP's padded shard of ``ceil(dim 0 / ranks)``
    rows, as uint8 bytes for a 1-byte format (no backend carries float8)."""
    rows = -(-outer_size[0] // ranks)
    padded = torch.zeros((rows, *outer_size[1:]), dtype=fmt.dtype, device=shard.device)
    if shard.numel() > 0:
        padded[: shard.shape[0]] = saturating_cast(shard, scale, fmt)
    return padded.view(torch.uint8) if fmt.bytes == 1 else padded


def fsdp_gathered(all_gather_outputs, metadata, param_dtype: torch.dtype, out=None):
    """FSDP2's ``fsdp_post_all_gather`` of a one-scale payload (``metadata``: its dtype and the
    agreed scale): the gathered ScalingTensor and its inner tensors, or with ``out`` (the one
    built at the first all-gather, whose payload storage FSDP2 refilled) None after refreshing
    its scale."""
    (wire,) = all_gather_outputs
    payload_dtype, scale = metadata
    payload = wire.view(payload_dtype)
    payload._fsdp_unsharded = True  # read by `fsdp_unsharded`
    if out is not None:  # later all-gathers refill the same payload storage
        # Under 2-D (FSDP2 x tensor parallel) FSDP2 hands back the DTensor it built around
        # this ScalingTensor: the scale to refresh is its local tensor's.
        block_tensor.refill(getattr(out, "_local_tensor", out).scale, scale)
        return None
    return ScalingTensor(payload, scale.clone(), param_dtype), (payload,)


def fsdp_unsharded(t: ScalingTensor) -> bool:
    """Whether ``t`` is a weight FSDP2 all-gathered through `fsdp_gathered` (or a view of one, as
    the parameter FSDP2 makes of it): its payload lives in FSDP2's all-gather buffer, freed after
    each use, rather than in a parameter of its own."""
    return any(getattr(p, "_fsdp_unsharded", False) for p in (t._data, t._shared_with) if p is not None)


def fsdp_shard_amax(shard: ScalingTensor) -> torch.Tensor:
    """amax of a shard's values (0 for an empty shard), float32."""
    if shard.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=shard.device)
    return _amax(shard.payload).float() / shard.scale


def _holds_weight(layer: torch.nn.Module, holder: torch.Tensor) -> bool:
    """Whether ``holder`` is ``layer``'s weight, or one of its experts' (an `FP8GroupedLinear`
    keeps one weight per expert in an ``nn.ParameterList``)."""
    weight = getattr(layer, "weight", None)
    if isinstance(weight, torch.nn.ParameterList):
        return any(w is holder for w in weight)
    return weight is holder


def gemm_layer_of(module: torch.nn.Module, holder: torch.Tensor) -> torch.nn.Module | None:
    """The FP8 layer (one with an ``fp8_enabled`` switch, on or off) under ``module`` whose weight
    (or one of whose experts' weights) is ``holder``, or None. ``module`` may be the
    `fp8lm.nn.grouped.ExpertWeights` list that holds an expert's weight (what FSDP2 hands the
    expert's all-gather): its ``grouped_layer`` is the layer."""
    owner = getattr(module, "grouped_layer", None)
    layers = module.modules() if owner is None else (owner,)
    return next((m for m in layers if hasattr(m, "fp8_enabled") and _holds_weight(m, holder)), None)


def gemm_layers_by_weight(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Every FP8 layer under ``module`` (one with an ``fp8_enabled`` switch) by the ``id`` of its
    weight, or of each of its experts' weights: `gemm_layer_of` for all parameters at once."""
    found: dict[int, torch.nn.Module] = {}
    for layer in module.modules():
        weight = getattr(layer, "weight", None) if hasattr(layer, "fp8_enabled") else None
        for w in weight if isinstance(weight, torch.nn.ParameterList) else [weight]:
            if w is not None:
                found[id(w)] = layer
    return found


def _fp8_layer_of(module: torch.nn.Module, holder: torch.Tensor) -> torch.nn.Module | None:
    """`gemm_layer_of` when that layer's GEMMs are in FP8 (it says ``fp8_enabled``), else None."""
    layer = gemm_layer_of(module, holder)
    return layer if layer is not None and layer.fp8_enabled else None


def switched_to_high_precision(layer: torch.nn.Module | None) -> bool:
    """Whether ``layer`` (an FP8 layer or None) is switched to ``high_precision`` now (a fallback,
    precision annealing): its GEMMs in BF16, its weight gradient in the weight's dtype."""
    return layer is not None and bool(getattr(layer, "high_precision", False))


def multiplies_in_fp8(layer: torch.nn.Module | None) -> bool:
    """Whether ``layer`` (an FP8 layer or None) runs its GEMMs in FP8 now: ``fp8_enabled`` and not
    switched to ``high_precision`` (a fallback, precision annealing)."""
    return layer is not None and bool(layer.fp8_enabled) and not switched_to_high_precision(layer)


# What a sharded parameter keeps of its FSDP2 all-gather: fixed at the first one, since FSDP2 keeps
# the gathered buffers (`fsdp_gather_fp8`, `fsdp_gather_format`, `fsdp_gather_recipe`), and the
# scales `fp8lm.distributed.precompute_fp8_scales` agreed.
FSDP_GATHER_CHOICES = (
    "fsdp_gather_fp8",
    "fsdp_gather_fmt",
    "fsdp_gather_recipe",
    "fsdp_gather_scale",
    "fsdp_gather_amax",
)


def fsdp_gather_fp8(holder: torch.Tensor, module: torch.nn.Module) -> bool:
    """Whether FSDP2 all-gathers ``holder`` (a sharded parameter) for an FP8 GEMM: the layer under
    ``module`` whose weight it is multiplies in FP8 (``fp8_enabled``, not ``high_precision``).
    Else the weight travels as the layer then multiplies it: in its stored format (FP32 at O1).
    Kept on ``holder`` and fixed with the gather's format, until
    `fp8lm.distributed.refresh_gathers` finds the layer switched."""
    fixed = getattr(holder, "fsdp_gather_fp8", None)
    if fixed is None:
        fixed = multiplies_in_fp8(gemm_layer_of(module, holder))
        holder.fsdp_gather_fp8 = fixed  # type: ignore[attr-defined]
    return fixed


def forget_fsdp_gather(holder: torch.Tensor) -> None:
    """Drop what ``holder`` kept of its all-gather (`FSDP_GATHER_CHOICES`): the next one chooses
    anew (`fp8lm.distributed.refresh_gathers` does this with FSDP2's buffers)."""
    for name in FSDP_GATHER_CHOICES:
        holder.__dict__.pop(name, None)


def _fp8_gemm_weight_format(module: torch.nn.Module, holder: torch.Tensor) -> Format | None:
    """E4M3 when ``holder`` is the weight of a layer under ``module`` whose GEMMs run in FP8 with
    one scale per tensor, so that torch's own ``fully_shard`` gathers it in FP8 too (a
    fine-grained recipe's weight that is not gathered in its blocks keeps its own format, so that
    the layer quantizes the exact values); looked up only until the format is fixed
    (`fsdp_gather_format`)."""
    if getattr(holder, "fsdp_gather_fmt", None) is not None or not fsdp_gather_fp8(holder, module):
        return None
    layer = _fp8_layer_of(module, holder)
    recipe = getattr(layer, "recipe", None)
    return E4M3 if layer is not None and not getattr(recipe, "fine_grained", False) else None


def fsdp_gather_recipe(
    holder: torch.Tensor, module: torch.nn.Module, shape: tuple[int, ...] | torch.Size, ranks: int
) -> Recipe | None:
    """The fine-grained recipe whose forward weight operand FSDP2 all-gathers for ``holder`` (its
    sharded parameter), or None: that of the FP8 layer under ``module`` whose weight it is, while
    it multiplies in FP8 (`fsdp_gather_fp8`) and the shards of a 1-D FSDP mesh of more than one rank hold whole blocks
    (`fp8lm.block_tensor.shards_whole_blocks`; on one rank FSDP2 skips the all-gather and reads only
    the first of its inputs, so the weight stays in its stored format there). Kept on ``holder``,
    fixed at the first all-gather (FSDP2 keeps the gathered buffers)."""
    chosen = getattr(holder, "fsdp_gather_recipe", None)
    if chosen is None:
        one_dim = getattr(getattr(holder, "device_mesh", None), "ndim", 1) == 1
        layer = _fp8_layer_of(module, holder)
        chosen = (one_dim and fsdp_gather_fp8(holder, module) and block_gather_recipe(layer, shape, ranks)) or False
        holder.fsdp_gather_recipe = chosen  # type: ignore[attr-defined]
    return chosen if isinstance(chosen, Recipe) else None


def block_gather_recipe(
    layer: torch.nn.Module | None, shape: tuple[int, ...] | torch.Size, ranks: int
) -> Recipe | None:
    """The fine-grained recipe in whose blocks a weight of ``shape`` of ``layer`` (an FP8 layer,
    or None) travels when FSDP2 shards it over ``ranks`` of a 1-D mesh while the layer multiplies
    in FP8, or None: ``layer`` has a fine-grained recipe, and the shards of more than one rank hold
    whole blocks (`fp8lm.block_tensor.shards_whole_blocks`; on one rank FSDP2 skips the all-gather and
    reads only the first of its inputs)."""
    recipe = getattr(layer, "recipe", None)
    if not isinstance(recipe, Recipe) or not recipe.fine_grained:
        return None
    return recipe if ranks > 1 and block_tensor.shards_whole_blocks(recipe, shape, ranks) else None


def fsdp_gather_format(holder: torch.Tensor, shard: ScalingTensor, prefer: Format | None = None) -> Format:
    """The format FSDP2 all-gathers ``shard`` in, kept on ``holder`` (its sharded parameter) and
    fixed at its first use (FSDP2 keeps the gathered buffers): ``prefer`` (E4M3 for an FP8 GEMM's
    weight, as `fp8lm.distributed` asks) or, when nothing asked before the first all-gather, the
    shard's own payload format."""
    fmt = getattr(holder, "fsdp_gather_fmt", None)
    if fmt is None:
        fmt = prefer or shard.fmt
        holder.fsdp_gather_fmt = fmt  # type: ignore[attr-defined]
    return fmt


def quantize(
    x: torch.Tensor,
    fmt: Format = E4M3,
    scale: torch.Tensor | float | None = None,
    margin: int = 0,
) -> ScalingTensor:
    """Quantize a floating-point tensor to ``fmt`` with a per-tensor power-of-two scale.

    ``scale`` (``fp8 = cast(x * scale)``) is computed from ``x``'s amax when None. The result is a
    `ScalingTensor` of ``x``'s dtype; values beyond the format's range saturate to +-max.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if isinstance(x, ScalingTensor):
        x = x.dequantize(x.dtype)
    if not x.dtype.is_floating_point:
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}; convert it first, e.g. x.float()")
    fmt = format_of(fmt)
    if scale is None:
        scale = compute_scale(_amax(x.detach()), fmt, margin)
    else:
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        if scale.numel() != 1 or not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError(f"scale must be one finite positive number, got {scale}")
        scale = scale.reshape(())
    return ScalingTensor(saturating_cast(x.detach(), scale, fmt), scale, x.dtype)
