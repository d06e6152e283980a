"""Precision policy: the storage format of every parameter's weight, gradient, master copy and
Adam moments, and which layers run their GEMMs in FP8.

Presets follow FP8-LM's levels (``preset("O1")`` ... ``preset("O3")``):

=====  ==================  ========================  ===========================  ==============
level  GEMMs               linear weight / grad      other >= 2-D params          Adam m / v
=====  ==================  ========================  ===========================  ==============
O1     FP8                 FP32 / E4M3               FP32 / FP32                  FP32 / FP32
O2     FP8                 FP16 (scaled) / E4M3      FP16 (scaled) / E4M3         E4M3 / FP16
O3     FP8                 E4M3 / E4M3, FP16 master  E4M3 / E4M3, FP16 master     E4M3 / FP16
=====  ==================  ========================  ===========================  ==============

1-D parameters (biases, norm gains: a small share of a model) stay FP32 with FP32 gradients at
every level; under O2/O3 their Adam moments follow the optimizer's formats. A scaled FP16 weight
is its own master copy (the optimizer updates its payload and scale in place). O1 keeps FP32
weights: stored as scaled FP16 they cost loss over long runs (docs/training.md);
``preset("O1").with_linear(weight=FP16)`` stores them so.

The output head (the model's last linear layer, which `fp8lm.initialize` finds) runs its GEMMs in
BF16 and stores its weight gradient in BF16 at every level (``Policy.output_head``); its weight
and optimizer states keep the level's formats. Its FP8 GEMMs bias the gradient of the final norm
so that its gain and bias grow over training, and per-tensor E4M3 zeroes the gradient rows of rare
tokens (both measured in docs/training.md). ``preset(level, output_head=False)`` or
``policy.without_output_head()`` drops the rule.

Saved activations (``Policy.activations``): ``"fp8"`` (O2's default) stores the norms' and
activation functions' inputs in E4M3 with per-row group scales (`fp8lm.nn.saved`, which lists
what stays in high precision); ``"bf16"`` (O1's and O3's default) leaves what autograd saves
outside the FP8 linear layers as the model computes it (BF16 or FP32):
``preset("O2").with_activations("bf16")`` or ``fp8lm.initialize(..., activations="bf16")``. O2's
default follows its 5-seed loss comparison (docs/measurements/activations.md); O1 and O3 were not
measured with it. The linear layers' inputs are saved in FP8 at
every level.

Overrides by module-name pattern (``fnmatch``; matched against module and parameter names, later
overrides win, also over the output-head rule) change any of it, e.g. put the output head's GEMMs
back in FP8, keep it entirely in high precision, or keep the MLPs' saved activations as computed::

    policy = fp8lm.policy.preset("O2").override("lm_head", fp8_gemm=True)
    policy = fp8lm.policy.preset("O2").override("lm_head", weight=fp8lm.FP32, grad=fp8lm.FP32)
    policy = fp8lm.policy.preset("O2").override("*.mlp.*", activations="bf16")
    model, opt = fp8lm.initialize(model, opt, "O2", policy=policy)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from fnmatch import fnmatchcase
from typing import Any

import torch

from .formats import BF16, E4M3, FP16, FP32, Format, format_of

__all__ = ["ParamPrecision", "Override", "Policy", "preset", "resolve_policy", "FP8_LEVELS", "ACTIVATIONS"]

# The FP8-LM optimization levels: the opt_level values of fp8lm.initialize.
FP8_LEVELS = ("O1", "O2", "O3")
# How activations saved for backward outside the linear layers are stored (Policy.activations).
ACTIVATIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class ParamPrecision:
    """Storage formats for one parameter. ``weight`` FP32 means a plain parameter (of the model's
    dtype); ``master`` None means the weight itself is the master copy."""

    weight: Format
    grad: Format
    master: Format | None
    exp_avg: Format
    exp_avg_sq: Format

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None or f.name != "master":
                object.__setattr__(self, f.name, format_of(value))

    @property
    def scaled_weight(self) -> bool:
        """Whether the weight is stored as a ScalingTensor (a low-precision payload with a scale)."""
        return self.weight != FP32

    @property
    def scaled_grad(self) -> bool:
        return self.grad != FP32


_PRECISION_FIELDS = tuple(f.name for f in fields(ParamPrecision))


def _parse_formats(formats: dict, also: str) -> tuple[tuple[str, Format | None], ...]:
    """``formats`` (`ParamPrecision` field -> format or name) as formats; a master may be None."""
    unknown = sorted(set(formats) - set(_PRECISION_FIELDS))
    if unknown:
        raise ValueError(f"unknown precision field(s) {unknown}: use {', '.join(_PRECISION_FIELDS)} {also}".rstrip())
    return tuple((k, None if (k == "master" and v is None) else format_of(v)) for k, v in formats.items())


@dataclass(frozen=True)
class Override:
    """Changes for the modules / parameters whose name matches ``pattern``."""

    pattern: str
    fp8_gemm: bool | None = None
    formats: tuple[tuple[str, Format | None], ...] = ()
    activations: str | None = None  # how the matching modules save activations (`Policy.activations`)

    def matches(self, name: str) -> bool:
        return fnmatchcase(name, self.pattern)


@dataclass(frozen=True)
class Policy:
    """Per-parameter formats and per-layer GEMM precision; see the module docstring."""

    opt_level: str
    linear: ParamPrecision
    matrix: ParamPrecision
    vector: ParamPrecision
    fp8_gemm: bool = True
    overrides: tuple[Override, ...] = ()
    output_head: Override | None = None  # changes for the output head, before the overrides by name
    activations: str = "bf16"  # saved activations outside the linear layers: "bf16" (as computed) or "fp8"

    def override(
        self, pattern: str, *, fp8_gemm: bool | None = None, activations: str | None = None, **formats
    ) -> Policy:
        """A copy of this policy with ``pattern`` overridden; ``formats`` are `ParamPrecision`
        fields (``weight``, ``grad``, ``master``, ``exp_avg``, ``exp_avg_sq``); ``activations``
        (``"bf16"`` or ``"fp8"``) says how the matching norm, activation-function and attention
        modules save their inputs (`Policy.activations` for the rest)."""
        override = _checked_override(pattern, fp8_gemm, formats, activations, "or fp8_gemm, activations")
        return replace(self, overrides=self.overrides + (override,))

    def with_linear(self, **formats) -> Policy:
        """A copy of this policy whose converted linear layers' parameters default to ``formats``
        (`ParamPrecision` fields), before any override; e.g. O1 with scaled FP16 weights, as O2
        stores them: ``preset("O1").with_linear(weight=fp8lm.FP16)``."""
        changes: dict[str, Any] = dict(_parse_formats(formats, ""))  # master may be None
        return replace(self, linear=replace(self.linear, **changes))

    def with_activations(self, activations: str) -> Policy:
        """A copy of this policy that saves activations outside the linear layers as
        ``activations`` says: ``"bf16"`` (as the model computes them) or ``"fp8"`` (module docstring)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"unknown activations {activations!r}: use one of {', '.join(ACTIVATIONS)}")
        return replace(self, activations=activations)

    def without_output_head(self) -> Policy:
        """A copy of this policy without the output-head rule (the head like every linear layer)."""
        return replace(self, output_head=None)

    def _matching(self, *names: str, output_head: bool = False) -> list[Override]:
        head = [self.output_head] if output_head and self.output_head is not None else []
        return head + [o for o in self.overrides if any(o.matches(n) for n in names)]

    def gemm_in_fp8(self, module_name: str, output_head: bool = False) -> bool:
        """Whether the linear layer ``module_name`` runs its GEMMs in FP8; ``output_head``: it is
        the model's output head."""
        fp8 = self.fp8_gemm
        for o in self._matching(module_name, output_head=output_head):
            if o.fp8_gemm is not None:
                fp8 = o.fp8_gemm
        return fp8

    def saved_activations(self, module_name: str) -> str:
        """How module ``module_name`` (a norm, activation function or attention) saves its inputs
        for backward: ``"fp8"`` or ``"bf16"`` (`Policy.activations`, then the overrides)."""
        saved = self.activations
        for o in self._matching(module_name):
            if o.activations is not None:
                saved = o.activations
        return saved

    def precision(
        self, param_name: str, param: torch.Tensor, in_linear: bool, output_head: bool = False
    ) -> ParamPrecision:
        """Formats for parameter ``param_name`` (``"<module>.<attr>"``); ``in_linear``: it is the
        weight of a converted linear layer; ``output_head``: of the model's output head."""
        if in_linear:
            base = self.linear
        else:
            base = self.matrix if param.dim() >= 2 else self.vector
        module_name = param_name.rpartition(".")[0]
        for o in self._matching(module_name, param_name, output_head=output_head):
            changes: dict[str, Any] = dict(o.formats)  # master may be None, the other fields are formats
            base = replace(base, **changes)
        return base

    def to_dict(self) -> dict:
        """This policy as plain values (formats by name), for JSON and checkpoints: `from_dict`
        builds it back."""
        return {
            "opt_level": self.opt_level,
            "linear": _precision_dict(self.linear),
            "matrix": _precision_dict(self.matrix),
            "vector": _precision_dict(self.vector),
            "fp8_gemm": self.fp8_gemm,
            "overrides": [_override_dict(o) for o in self.overrides],
            "output_head": None if self.output_head is None else _override_dict(self.output_head),
            "activations": self.activations,
        }

    @classmethod
    def from_dict(cls, values: dict) -> Policy:
        """The policy `to_dict` wrote (formats and settings validated as `override` does)."""
        try:
            head = values["output_head"]
            policy = cls(
                opt_level=values["opt_level"],
                linear=_precision_from(values["linear"]),
                matrix=_precision_from(values["matrix"]),
                vector=_precision_from(values["vector"]),
                fp8_gemm=values["fp8_gemm"],
                overrides=tuple(_override_from(o) for o in values["overrides"]),
                output_head=None if head is None else _override_from(head),
                activations=values["activations"],
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a policy as Policy.to_dict writes it ({type(e).__name__}: {e})") from None
        if policy.opt_level not in FP8_LEVELS or policy.activations not in ACTIVATIONS:
            raise ValueError(f"a policy's opt_level is one of {FP8_LEVELS} and its activations one of {ACTIVATIONS}")
        if not isinstance(policy.fp8_gemm, bool):
            raise ValueError(f"fp8_gemm must be True or False, got {policy.fp8_gemm!r}")
        return policy


def _precision_dict(precision: ParamPrecision) -> dict:
    return {name: None if value is None else value.name for name, value in vars(precision).items()}


def _precision_from(values: dict) -> ParamPrecision:
    formats: dict[str, Any] = dict(_parse_formats(values, ""))  # master may be None
    return ParamPrecision(**formats)


def _override_dict(override: Override) -> dict:
    formats = {name: None if value is None else value.name for name, value in override.formats}
    return {
        "pattern": override.pattern,
        "fp8_gemm": override.fp8_gemm,
        "formats": formats,
        "activations": override.activations,
    }


def _override_from(values: dict) -> Override:
    return _checked_override(values["pattern"], values["fp8_gemm"], values["formats"], values["activations"], "")


def _checked_override(pattern, fp8_gemm, formats: dict, activations, also: str) -> Override:
    """An `Override` of these settings, each validated (``also``: the other fields, for the error)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"an override pattern is a non-empty module-name pattern, got {pattern!r}")
    if fp8_gemm is not None and not isinstance(fp8_gemm, bool):
        raise ValueError(f"fp8_gemm must be True or False, got {fp8_gemm!r}")
    if activations is not None and activations not in ACTIVATIONS:
        raise ValueError(f"unknown activations {activations!r}: use one of {', '.join(ACTIVATIONS)}")
    return Override(pattern, fp8_gemm, _parse_formats(formats, also), activations)


# The output head's GEMMs and weight gradient in BF16 (1 byte more per head parameter): see the
# module docstring.
_OUTPUT_HEAD = Override("<output head>", fp8_gemm=False, formats=(("grad", BF16),))


def preset(opt_level: str, output_head: bool = True) -> Policy:
    """The policy of an FP8-LM optimization level: ``"O1"``, ``"O2"`` or ``"O3"``; with
    ``output_head`` (default) the output-head rule of the module docstring."""
    policy = _level_preset(opt_level)
    return replace(policy, output_head=_OUTPUT_HEAD) if output_head else policy


def resolve_policy(policy: Policy | dict | None, opt_level: str) -> Policy:
    """The policy `fp8lm.initialize` applies at ``opt_level`` for its ``policy`` option: the
    level's preset (None), a `Policy` for that level, or ``{pattern: {field: value}}`` overrides
    of the preset."""
    if policy is None:
        return preset(opt_level)
    if isinstance(policy, Policy):
        if policy.opt_level != opt_level:
            raise ValueError(f"the policy is for {policy.opt_level} but opt_level is {opt_level}; pass matching ones")
        return policy
    if isinstance(policy, dict):
        resolved = preset(opt_level)
        for pattern, changes in policy.items():
            if not isinstance(changes, dict):
                raise ValueError(f"policy override for {pattern!r} must be a dict of fields, got {changes!r}")
            resolved = resolved.override(pattern, **changes)
        return resolved
    raise TypeError(f"policy must be an fp8lm.policy.Policy or a dict of overrides, got {type(policy).__name__}")


def _level_preset(opt_level: str) -> Policy:
    if opt_level not in FP8_LEVELS:
        raise ValueError(f"unknown opt_level {opt_level!r}: valid levels are {', '.join(FP8_LEVELS)}")
    fp32 = ParamPrecision(FP32, FP32, None, FP32, FP32)
    vector = ParamPrecision(FP32, FP32, None, E4M3, FP16)
    if opt_level == "O1":
        return Policy("O1", linear=ParamPrecision(FP32, E4M3, None, FP32, FP32), matrix=fp32, vector=fp32)
    if opt_level == "O2":
        scaled = ParamPrecision(FP16, E4M3, None, E4M3, FP16)
        return Policy("O2", linear=scaled, matrix=scaled, vector=vector, activations="fp8")
    fp8 = ParamPrecision(E4M3, E4M3, FP16, E4M3, FP16)
    return Policy("O3", linear=fp8, matrix=fp8, vector=vector)
