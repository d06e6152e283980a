"""E4M3 weights with the scales of the recipe a model computed with, in ``compressed-tensors``'
formats.

Each exported weight is the E4M3 operand of the model's forward GEMM, bit for bit: its payload
and its scales as the recipe quantizes the weight (`fp8lm.ops.finegrained.quantize_operand`,
along ``in_features``), stored as ``compressed-tensors`` reads them back
(``value = weight * weight_scale``):

| recipe granularity | strategy | ``weight_scale`` of an (out, in) weight | format |
|---|---|---|---|
| tensorwise | ``tensor`` | (1,) float32, a power of two (`fp8lm.scaling.compute_scale`) | float-quantized |
| rowwise | ``channel`` | (out, 1) float32, powers of two | float-quantized |
| blockwise | ``block``, ``block_structure`` [b, b] | (ceil(out / b), ceil(in / b)) float32 | float-quantized |
| mxfp8 | ``group``, ``group_size`` 32 | (out, in / 32) uint8 E8M0 codes | mxfp8-quantized |

nvfp4 has no exact ``compressed-tensors`` equivalent (`weight_scheme` refuses it). A GPT-2
``Conv1D`` stores its weight as (in, out): its payload and scales are written transposed
(per-channel scales (1, out)), which ``compressed-tensors``' dequantization reads the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..formats import E4M3
from ..ops.block_scales import e8m0_codes, exp2i
from ..ops.cast import saturating_cast
from ..ops.finegrained import quantize_operand
from ..recipe import Recipe
from ..scaling import compute_scale
from .folder import ExportError

__all__ = [
    "WeightScheme",
    "weight_scheme",
    "quantize_weight",
    "quantize_weights",
    "dequantize_weight",
    "quantization_config",
    "activation_args",
]

# compressed-tensors' strategy of each recipe granularity it can hold exactly
_STRATEGIES = {"tensorwise": "tensor", "rowwise": "channel", "blockwise": "block", "mxfp8": "group"}


@dataclass(frozen=True)
class WeightScheme:
    """How a recipe's weight operands are stored: the ``compressed-tensors`` ``strategy``
    (``"tensor"``, ``"channel"``, ``"block"``, ``"group"``), the block edge (block) or group
    length (group), and the format."""

    strategy: str = "tensor"
    block: int | None = None

    @property
    def format(self) -> str:
        return "mxfp8-quantized" if self.strategy == "group" else "float-quantized"

    @property
    def scale_block(self) -> tuple[int, int] | None:
        """The (rows, cols) of the weight that one scale covers, where it is not a whole row or tensor."""
        if self.block is None:
            return None
        return (self.block, self.block) if self.strategy == "block" else (1, self.block)

    def weights_args(self) -> dict:
        """The ``weights`` entry of a ``compressed-tensors`` config group."""
        args: dict[str, object] = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": self.strategy,
            "dynamic": False,
        }
        if self.strategy == "block":
            args["block_structure"] = [self.block, self.block]
        if self.strategy == "group":
            args |= {"group_size": self.block, "scale_dtype": "torch.uint8"}
        return args

    def describe(self) -> str:
        return {
            "tensor": "one scale per tensor",
            "channel": "one scale per output channel",
            "block": f"one scale per {self.block} x {self.block} block",
            "group": f"one E8M0 scale per {self.block} weights along the input (MXFP8)",
        }[self.strategy]


def weight_scheme(recipe: Recipe | None) -> WeightScheme:
    """The `WeightScheme` that holds ``recipe``'s weight operands exactly (None: tensorwise);
    one `ExportError` line for a recipe no ``compressed-tensors`` format holds."""
    if recipe is None:
        return WeightScheme()
    label = f"recipe {recipe.name}" if recipe.name else f"a custom {recipe.granularity} recipe"
    if recipe.granularity == "nvfp4":
        raise ExportError(
            f"{label} computes with E2M1 weights times float32 scales (an E4M3 block scale times the tensor's "
            "1 / s_enc), which compressed-tensors' nvfp4-pack-quantized reads back in BF16 with the tensor scale "
            "divided: not the weights the model used; export with format 'hf', or train with rowwise, blockwise "
            "or mxfp8"
        )
    if recipe.weight_format != E4M3:
        raise ExportError(
            f"{label} has {recipe.weight_format.name} weight operands and compressed-tensors' FP8 weights are "
            "E4M3: export with format 'hf'"
        )
    block = None if recipe.granularity in ("tensorwise", "rowwise") else recipe.block
    return WeightScheme(_STRATEGIES[recipe.granularity], block)


def quantize_weight(
    weight: torch.Tensor, recipe: Recipe | None = None, *, transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3, weight_scale)``: ``weight`` (out, in; (in, out) when ``transposed``, a GPT-2
    ``Conv1D``'s) as ``recipe``'s weight operand (None: tensorwise, one power-of-two scale),
    in the layout of `weight_scheme` (see the module doc)."""
    return quantize_weights([weight], recipe, transposed=transposed)[0]


def quantize_weights(
    weights: Sequence[torch.Tensor], recipe: Recipe | None = None, *, transposed: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`quantize_weight` of the parts of one GEMM operand, stacked along the output rows (a layer
    the model computes as one, such as fused k and v projections, exported as several): each
    part's payload and scales are its share of the whole operand's. An `ExportError` where a
    part's own scale layout cannot hold its share (blocks that straddle two parts)."""
    scheme = weight_scheme(recipe)
    rows = [w.detach().float().t() if transposed else w.detach().float() for w in weights]
    whole = rows[0] if len(rows) == 1 else torch.cat(rows)
    _check_layout(scheme, tuple(whole.shape), transposed)
    payload, d = _operand(whole, recipe, scheme)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = 0
    for part in rows:
        n = part.shape[0]
        p, s = payload[start : start + n], _part_scale(d, scheme, start, n)
        if scheme.strategy == "group":
            s = e8m0_codes(s)
        if transposed:
            p, s = p.t(), (s if scheme.strategy == "tensor" else s.t())
        parts.append((p.clone(memory_format=torch.contiguous_format), s.clone(memory_format=torch.contiguous_format)))
        start += n
    return parts


def _check_layout(scheme: WeightScheme, shape: tuple[int, ...], transposed: bool) -> None:
    """Refuse an MXFP8 weight ``compressed-tensors``' group format cannot hold."""
    if scheme.strategy != "group":
        return
    if transposed:
        raise ExportError(
            "mxfp8's 1 x 32 weight blocks run along the input dimension, which compressed-tensors' group format "
            "cannot express for GPT-2's transposed Conv1D weights: export with format 'hf' or train --arch llama"
        )
    if shape[1] % (scheme.block or 1):
        raise ExportError(
            f"mxfp8 weights of {shape[1]} input features end in a partial block of {scheme.block}, which "
            "compressed-tensors' group format cannot hold: export with format 'hf'"
        )


def _operand(value: torch.Tensor, recipe: Recipe | None, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 payload of ``value`` (out, in) and its float32 dequantization factors."""
    if scheme.strategy == "tensor":
        scale = compute_scale(value.abs().amax(), E4M3)
        return saturating_cast(value, scale, E4M3), scale.reciprocal().reshape(1)
    assert recipe is not None
    operand = quantize_operand(value, recipe, "weight", dim=1)
    return operand.payload, operand.d


def _part_scale(d: torch.Tensor, scheme: WeightScheme, start: int, n: int) -> torch.Tensor:
    """The scales of rows [start, start + n) of an operand with scales ``d``."""
    if scheme.strategy == "tensor":
        return d
    if scheme.strategy != "block":
        return d[start : start + n]
    b = scheme.block
    assert b is not None
    if start % b and start // b != (start + n - 1) // b:
        raise ExportError(
            f"blockwise's {b} x {b} weight blocks straddle the split of a fused layer at row {start} (parts of "
            f"{n} rows); compressed-tensors' blocks start at each part's first row: export with format 'hf'"
        )
    return d[start // b : (start + n - 1) // b + 1]


def dequantize_weight(
    e4m3: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The values ``e4m3 * weight_scale`` stand for, multiplied in float32 as ``compressed-tensors``
    does for float32 scales. ``block``: the (rows, cols) each scale covers (block and group
    strategies, `WeightScheme.scale_block`; the last ones may be partial); else the scale
    broadcasts (tensor, channel). uint8 scales are E8M0 codes."""
    scale = weight_scale
    if scale.dtype == torch.uint8:
        scale = exp2i(scale.to(torch.int32) - 127)
    scale = scale.float()
    if block is not None:
        rows, cols = e4m3.shape
        scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (e4m3.float() * scale).to(dtype)


def activation_args(recipe: Recipe | None) -> dict:
    """The ``input_activations`` entry of a ``compressed-tensors`` config group that quantizes the
    linear layers' inputs to E4M3 in the blocks ``recipe``'s forward GEMM reads them in, with
    scales computed from each batch at serving time (``dynamic``): one per tensor (tensorwise;
    the delayed recipe's amax history is the training run's, not the server's), per token
    (rowwise), per 1 x 128 group of a token (blockwise). One `ExportError` line for a recipe whose
    inputs no ``compressed-tensors`` activation scheme holds."""
    granularity = "tensorwise" if recipe is None else recipe.granularity
    label = "the recipe" if recipe is None else f"recipe {recipe.name or 'custom'}"
    if recipe is not None and recipe.input_format != E4M3:
        raise ExportError(f"{label} has {recipe.input_format.name} inputs: export with --input-activations bf16")
    args: dict[str, object] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
    if granularity == "tensorwise":
        return args | {"strategy": "tensor"}
    if granularity == "rowwise":
        return args | {"strategy": "token"}
    if granularity == "blockwise":
        assert recipe is not None
        return args | {"strategy": "group", "group_size": recipe.block}
    raise ExportError(
        f"{label} quantizes inputs in {granularity} blocks, which compressed-tensors' FP8 activations do not "
        "hold here: export with --input-activations bf16 (E4M3 weights, BF16 inputs)"
    )


def quantization_config(
    ignore: list[str], dequantize: bool, scheme: WeightScheme | None = None, input_activations: dict | None = None
) -> dict:
    """The ``quantization_config`` entry of ``config.json``: FP8 (E4M3) weights of the linear layers,
    static scales as ``scheme`` lays them out (default: per tensor), activations unquantized or as
    ``input_activations`` (`activation_args`); ``ignore``: module names kept in BF16.
    ``dequantize``: transformers reads the weights back into BF16 at load time, needed where the
    model's linear layers are GPT-2 ``Conv1D`` modules, which compressed-tensors' runtime does not
    quantize (serving engines such as vLLM build their own linear layers and ignore the flag)."""
    scheme = scheme or WeightScheme()
    config: dict[str, object] = {
        "quant_method": "compressed-tensors",
        "format": scheme.format,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": scheme.weights_args(),
                "input_activations": input_activations,
            }
        },
        "ignore": ignore,
    }
    if dequantize:
        config["dequantize"] = True
    return config
