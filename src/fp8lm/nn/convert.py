"""Swapping a model's linear layers (``nn.Linear``, GPT-2 ``Conv1D``) for `FP8Linear`, in place.

Conversion is planned, built and only then applied, so a failure leaves the model untouched.
Parameters shared between modules (GPT's tied embedding and output head) stay shared: each old
Parameter maps to exactly one new one, and every module that held the old one is re-pointed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

from torch import nn

from ..tensor import ScalingTensor
from .grouped import GroupedLinear
from .linear import FP8Linear, is_conv1d
from .state import register_plain_state_dict

__all__ = [
    "is_convertible",
    "linear_targets",
    "grouped_targets",
    "replace_modules",
    "replace_parameters",
    "convert_linears",
]

ModuleFilter = Callable[[str, nn.Module], bool]


def is_convertible(module: nn.Module) -> bool:
    """An exact ``nn.Linear`` (subclasses may override ``forward``) or a GPT-2 ``Conv1D``."""
    return type(module) is nn.Linear or is_conv1d(module)


def linear_targets(model: nn.Module, module_filter: ModuleFilter | None = None, multiple_of: int = 16) -> list[str]:
    """Names of the modules `convert_linears` would swap: convertible, accepted by
    ``module_filter(name, module)``, with in and out features multiples of ``multiple_of``
    (FP8 GEMM kernels want multiples of 16; other layers stay in high precision)."""
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of must be an int >= 1, got {multiple_of!r}")
    names, uneven = [], []
    for name, module in model.named_modules():
        if not is_convertible(module):
            continue
        if module_filter is not None and not module_filter(name, module):
            continue
        in_features, out_features = _linear_dims(module)
        if in_features % multiple_of or out_features % multiple_of:
            uneven.append(f"{name or 'the model'!r} ({in_features}x{out_features})")
            continue
        names.append(name)
    if uneven:
        _warn_uneven(uneven, multiple_of)
    return names


def grouped_targets(model: nn.Module, module_filter: ModuleFilter | None = None, multiple_of: int = 16) -> list[str]:
    """Names of the experts' layers (exact `GroupedLinear`s) that `fp8lm.initialize` turns into
    `FP8GroupedLinear`: accepted by ``module_filter`` and with in and out features multiples of
    ``multiple_of`` (others stay in high precision, with the warning of `linear_targets`)."""
    names, uneven = [], []
    for name, module in model.named_modules():
        if type(module) is not GroupedLinear or (module_filter is not None and not module_filter(name, module)):
            continue
        if module.in_features % multiple_of or module.out_features % multiple_of:
            uneven.append(f"{name!r} ({module.in_features}x{module.out_features})")
            continue
        names.append(name)
    if uneven:
        _warn_uneven(uneven, multiple_of)
    return names


def _warn_uneven(layers: list[str], multiple_of: int) -> None:
    """One line (once per message, Python's default) naming the layers left in high precision."""
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    verb = "stays" if len(layers) == 1 else "stay"
    warnings.warn(
        f"fp8lm: linear layer {shown} {verb} in high precision: FP8 GEMMs need in and out features that are "
        f"multiples of {multiple_of}; pad it (e.g. a vocabulary of 50257 to 50304) to train it in FP8",
        UserWarning,
        stacklevel=4,  # the caller of initialize / convert_linears
    )


def output_head(model: nn.Module) -> str | None:
    """Name of ``model``'s output head: its last linear layer (``nn.Linear`` or GPT-2 ``Conv1D``)
    in module order, as in GPT-2, Llama and nanoGPT; None when no submodule is one."""
    names = [name for name, module in model.named_modules() if name and is_convertible(module)]
    return names[-1] if names else None


def _linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear (weight (out, in)) or Conv1D (weight (in, out))."""
    rows, cols = module.get_parameter("weight").shape
    return (rows, cols) if is_conv1d(module) else (cols, rows)


def replace_parameters(model: nn.Module, mapping: dict[int, nn.Parameter]) -> None:
    """Re-point every module entry holding a Parameter whose ``id`` is in ``mapping`` to its new one."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in mapping:
                module._parameters[name] = mapping[id(param)]
        if any(isinstance(p, ScalingTensor) for p in module._parameters.values()):
            register_plain_state_dict(module)


def replace_modules(model: nn.Module, new_modules: Mapping[str, nn.Module]) -> nn.Module:
    """Swap ``model``'s submodules by name for ``new_modules`` (all names checked first), keeping
    parameters that the old modules shared, with each other or with other modules, shared.
    Returns the model to use: ``model``, or ``new_modules[""]`` that replaces the model itself."""
    old_modules = dict(model.named_modules(remove_duplicate=False))
    unknown = sorted(set(new_modules) - set(old_modules))
    if unknown:
        raise KeyError(f"cannot replace {unknown}: not submodules of the model")
    if "" in new_modules:
        if len(new_modules) > 1:
            raise KeyError(
                f"cannot replace the model itself together with its submodules {sorted(new_modules)[1:]}; "
                "replace either the model or its submodules"
            )
        return new_modules[""]
    mapping: dict[int, nn.Parameter] = {}
    for name, new in new_modules.items():
        old = old_modules[name]
        for pname, old_param in old._parameters.items():
            if old_param is None:
                continue
            if id(old_param) in mapping:  # tied to a module converted earlier: share its new Parameter
                new._parameters[pname] = mapping[id(old_param)]
            else:
                mapping[id(old_param)] = new.get_parameter(pname)
    # Re-point every parent, so a module registered under several names is swapped everywhere.
    swaps = {id(old_modules[name]): new for name, new in new_modules.items()}
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in swaps:
                parent._modules[child_name] = swaps[id(child)]
    replace_parameters(model, mapping)
    return model


def convert_linears(
    model: nn.Module,
    module_filter: ModuleFilter | None = None,
    multiple_of: int = 16,
    **layer_options,
) -> dict[str, FP8Linear]:
    """Swap the model's linear layers for `FP8Linear` in place; returns ``{name: new layer}``
    (a model that is itself a linear layer is not changed: its FP8Linear is under the name ``""``).

    Which layers: see `linear_targets`. ``layer_options`` go to every FP8Linear (``recipe``,
    ``weight_format``, ...). Layers already FP8Linear are left as they are, so
    converting twice changes nothing the second time.
    """
    names = linear_targets(model, module_filter, multiple_of)
    modules = dict(model.named_modules())
    new = {name: FP8Linear.from_linear(modules[name], **layer_options) for name in names}
    replace_modules(model, new)
    return new
