"""`Recipe`: how an FP8 layer scales and multiplies, as one frozen, hashable value.

A recipe holds the formats of the three GEMM operands (input, weight, output gradient), the
scaling of the input and output-gradient streams (``"delayed"``: from an amax history of
``history_len`` steps; ``"current"``: from each tensor's own amax), the margin of the scale, and
the GEMM backend. Being frozen, a layer's recipe can be shared, compared and used as a key; being
hashable, ``torch.compile`` treats it as a constant. Named recipes (`RECIPES`) are the supported
combinations; later ones (row-wise, blocks) are new names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .formats import E4M3, E5M2, Format, format_of

__all__ = ["Recipe", "RECIPES", "DEFAULT_RECIPE", "SCALING_MODES", "BACKENDS", "recipe_from"]

SCALING_MODES = ("delayed", "current")
BACKENDS = ("auto", "scaled_mm", "emulated")  # see fp8lm.ops.gemm
DEFAULT_RECIPE = "tensorwise-delayed"


@dataclass(frozen=True)
class Recipe:
    """FP8 settings of a layer. The default is the named recipe ``"tensorwise-delayed"``.

    Fields: ``input_format`` (E4M3), ``weight_format`` (E4M3; the weight's GEMM operand, not its
    storage), ``grad_output_format`` (E5M2), ``scaling`` (``"delayed"`` or ``"current"``),
    ``history_len`` (amax history of delayed scaling, >= 1), ``margin`` (scales are lowered by
    ``2**margin``), ``backend`` (``"auto"``, ``"scaled_mm"``, ``"emulated"``).
    """

    input_format: Format = E4M3
    weight_format: Format = E4M3
    grad_output_format: Format = E5M2
    scaling: str = "delayed"
    history_len: int = 16
    margin: int = 0
    backend: str = "auto"

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


RECIPES: dict[str, Recipe] = {
    DEFAULT_RECIPE: Recipe(),
    "tensorwise-current": Recipe(scaling="current"),
}


def recipe_from(recipe: Recipe | str | None, where: str) -> Recipe:
    """The recipe a layer or `initialize` runs with: ``recipe`` (a `Recipe`, a name, or None for the
    default)."""
    if isinstance(recipe, str):
        return Recipe.from_name(recipe)
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{where}: recipe must be an fp8lm.Recipe or a recipe name, got {type(recipe).__name__}")
    return recipe if recipe is not None else RECIPES[DEFAULT_RECIPE]
