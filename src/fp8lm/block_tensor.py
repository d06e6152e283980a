"""`BlockScaledTensor`: a weight held as a fine-grained recipe's forward GEMM operand, and how
FSDP2 all-gathers a weight in that form.

Under a fine-grained recipe (`fp8lm.Recipe.fine_grained`) an FSDP2-sharded `FP8Linear` weight (or
an `FP8GroupedLinear` expert's; at O1 a `fp8lm.distributed.fp32_gather.BlockGatheredWeight`) is
all-gathered as its forward operand: each rank quantizes its own rows as
`fp8lm.ops.finegrained.quantize_operand` quantizes the whole weight along in_features (one scale
per row, 1 x 32 or 128 x 128 or 16 x 16 blocks) and sends the E4M3 bytes with the scales of its
rows or blocks (`gather_inputs`: E8M0 bytes where they are powers of two, else float32); the gathered payload and scales are the operand of the whole
weight, bit for bit, as a `BlockScaledTensor` (`gathered`) that `FP8Linear` multiplies directly.
nvfp4's per-tensor scale comes from the amax of the whole weight (agreed by
`fp8lm.distributed.precompute_fp8_scales`, or else a MAX all-reduce at the gather); its E2M1
elements travel packed two to a byte (`fp8lm.ops.nvfp4.pack_e2m1_bytes`, for an even
in_features) with one E4M3 byte per 16 x 16 block, its format's own scale bytes, and the
gathered tensor keeps them packed, as uint8 (unpacked for each use of its `operand`). Scale bytes
(E8M0, E4M3) likewise stay bytes, decoded for each use: everything a gathered weight holds is a
view of FSDP2's all-gather buffers, which FSDP2 frees after the forward.

That needs every shard to hold whole blocks (`shards_whole_blocks`): FSDP2 shards dim 0 evenly,
``rows / ranks`` rows per rank, a multiple of the block's rows (1 for rowwise and mxfp8, 128 for
blockwise, 16 for nvfp4). Otherwise the weight is gathered in its stored format (FP16, exact)
and the layer quantizes it after the gather, as in one process.

A BlockScaledTensor presents its values' dtype (float32) and shape. Views that keep the whole
tensor (``detach``, ``alias``, whole ``view``/``as_strided``: what FSDP2 and ``nn.Parameter`` do
to a gathered weight) keep the payload and scales; any other op that reads it (a layer left in
high precision) computes with the dequantized values; in-place ops are refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from .ops import nvfp4
from .ops.block_scales import e8m0_values
from .ops.blocks import Block
from .ops.finegrained import BlockOperand, operand_block, pack_nvfp4_operand, quantize_operand
from .recipe import Recipe

__all__ = [
    "BlockScaledTensor",
    "gathered_operand",
    "shards_whole_blocks",
    "gather_inputs",
    "gathered",
    "refresh",
    "refill",
    "pow2_scales",
    "decoded_scales",
    "GATHER_TAG",
]

aten = torch.ops.aten
GATHER_TAG = "blocks"  # marks the all-gather metadata of a block-scaled gather
_KEEP_OPS = {aten.detach.default, aten.alias.default}
_WHOLE_VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.as_strided.default}


class BlockScaledTensor(torch.Tensor):
    """A 2-D tensor stored as ``payload`` (float8, or nvfp4's E2M1 elements packed two to a byte
    along rows as uint8 bytes, `fp8lm.ops.nvfp4.pack_e2m1_bytes`) with one ``d`` per ``block``:
    ``value = payload * d`` blockwise (`fp8lm.ops.finegrained.BlockOperand`); ``tensor_scale``:
    nvfp4's per-tensor decode scale. ``d`` is float32, or the scale bytes as they were gathered
    (E8M0 codes as uint8; nvfp4's E4M3, times ``tensor_scale``), decoded to float32 for each use
    (`operand`): a decoded copy kept on the gathered weight would outlive FSDP2's freeing of its
    buffers."""

    _data: torch.Tensor
    _d: torch.Tensor
    _block: Block
    _tensor_scale: torch.Tensor | None

    @staticmethod
    def __new__(
        cls,
        payload: torch.Tensor,
        d: torch.Tensor,
        block: Block,
        dtype: torch.dtype = torch.float32,
        tensor_scale: torch.Tensor | None = None,
    ):
        rows, cols = payload.shape[0], payload.shape[-1] * (2 if payload.dtype == torch.uint8 else 1)
        return torch.Tensor._make_wrapper_subclass(
            cls, (rows, cols), strides=(cols, 1), dtype=dtype, device=payload.device, requires_grad=False
        )

    def __init__(
        self,
        payload: torch.Tensor,
        d: torch.Tensor,
        block: Block,
        dtype: torch.dtype = torch.float32,
        tensor_scale: torch.Tensor | None = None,
    ):
        if payload.dim() != 2:
            raise ValueError(f"a BlockScaledTensor is 2-D, got payload shape {tuple(payload.shape)}")
        self._data, self._d, self._block = payload, d, (int(block[0]), int(block[1]))
        self._tensor_scale = tensor_scale

    @property
    def operand(self) -> BlockOperand:
        """The payload, scales and block as a GEMM operand (a packed payload unpacked to E4M3 bytes)."""
        return gathered_operand(self)  # type: ignore[return-value]  # self is one

    @property
    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload and scales as held, undecoded: for a gathered weight, views of FSDP2's
        all-gather buffers (nvfp4's packed elements; E8M0 codes as uint8, or E4M3 scale bytes)."""
        return self._data, self._d

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values as a plain tensor of ``dtype``."""
        return self.operand.dequantize().to(dtype)

    def __repr__(self) -> str:  # type: ignore[override]  # must not dispatch
        return (
            f"BlockScaledTensor(payload={self._data.dtype}, shape={tuple(self.shape)}, block={self._block}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    def __tensor_flatten__(self):
        inner = ["_data", "_d"] + ([] if self._tensor_scale is None else ["_tensor_scale"])
        return inner, (self._block, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        block, dtype = meta
        tensor_scale = inner_tensors.get("_tensor_scale")
        return BlockScaledTensor(inner_tensors["_data"], inner_tensors["_d"], block, dtype, tensor_scale)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        src = args[0] if args else None
        if isinstance(src, BlockScaledTensor):
            whole = func in _WHOLE_VIEW_OPS and list(args[1]) == list(src.shape) and not kwargs.get("storage_offset")
            if func in _KEEP_OPS or whole:
                return BlockScaledTensor(src._data.detach(), src._d, src._block, src.dtype, src._tensor_scale)
        if func._schema.is_mutable:
            raise NotImplementedError(
                f"fp8lm: a BlockScaledTensor (a weight gathered by FSDP2 in a fine-grained recipe's blocks) "
                f"is read-only, {func} writes it; write the sharded parameter instead"
            )
        args, kwargs = tree_map(
            lambda t: t.dequantize(t.dtype) if isinstance(t, BlockScaledTensor) else t, (args, kwargs)
        )
        return func(*args, **kwargs)


def gathered_operand(weight: torch.Tensor) -> BlockOperand | None:
    """``weight``'s forward GEMM operand where FSDP2 gathered it in its recipe's blocks (a
    `BlockScaledTensor`), else None. A function of the inner tensors, not a property: torch.compile
    traces it into the graph, where it would take a property's new tensors for inputs of their own."""
    if not isinstance(weight, BlockScaledTensor):
        return None
    payload = weight._data
    if payload.dtype == torch.uint8:  # packed nvfp4
        payload = nvfp4.unpack_e2m1_as_e4m3(payload)
    return BlockOperand(payload, decoded_scales(weight._d, weight._tensor_scale), weight._block, weight._tensor_scale)


def shards_whole_blocks(recipe: Recipe, shape: tuple[int, ...] | torch.Size, ranks: int) -> bool:
    """Whether FSDP2's shards of a weight of ``shape`` over ``ranks`` hold whole blocks of the
    recipe's forward weight operand: dim 0 divisible by ``ranks``, each shard's rows a multiple
    of the block's."""
    rows = shape[0]
    if len(shape) != 2 or rows % ranks:
        return False
    block_rows = operand_block(recipe, "weight", (rows, shape[1]), 1)[0]
    return (rows // ranks) % block_rows == 0 or ranks == 1


def gather_inputs(
    values: torch.Tensor, recipe: Recipe, group: dist.ProcessGroup | None, tensor_amax: torch.Tensor | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple]:
    """What this rank sends for a weight whose shard (a whole number of blocks) has ``values``
    (float32): its rows as the recipe's forward weight operand, the payload as bytes (no
    backend carries float8) and the scales of its blocks; and the metadata that `gathered`
    reads. nvfp4: the per-tensor amax of the whole weight, ``tensor_amax`` where it was agreed
    already (`fp8lm.distributed.precompute_fp8_scales`), else agreed over ``group`` here; the
    elements (for an even in_features) travel packed with their E4M3 block scale bytes."""
    if recipe.granularity == "nvfp4" and tensor_amax is None:
        tensor_amax = values.abs().amax().to(torch.float32).reshape(1)
        dist.all_reduce(tensor_amax, dist.ReduceOp.MAX, group=group)
        tensor_amax = tensor_amax.reshape(())
    elif recipe.granularity != "nvfp4":
        tensor_amax = None
    op = quantize_operand(values, recipe, "weight", dim=1, tensor_amax=tensor_amax)
    if op.tensor_scale is not None and values.shape[1] % 2 == 0:  # as a layer saves it
        packed, stored, tensor_scale = pack_nvfp4_operand(op)
        metadata = (GATHER_TAG, torch.uint8, op.block, torch.float8_e4m3fn, tensor_scale)
        return (packed, stored.contiguous().view(torch.uint8)), metadata
    scale_dtype = torch.float8_e8m0fnu if pow2_scales(recipe) else torch.float32
    scales = op.d.to(scale_dtype).view(torch.uint8) if scale_dtype != torch.float32 else op.d.contiguous()
    return (op.payload.view(torch.uint8), scales), (
        GATHER_TAG,
        op.payload.dtype,
        op.block,
        scale_dtype,
        op.tensor_scale,
    )


def pow2_scales(recipe: Recipe) -> bool:
    """Whether the recipe's weight scales are powers of two (rowwise, mxfp8, blockwise with
    ``pow2_scales``): they travel as E8M0 bytes (exact: exponents in [-127, 127], NaN as 255)."""
    return recipe.granularity in ("rowwise", "mxfp8") or (recipe.granularity == "blockwise" and recipe.pow2_scales)


def decoded_scales(d: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 scales of a `BlockScaledTensor`'s ``d`` (`BlockScaledTensor.held`): float32 as
    it is, E8M0 codes (uint8) decoded, or nvfp4's E4M3 block scales times its tensor scale, as
    `fp8lm.ops.nvfp4.block_scales` computes them."""
    if d.dtype == torch.uint8:
        return e8m0_values(d)
    if d.dtype == torch.float8_e4m3fn and tensor_scale is not None:
        return nvfp4.decoded_block_scales(d, tensor_scale)
    return d.to(torch.float32)


def gathered(
    outputs: tuple[torch.Tensor, ...], metadata: tuple, dtype: torch.dtype
) -> tuple[BlockScaledTensor, tuple[torch.Tensor, torch.Tensor]]:
    """The gathered weight (a `BlockScaledTensor` presenting ``dtype``) from FSDP2's all-gather
    outputs of `gather_inputs`, and its inner tensors (which later all-gathers refill: then
    `refresh` it)."""
    wire, scales = outputs
    _, payload_dtype, block, scale_dtype, tensor_scale = metadata
    payload = wire.view(payload_dtype)
    # the scale bytes as gathered (E8M0 codes as uint8), decoded for each use: FSDP2 frees both
    # buffers after the forward
    d = scales if scale_dtype == torch.float8_e8m0fnu else scales.view(scale_dtype)
    return BlockScaledTensor(payload, d, block, dtype, tensor_scale), (payload, scales)


def refresh(out: torch.Tensor, outputs: tuple[torch.Tensor, ...], metadata: tuple) -> None:
    """After a later all-gather refilled the inner tensors of ``out`` (a `gathered` weight, whose
    payload and scales are views of them): its nvfp4 tensor scale, this gather's."""
    tensor_scale = metadata[4]
    if not isinstance(out, BlockScaledTensor):
        return
    if tensor_scale is not None:
        assert out._tensor_scale is not None  # gathered with one
        refill(out._tensor_scale, tensor_scale)


def refill(stored: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a later all-gather's ``value`` into a gathered weight's ``stored`` scale, keeping its
    version counter, as FSDP2 refills its own buffers: the backward's gather brings the value the
    forward used, and a forward that saved it (the input-gradient GEMM saves a gathered operand;
    torch.compile's partitioner may save a scale) must not see a change."""
    with torch.autograd._unsafe_preserve_version_counter(stored):
        stored.copy_(value)
