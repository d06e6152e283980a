"""`Recipe`: how an FP8 layer scales and multiplies, as one frozen, hashable value.

A recipe holds the formats of the three GEMM operands (input, weight, output gradient), the
scaling of the input and output-gradient streams (``"delayed"``: from an amax history of
``history_len`` steps; ``"current"``: from each tensor's own amax), the margin of the scale, and
the GEMM backend. Being frozen, a layer's recipe can be shared, compared and used as a key; being
hashable, ``torch.compile`` treats it as a constant. Named recipes (`RECIPES`) are the supported
combinations.

``granularity`` says how many scales an operand has. ``"tensorwise"``: one per tensor (delayed or
current scaling). The fine-grained ones scale each block from its own amax (current scaling; an
amax history does not apply): ``"rowwise"`` (a power-of-two scale per row along the GEMM's
reduction dimension), ``"blockwise"`` (1 x ``block`` tiles of inputs and output gradients,
``block`` x ``block`` blocks of weights, FP32 scales ``amax / 448``), ``"mxfp8"`` (OCP MX v1.0:
1 x ``block`` blocks, E8M0 scales) and ``"nvfp4"`` (E2M1 elements, an E4M3 scale per 1 x ``block``
or ``block`` x ``block`` weight block and an FP32 scale per tensor). The numerics are in
`fp8lm.ops.finegrained`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .formats import E4M3, E5M2, Format, format_of

__all__ = [
    "Recipe",
    "RECIPES",
    "DEFAULT_RECIPE",
    "SCALING_MODES",
    "BACKENDS",
    "GRANULARITIES",
    "MX_ROUNDINGS",
    "NVFP4_SCALE_RULES",
    "WEIGHT_GRAD_GEMMS",
    "recipe_from",
]

SCALING_MODES = ("delayed", "current")
BACKENDS = ("auto", "scaled_mm", "emulated")  # see fp8lm.ops.gemm
DEFAULT_RECIPE = "tensorwise-delayed"
GRANULARITIES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4")
# The block size of each granularity that has one (None: the whole tensor or row).
DEFAULT_BLOCKS: dict[str, int | None] = {
    "tensorwise": None,
    "rowwise": None,
    "blockwise": 128,
    "mxfp8": 32,
    "nvfp4": 16,
}
MX_ROUNDINGS = ("floor", "rceil")
NVFP4_SCALE_RULES = ("max6", "4over6")  # fp8lm.ops.nvfp4's block scales
WEIGHT_GRAD_GEMMS = ("fp8", "bf16")


@dataclass(frozen=True)
class Recipe:
    """FP8 settings of a layer. The default is the named recipe ``"tensorwise-delayed"``.

    Fields: ``input_format`` (E4M3), ``weight_format`` (E4M3; the weight's GEMM operand, not its
    storage), ``grad_output_format`` (E5M2), ``scaling`` (``"delayed"`` or ``"current"``),
    ``history_len`` (amax history of delayed scaling, >= 1), ``margin`` (scales are lowered by
    ``2**margin``), ``backend`` (``"auto"``, ``"scaled_mm"``, ``"emulated"``).

    Fine-grained scaling (see the module doc): ``granularity``, ``block`` (its block size; None
    takes the granularity's: 128, 32, 16), ``pow2_scales`` (blockwise: power-of-two block scales),
    ``mx_rounding`` (mxfp8: ``"floor"``, the OCP scale, or ``"rceil"``, cuBLAS's round-up),
    ``weight_grad_gemm`` (``"bf16"`` keeps the weight-gradient GEMM in BF16),
    ``hadamard_seed`` (nvfp4: the signs of the random Hadamard transform) and
    ``nvfp4_scale_rule`` (nvfp4: ``"max6"``, each block's amax to E2M1's 6 as NVIDIA's recipe, or
    ``"4over6"``, Four Over Six: each block to 6 or to 4, whichever rounds it closer).
    """

    input_format: Format = E4M3
    weight_format: Format = E4M3
    grad_output_format: Format = E5M2
    scaling: str = "delayed"
    history_len: int = 16
    margin: int = 0
    backend: str = "auto"
    granularity: str = "tensorwise"
    block: int | None = None
    pow2_scales: bool = False
    mx_rounding: str = "floor"
    weight_grad_gemm: str = "fp8"
    hadamard_seed: int = 0
    nvfp4_scale_rule: str = "max6"

    def __post_init__(self) -> None:
        for name in ("input_format", "weight_format", "grad_output_format"):
            fmt = format_of(getattr(self, name))
            if not fmt.is_fp8:
                raise ValueError(f"Recipe {name} must be an FP8 format (E4M3 or E5M2), got {fmt.name}")
            object.__setattr__(self, name, fmt)  # a name like "e4m3" becomes the Format
        if self.scaling not in SCALING_MODES:
            raise ValueError(f"unknown scaling {self.scaling!r}: use one of {', '.join(SCALING_MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown FP8 GEMM backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(
                f"history_len must be an int >= 1 (use scaling='current' for none), got {self.history_len!r}"
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        self._check_granularity()

    @property
    def fine_grained(self) -> bool:
        """Whether operands have more than one scale (any granularity but ``"tensorwise"``)."""
        return self.granularity != "tensorwise"

    def _check_granularity(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {self.granularity!r}: use one of {', '.join(GRANULARITIES)}")
        self._check_block()
        for field, value, choices in (
            ("mx_rounding", self.mx_rounding, MX_ROUNDINGS),
            ("weight_grad_gemm", self.weight_grad_gemm, WEIGHT_GRAD_GEMMS),
            ("nvfp4_scale_rule", self.nvfp4_scale_rule, NVFP4_SCALE_RULES),
        ):
            if value not in choices:
                raise ValueError(f"unknown {field} {value!r}: use one of {', '.join(choices)}")
        if self.mx_rounding != "floor" and self.granularity != "mxfp8":
            raise ValueError("mx_rounding applies to granularity='mxfp8' only")
        if self.nvfp4_scale_rule != "max6" and self.granularity != "nvfp4":
            raise ValueError("nvfp4_scale_rule applies to granularity='nvfp4' only")
        if isinstance(self.hadamard_seed, bool) or not isinstance(self.hadamard_seed, int):
            raise ValueError(f"hadamard_seed must be an int, got {self.hadamard_seed!r}")
        if self.pow2_scales and self.granularity != "blockwise":
            raise ValueError(
                "pow2_scales applies to granularity='blockwise' (rowwise and mxfp8 scales are powers of two)"
            )
        if not self.fine_grained:
            if self.weight_grad_gemm != "fp8":
                raise ValueError("weight_grad_gemm='bf16' applies to the fine-grained granularities only")
            return
        if self.scaling != "current" or self.margin:
            raise ValueError(
                f"granularity {self.granularity!r} scales each block from its own amax: use scaling='current' and "
                f"margin=0 (or Recipe.from_name({self.granularity!r}))"
            )
        if self.granularity == "nvfp4" and E5M2 in (self.input_format, self.weight_format, self.grad_output_format):
            raise ValueError("granularity 'nvfp4' has E2M1 elements with E4M3 block scales: keep the formats E4M3")

    def _check_block(self) -> None:
        default = DEFAULT_BLOCKS[self.granularity]
        if self.block is None:
            object.__setattr__(self, "block", default)
        elif default is None:
            raise ValueError(f"granularity {self.granularity!r} has no block size: leave block=None")
        elif isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be an int >= 1, got {self.block!r}")

    @classmethod
    def from_name(cls, name: str) -> Recipe:
        """The named recipe (see `RECIPES`)."""
        if name not in RECIPES:
            raise ValueError(f"unknown recipe {name!r}: use one of {', '.join(RECIPES)}")
        return RECIPES[name]

    @property
    def name(self) -> str | None:
        """The name of this recipe in `RECIPES`, or None for a custom one."""
        return next((key for key, recipe in RECIPES.items() if recipe == self), None)

    @property
    def steps(self) -> int:
        """Amax history length of the scaled streams: ``history_len``, 0 for current scaling."""
        return self.history_len if self.scaling == "delayed" else 0

    def replace(self, **changes) -> Recipe:
        """A copy with ``changes`` applied (validated like a new recipe)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """This recipe as plain values (formats by name), for JSON and checkpoints: `from_dict`
        builds it back."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> Recipe:
        """The recipe `to_dict` wrote (validated like a new one; a missing field takes its default)."""
        if not isinstance(values, dict):
            raise ValueError(f"a recipe is a dict of Recipe fields, got {type(values).__name__}")
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown Recipe field(s) {unknown}: use {', '.join(f.name for f in fields(cls))}")
        return cls(**values)


def _plain(value):
    return value.name if isinstance(value, Format) else value


def _fine(granularity: str, weight_grad_gemm: str = "fp8") -> Recipe:
    """A named fine-grained recipe: current scaling, E4M3 for all three operands."""
    return Recipe(
        grad_output_format=E4M3, scaling="current", granularity=granularity, weight_grad_gemm=weight_grad_gemm
    )


RECIPES: dict[str, Recipe] = {
    DEFAULT_RECIPE: Recipe(),
    "tensorwise-current": Recipe(scaling="current"),
    "rowwise": _fine("rowwise"),
    "rowwise-wgrad-bf16": _fine("rowwise", weight_grad_gemm="bf16"),
    "blockwise": _fine("blockwise"),
    "mxfp8": _fine("mxfp8"),
    "nvfp4": _fine("nvfp4"),
    "nvfp4-4over6": _fine("nvfp4").replace(nvfp4_scale_rule="4over6"),
}


def recipe_from(recipe: Recipe | str | None, where: str) -> Recipe:
    """The recipe a layer or `initialize` runs with: ``recipe`` (a `Recipe`, a name, or None for the
    default)."""
    if isinstance(recipe, str):
        return Recipe.from_name(recipe)
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{where}: recipe must be an fp8lm.Recipe or a recipe name, got {type(recipe).__name__}")
    return recipe if recipe is not None else RECIPES[DEFAULT_RECIPE]
