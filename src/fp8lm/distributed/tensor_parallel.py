"""FP8 tensor and sequence parallelism as DTensor parallel styles, applied with torch's
``parallelize_module`` to `FP8Linear` layers.

- `FP8ColwiseParallel`: the weight (and bias) sharded by output rows, ``Shard(0)``; an input in
  ``Shard(1)`` (sequence parallel) is all-gathered as E4M3 bytes with one scale agreed over the
  TP group (under rowwise, blockwise or mxfp8: as the layer's input operand, in its
  blocks, `fp8lm.distributed.activation_comm.block_all_gather`), and its gradient goes back
  through the FP8 reduce-scatter; a plain replicated input gets its gradient summed with the FP8
  all-reduce. Output: the local ``Shard(-1)`` slice.
- `FP8RowwiseParallel`: the weight sharded by input columns, ``Shard(1)``, the bias replicated and
  added once after the reduction; the partial outputs are summed with FP8 payloads, one scale per
  chunk and FP32 sums: reduce-scattered to ``Shard(1)`` under sequence parallelism (backward: the
  gradient all-gathered as E5M2, or in the layer's output-gradient blocks as above), all-reduced
  to ``Replicate()`` otherwise.
- `PrepareFP8ModuleInput`: torch's `PrepareModuleInput` with the layout changes in FP8:
  ``Shard(d) -> Replicate()`` is the E4M3 all-gather (for tensor-parallel consumers, whose input
  gradients are partial sums: backward reduce-scatters them), ``Replicate() -> Shard(d)`` a local
  slice whose gradient is all-gathered as E5M2, and ``Replicate() -> Replicate()`` handed on as a
  DTensor (``use_local_output=False``) has its gradient summed once, as `SharedReplicatedInput`'s.
- `SharedReplicatedInput`: a module whose replicated input feeds several column-wise layers (an
  attention layer's separate q, k and v projections, an MLP's gate and up) hands it to them as one
  replicated DTensor, so their partial input gradients are added up first and summed over the
  ranks once (one FP8 all-reduce, or torch's in the gradient's dtype at bf16/fp32) rather than
  once per layer.

A layer switched to high precision (``high_precision``: a fallback, precision annealing) gets and
gives its activations and gradients in their own dtype instead, the reductions summed in FP32
(``fp8=False`` in `fp8lm.distributed.activation_comm`): a module input goes so when every FP8
layer it feeds is switched (a replicated one: the column-wise layers that read it).

They compose with torch's ``SequenceParallel`` for norms. Weights become ``nn.Parameter``
DTensors whose local tensors keep fp8lm's storage (a `ScalingTensor` with its payload and scale);
the layer computes on the local shards with its own FP8 GEMMs (`FP8Linear` takes its DTensor
parameters' local tensors itself: nothing is swapped in a hook, so a compiled block, activation
checkpointing included, has no side effect to trace), and the wire formats are those of
`fp8lm.distributed.activation_comm`. Each rank keeps its slice of its own copy of the module (all
copies must be equal: built from one seed or loaded from one checkpoint), so applying a style
sends nothing. ``chunks=k`` (column-wise only) shards each of ``k`` equal row blocks separately,
for fused projections (``q, k, v`` in one GEMM: ``chunks=3``); the DTensor's rows are then ordered
rank by rank.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from ..grad import QuantizeGrad
from ..nn.grouped import FP8GroupedLinear
from ..nn.linear import FP8Linear
from ..recipe import Recipe
from ..tensor import switched_to_high_precision
from .activation_comm import (
    all_reduce_partial,
    copy_to_parallel_region,
    gather_from_shards,
    reduce_replicated_grad,
    reduce_scatter_to_shards,
    scatter_to_shards,
)

__all__ = [
    "FP8ColwiseParallel",
    "FP8RowwiseParallel",
    "PrepareFP8ModuleInput",
    "SharedReplicatedInput",
    "ChunkedColwiseParallel",
    "CastPrepareModuleInput",
    "layers_recipe",
]


def _shard_dim(placement: Placement, ndim: int) -> int | None:
    """The dimension a ``Shard`` placement cuts (non-negative), None for ``Replicate``."""
    if isinstance(placement, Replicate):
        return None
    if isinstance(placement, Shard):
        return placement.dim % ndim
    raise ValueError(f"FP8 parallel styles take Shard or Replicate layouts, got {placement}")


def _change_layout(
    x: torch.Tensor, current: Placement, desired: Placement, group, recipe: Recipe | None = None, fp8: bool = True
) -> torch.Tensor:
    """``x`` (a local tensor in layout ``current``) in layout ``desired``, through FP8 collectives;
    a gather for layers of ``recipe`` sends their input operand where the recipe gathers in blocks
    (`gather_from_shards`). ``fp8=False``: in ``x``'s own dtype (for switched layers, `_switched`)."""
    have, want = _shard_dim(current, x.dim()), _shard_dim(desired, x.dim())
    if have == want:
        return x
    if want is None:
        return gather_from_shards(x, have, group, recipe, fp8=fp8)
    if have is None:
        return scatter_to_shards(x, want, group, fp8=fp8)
    raise ValueError(f"FP8 parallel styles cannot redistribute {current} to {desired}: go through Replicate()")


def _local_input(x, layout: Placement) -> tuple[torch.Tensor, Placement, bool]:
    """The local tensor, its layout (a DTensor's own, else ``layout``) and whether it was a DTensor."""
    if isinstance(x, DTensor):
        return x.to_local(), x.placements[0], True
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"FP8 parallel styles expect a tensor input, got {type(x).__name__}")
    return x, layout, False


def _shard_value(value: torch.Tensor, dim: int, chunks: int, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's part of ``value`` along ``dim``: its slice of each of ``chunks`` equal blocks."""
    rank, world = mesh.get_local_rank(), mesh.size()
    if value.shape[dim] % (chunks * world):
        raise ValueError(
            f"cannot shard a dimension of size {value.shape[dim]} into {chunks} block(s) over {world} "
            "ranks: make it divisible by chunks x tensor-parallel size"
        )
    blocks = value.detach().chunk(chunks, dim)
    return torch.cat([b.chunk(world, dim)[rank] for b in blocks], dim).contiguous()


def _distribute(module: nn.Module, name: str, placement: Placement, chunks: int, mesh: DeviceMesh) -> None:
    param = module._parameters.get(name)
    if param is None:
        return
    dim = _shard_dim(placement, param.dim())
    local = param.detach() if dim is None else _shard_value(param, dim, chunks, mesh)
    dt = DTensor.from_local(local, mesh, (placement,), run_check=False)
    sharded = nn.Parameter(dt, requires_grad=param.requires_grad)
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        if isinstance(hook, QuantizeGrad):  # the policy's gradient format goes with the parameter
            sharded.register_post_accumulate_grad_hook(hook)
    module.register_parameter(name, sharded)
    if chunks > 1:  # the rows are ordered rank by rank: checkpoints restore the model's order
        module.row_chunks = {**getattr(module, "row_chunks", {}), name: (chunks, mesh.size())}


def layers_recipe(module: nn.Module) -> Recipe | None:
    """The recipe every FP8 layer in ``module`` runs (`FP8Linear`, `FP8GroupedLinear`), or None
    when they differ or there is none: what an input gathered for them all is sent as."""
    recipes = {layer.recipe for layer in module.modules() if isinstance(layer, (FP8Linear, FP8GroupedLinear))}
    return recipes.pop() if len(recipes) == 1 else None


def _switched(layers) -> bool:
    """Whether every one of ``layers`` (FP8 layers; at least one) is switched to high precision now
    (``high_precision``: a fallback, precision annealing): their activations and gradients then
    travel in their own dtype, not FP8, so that the layers see what one process would give them.
    Read at each forward: the switch may come at any step."""
    return bool(layers) and all(switched_to_high_precision(layer) for layer in layers)


def _check_linear(style: str, module: nn.Module) -> None:
    if not isinstance(module, FP8Linear):
        raise TypeError(
            f"{style} applies to FP8Linear layers, got {type(module).__name__}: convert the model with "
            "fp8lm.initialize first, or use torch's own style for this module"
        )


class FP8ColwiseParallel(ColwiseParallel):
    """torch's `ColwiseParallel` for `FP8Linear`, with FP8 communication (module docstring).
    ``output_layouts`` must be ``Shard(-1)`` (the default); ``chunks``: see the module docstring."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        chunks: int = 1,
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        if not (isinstance(self.output_layouts[0], Shard) and self.output_layouts[0].dim == -1):
            raise ValueError(
                f"FP8ColwiseParallel's output stays sharded: output_layouts=Shard(-1), got {output_layouts}"
            )
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_linear(type(self).__name__, module)
        for name in ("weight", "bias"):
            _distribute(module, name, Shard(0), self.chunks, device_mesh)
        group = device_mesh.get_group()

        def prepare_input(mod, args):
            x, layout, was_dtensor = _local_input(args[0], self.input_layouts[0])
            fp8 = not _switched((mod,))
            if isinstance(layout, Replicate):
                # A replicated DTensor's producer reduces the gradient; a plain input is reduced here.
                x = x if was_dtensor else copy_to_parallel_region(x, group, fp8=fp8)
            else:
                x = _change_layout(x, layout, Replicate(), group, mod.recipe, fp8=fp8)
            return (x, *args[1:])

        def prepare_output(mod, args, out):
            return out if self.use_local_output else DTensor.from_local(out, device_mesh, (Shard(-1),), run_check=False)

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_hook(prepare_output)
        return module

    def __repr__(self) -> str:
        return super().__repr__()[:-1].replace("ColwiseParallel(", "FP8ColwiseParallel(") + f", chunks={self.chunks})"


class FP8RowwiseParallel(RowwiseParallel):
    """torch's `RowwiseParallel` for `FP8Linear`, with FP8 communication (module docstring).
    ``output_layouts``: ``Replicate()`` (FP8 all-reduce, the default) or ``Shard(d)`` (FP8
    reduce-scatter, sequence parallel)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_linear(type(self).__name__, module)
        _distribute(module, "weight", Shard(1), 1, device_mesh)
        _distribute(module, "bias", Replicate(), 1, device_mesh)
        module.bias_after_reduction = True  # added to the reduced output below
        group = device_mesh.get_group()
        output_layout = self.output_layouts[0]

        def prepare_input(mod, args):
            x, layout, _ = _local_input(args[0], self.input_layouts[0])
            return (_change_layout(x, layout, Shard(-1), group, fp8=not _switched((mod,))), *args[1:])

        def prepare_output(mod, args, out):
            dim = _shard_dim(output_layout, out.dim())
            fp8 = not _switched((mod,))
            if dim is None:
                out = all_reduce_partial(out, group, fp8=fp8)
            else:
                out = reduce_scatter_to_shards(out, dim, group, mod.recipe, fp8=fp8)
            bias = None if mod.bias is None else mod.bias.to_local()
            if bias is not None:
                # On a shard of the tokens, the bias gradient is partial: summed over the group.
                out = out + (bias if dim is None else reduce_replicated_grad(bias, group)).to(out.dtype)
            return (
                out
                if self.use_local_output
                else DTensor.from_local(out, device_mesh, (output_layout,), run_check=False)
            )

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_hook(prepare_output)
        return module

    def __repr__(self) -> str:
        return "FP8" + super().__repr__()


def _column_wise_layers(module: nn.Module) -> tuple:
    """The FP8 layers of ``module`` whose weights are sharded by output rows (`FP8ColwiseParallel`):
    the consumers of an input it shares, whose precision the shared input's gradient sum follows
    (not an ``o_proj`` beside them); every FP8 layer of ``module`` where none is sharded so."""
    return _column_wise_or_all(tuple(m for m in module.modules() if isinstance(m, FP8Linear)))


def _column_wise_or_all(layers: tuple) -> tuple:
    """Those of ``layers`` that are `FP8Linear`\ s with weights sharded by output rows; all of
    ``layers`` where none is. Read at each forward: the styles may be applied in any order."""
    column_wise = tuple(
        m
        for m in layers
        if isinstance(m, FP8Linear) and isinstance(m.weight, DTensor) and m.weight.placements[-1] == Shard(0)
    )
    return column_wise or layers


def _shared_replicated(x: torch.Tensor, mesh: DeviceMesh, fp8: bool) -> DTensor:
    """``x`` (the same on every rank) as a ``Replicate()`` DTensor whose gradient is summed over
    the ranks once, with the FP8 all-reduce (``fp8=False``: in FP32)."""
    x = copy_to_parallel_region(x, mesh.get_group(), fp8=fp8)
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)


class PrepareFP8ModuleInput(PrepareModuleInput):
    """torch's `PrepareModuleInput` (same arguments) whose layout changes go through FP8
    collectives (module docstring). ``Shard(d) -> Replicate()`` is meant for inputs that feed
    tensor-parallel layers: its backward sums the ranks' gradients. Where the module's FP8 layers
    all run one recipe that gathers in blocks (rowwise, blockwise, mxfp8:
    `fp8lm.distributed.activation_comm.gathers_in_blocks`), that gather sends their input operand
    (`block_all_gather`)."""

    recipe: Recipe | None = None  # of the module it is applied to (`_apply`)
    layers: tuple = ()  # its FP8 layers, the inputs' consumers (`_apply`)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # One style may be applied to several modules (a plan's "blocks.*.attn"): each gets its
        # own copy, which knows that module's recipe and layers.
        style = copy.copy(self)
        style.recipe = layers_recipe(module)
        style.layers = tuple(m for m in module.modules() if isinstance(m, (FP8Linear, FP8GroupedLinear)))
        return PrepareModuleInput._apply(style, module, device_mesh)

    def _prepare_input_arg(self, input, mesh: DeviceMesh, input_layout, desired_layout):
        if input_layout is None:
            return input
        x, current, was_dtensor = _local_input(input, input_layout)
        desired = desired_layout or current
        # In the tensors' own dtype when every FP8 layer the input feeds is switched to high
        # precision: a replicated input feeds the column-wise layers (not a row-wise c_proj beside
        # them), a sharded one the whole module.
        fp8 = not _switched(_column_wise_or_all(self.layers) if isinstance(desired, Replicate) else self.layers)
        if isinstance(current, Replicate) and isinstance(desired, Replicate) and not self.use_local_output:
            # Handed on as a replicated DTensor, whose consumers leave its gradient to its producer
            # (`FP8ColwiseParallel`): this style is that producer unless the input already was one.
            return input if was_dtensor else _shared_replicated(x, mesh, fp8)
        x = _change_layout(x, current, desired, mesh.get_group(), self.recipe, fp8=fp8)
        return x if self.use_local_output else DTensor.from_local(x, mesh, (desired,), run_check=False)

    def __repr__(self) -> str:
        return "PrepareFP8ModuleInput" + super().__repr__().removeprefix("PrepareModuleInput")


class SharedReplicatedInput(ParallelStyle):
    """The replicated input of a module that feeds it to several column-wise layers (module
    docstring), as a ``Replicate()`` DTensor: the layers (`FP8ColwiseParallel`, torch's
    `ColwiseParallel`) leave the gradient of a DTensor input to its producer, which sums it over the
    ranks once: with the FP8 all-reduce when ``fp8`` (in FP32 while all the module's column-wise FP8
    layers are switched to high precision: read at each forward), else torch's all-reduce of the
    partial DTensor gradient. The input is the keyword ``kwarg`` when the module is called with it,
    else the first positional one."""

    def __init__(self, *, fp8: bool, kwarg: str = "hidden_states") -> None:
        super().__init__()
        self.fp8, self.kwarg = fp8, kwarg

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def share(mod, x):
            if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
                return x
            if self.fp8:
                return _shared_replicated(x, device_mesh, fp8=not _switched(_column_wise_layers(mod)))
            return DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)

        def prepare_input(mod, args, kwargs):
            if self.kwarg in kwargs:
                return args, {**kwargs, self.kwarg: share(mod, kwargs[self.kwarg])}
            if not args:
                raise TypeError(
                    f"SharedReplicatedInput: {type(mod).__name__} was called without a positional input or "
                    f"{self.kwarg}=: pass kwarg= the keyword it takes its input by"
                )
            return (share(mod, args[0]), *args[1:]), kwargs

        module.register_forward_pre_hook(prepare_input, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"SharedReplicatedInput(fp8={self.fp8}, kwarg={self.kwarg!r})"


class ChunkedColwiseParallel(ColwiseParallel):
    """torch's `ColwiseParallel` (torch's collectives, in the tensors' own dtypes) for a plain
    ``nn.Linear``, with `FP8ColwiseParallel`'s ``chunks`` (each rank keeps its slice of each fused
    block) and, with ``input_dtype``, the input cast to that dtype before its all-gather: the
    higher-precision baseline of the FP8 styles (BF16 activations on the wire)."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        chunks: int = 1,
        input_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.chunks, self.input_dtype = chunks, input_dtype

    def _partition_linear_fn(self, name, module, device_mesh):
        for param_name in ("weight", "bias"):
            _distribute(module, param_name, Shard(0), self.chunks, device_mesh)

    def _prepare_input_fn(self, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if self.input_dtype is not None:
            x = x.to(self.input_dtype)
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, (x,), device_mesh)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", chunks={self.chunks}, input_dtype={self.input_dtype})"


class CastPrepareModuleInput(PrepareModuleInput):
    """torch's `PrepareModuleInput` (same arguments) with its tensor inputs cast to ``input_dtype``
    before their layout changes: the higher-precision baseline of `PrepareFP8ModuleInput` (one
    BF16 all-gather for a module whose several column-wise layers share an input)."""

    def __init__(self, *, input_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.input_dtype = input_dtype

    def _prepare_input_arg(self, input, mesh: DeviceMesh, input_layout, desired_layout):
        if self.input_dtype is not None and isinstance(input, torch.Tensor):
            input = input.to(self.input_dtype)
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", input_dtype={self.input_dtype})"
