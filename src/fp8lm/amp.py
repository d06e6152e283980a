"""`initialize`: one call that turns a PyTorch model (and its optimizer) into an FP8 one.

Everything is validated and every new module and parameter is built before the model or the
optimizer is touched, so an error leaves both as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .formats import FP16
from .grad import QuantizeGrad  # here too: models pickled with fp8lm.amp.QuantizeGrad hooks load
from .nn import (
    FP8GroupedLinear,
    FP8Linear,
    GroupedLinear,
    activation_targets,
    grouped_targets,
    linear_targets,
    output_head,
    replace_modules,
    replace_parameters,
)
from .nn.saved import saving_counterpart
from .policy import FP8_LEVELS, ParamPrecision, Policy, resolve_policy
from .recipe import Recipe, recipe_from
from .tensor import ScalingTensor, quantize

__all__ = ["initialize"]

# torch.optim.Adam/AdamW settings with no FP8 counterpart: initialize refuses them when on.
_UNSUPPORTED_ADAM_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
# FP8Adam arguments that the precision policy sets per parameter (its field for each).
_STATE_FORMAT_OPTIONS = {"exp_avg_dtype": "exp_avg", "exp_avg_sq_dtype": "exp_avg_sq", "master_dtype": "master"}
# torch.optim.Adam/AdamW group keys that the FP8 optimizers do not take.
_TORCH_ADAM_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    opt_level: str = "O1",
    *,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    policy: Policy | dict | None = None,
    multiple_of: int = 16,
    recipe: Recipe | str | None = None,
    optimizer_options: dict | None = None,
    activations: str | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Convert ``model`` in place to FP8 training at ``opt_level`` and adapt ``optimizer``.

    - ``O1``: ``nn.Linear`` / GPT-2 ``Conv1D`` layers become `fp8lm.nn.FP8Linear` (FP8 GEMMs,
      FP32 weights, E4M3 weight gradients); the optimizer is kept, its param groups re-pointed
      to the new parameters (hyper-parameters and LR schedulers keep working).
    - ``O2``: the linear layers' weights and every other parameter of 2+ dims become FP16 scaled
      weights with E4M3 gradients, and ``torch.optim.Adam``/``AdamW`` is replaced by `fp8lm.optim.FP8Adam`/``FP8AdamW``
      (same lr, betas, eps, weight decay and param groups). Create LR schedulers afterwards.
    - ``O3``: like O2 with E4M3 weights and FP16 master weights (sharded by fp8lm.distributed).

    Options: ``module_filter(name, module) -> bool`` selects linear layers to convert; layers
    whose features are not multiples of ``multiple_of`` (16) stay high precision. ``policy``: a
    `fp8lm.policy.Policy`, or ``{pattern: {field: format, "fp8_gemm": bool, "activations": str}}``
    overrides of the level's preset. ``recipe``: the `fp8lm.Recipe` (or its name) of every FP8Linear (default
    ``"tensorwise-delayed"``).
    ``optimizer_options`` go to the FP8 optimizer under O2/O3 (e.g. ``{"kernel": "eager"}``).
    ``activations``: ``"fp8"`` saves the inputs of the norms (``nn.LayerNorm``, RMSNorm), GELU and
    SwiGLU modules for backward in FP8 (`fp8lm.nn.saved`: those modules are swapped for FP8-saving
    ones with the same parameters), ``"bf16"`` as the model computes them; default: the policy's
    (``"fp8"`` at O2, ``"bf16"`` at O1 and O3). It sets ``Policy.activations``; a policy override's
    ``activations`` still decides for the modules it matches.
    Returns ``(model, optimizer)``: the model to use (the same object, or the new `FP8Linear` when
    ``model`` itself is an ``nn.Linear`` or ``Conv1D``) and the optimizer to use from now on.
    """
    _check_arguments(model, optimizer, opt_level, optimizer_options)
    recipe = recipe_from(recipe, "initialize")
    policy = resolve_policy(policy, opt_level)
    if activations is not None:
        policy = policy.with_activations(activations)
    layer_options = {"recipe": recipe}
    targets = linear_targets(model, module_filter, multiple_of)
    grouped = grouped_targets(model, module_filter, multiple_of)
    plan = _build(model, policy, targets, layer_options, grouped)
    model = _apply(model, plan)
    model._fp8lm_opt_level = opt_level
    model._fp8lm_policy = policy
    if optimizer is None:
        return model, None
    if opt_level == "O1":
        _repoint(optimizer, plan.param_map)
        return model, optimizer
    return model, _fp8_optimizer(optimizer, plan.param_map, plan.precisions, optimizer_options or {})


def _check_arguments(model, optimizer, opt_level, optimizer_options: dict | None) -> None:
    """Refuse what `initialize` cannot do, before it builds anything."""
    if not isinstance(opt_level, str) or opt_level not in FP8_LEVELS:
        raise ValueError(f"unknown opt_level {opt_level!r}: valid levels are {', '.join(FP8_LEVELS)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize expects an nn.Module, got {type(model).__name__}")
    done = getattr(model, "_fp8lm_opt_level", None)
    if done is not None:
        raise ValueError(
            f"this model was already initialized by fp8lm.initialize (opt_level={done}); call it once per "
            "model (build a fresh model to use another level)"
        )
    if optimizer is not None:
        _check_optimizer(model, optimizer, opt_level)
    if optimizer_options and (optimizer is None or opt_level == "O1"):
        raise ValueError(
            "optimizer_options apply to the FP8 optimizer that O2/O3 create; pass an optimizer and O2 or O3"
        )
    formats = sorted(set(optimizer_options or {}) & set(_STATE_FORMAT_OPTIONS))
    if formats:
        fields = ", ".join(f"{_STATE_FORMAT_OPTIONS[k]!r}: {optimizer_options[k]!r}" for k in formats)
        raise ValueError(
            f"optimizer_options cannot set {', '.join(formats)}: under {opt_level} the state formats come from "
            f"the precision policy, per parameter; pass policy={{'*': {{{fields}}}}} instead"
        )


@dataclass
class _Plan:
    """What `initialize` builds before it changes anything of the user's."""

    layers: dict[str, FP8Linear | FP8GroupedLinear] = field(default_factory=dict)  # name -> the layer that replaces it
    saving: dict[str, nn.Module] = field(default_factory=dict)  # name -> its FP8-saving module (fp8lm.nn.saved)
    param_map: dict[int, nn.Parameter] = field(default_factory=dict)  # id(old parameter) -> new parameter
    precisions: dict[int, ParamPrecision] = field(default_factory=dict)  # id(new parameter) -> formats
    other_params: dict[int, nn.Parameter] = field(default_factory=dict)  # id(old) -> new, outside the layers

    def add(self, old: nn.Parameter, new: nn.Parameter, prec: ParamPrecision) -> None:
        self.param_map[id(old)] = new
        self.precisions[id(new)] = prec


def _build(
    model: nn.Module, policy: Policy, targets: list[str], layer_options: dict, grouped: Sequence[str] = ()
) -> _Plan:
    """The FP8Linear for every target layer, the FP8GroupedLinear for every ``grouped`` one (a
    mixture of experts' experts) and the stored form of every other parameter."""
    plan = _Plan()
    modules = dict(model.named_modules())
    for name in grouped:
        old = modules[name]
        assert isinstance(old, GroupedLinear)  # as grouped_targets found it
        _build_grouped(plan, policy, name, old, layer_options)
    head = output_head(model)
    for name in targets:
        old = modules[name]
        prec = policy.precision(f"{name}.weight", old.weight, in_linear=True, output_head=name == head)
        layer = FP8Linear.from_linear(old, weight_format=prec.weight, weight_grad_format=prec.grad, **layer_options)
        layer.fp8_enabled = policy.gemm_in_fp8(name, output_head=name == head)
        plan.layers[name] = layer
        if id(old.weight) not in plan.param_map:
            plan.add(old.weight, layer.weight, prec)
        if old.bias is not None:
            bias_prec = policy.precision(f"{name}.bias", old.bias, in_linear=False)
            layer.bias = _stored_param(old.bias, bias_prec)
            plan.add(old.bias, layer.bias, bias_prec)
    for name in activation_targets(model):
        if policy.saved_activations(name) == "fp8":
            plan.saving[name] = saving_counterpart(modules[name])
    for name, param in model.named_parameters():
        if id(param) in plan.param_map:
            continue
        prec = policy.precision(name, param, in_linear=False)
        new = _stored_param(param, prec)
        if new is not param:
            plan.other_params[id(param)] = new
        plan.add(param, new, prec)
    return plan


def _build_grouped(plan: _Plan, policy: Policy, name: str, old: GroupedLinear, layer_options: dict) -> None:
    """The FP8GroupedLinear of the experts' layer ``name``: every expert's weight stored as the
    policy says for a linear layer's weight (one format for all of them)."""
    precs = [policy.precision(f"{name}.weight.{e}", w, in_linear=True) for e, w in old.held_weights()]
    if any(p != precs[0] for p in precs[1:]):
        raise ValueError(
            f"the precision policy gives the experts of {name!r} different formats; an override must match all "
            f"of them (e.g. {name}.weight.*)"
        )
    prec = precs[0]
    layer = FP8GroupedLinear.from_grouped(old, weight_format=prec.weight, weight_grad_format=prec.grad, **layer_options)
    layer.fp8_enabled = policy.gemm_in_fp8(name)
    plan.layers[name] = layer
    for (_, old_weight), (_, new_weight) in zip(old.held_weights(), layer.held_weights()):
        plan.add(old_weight, new_weight, prec)


def _apply(model: nn.Module, plan: _Plan) -> nn.Module:
    """Swap in the planned layers and parameters and hook the FP8 gradients; returns the model to
    use (the new layer when the model itself was a linear layer)."""
    model = replace_modules(model, {**plan.layers, **plan.saving})
    replace_parameters(model, plan.other_params)
    owner: dict[int, FP8Linear | FP8GroupedLinear] = {}
    for layer in plan.layers.values():
        held = [w for _, w in layer.held_weights()] if isinstance(layer, FP8GroupedLinear) else [layer.weight]
        for weight in held:
            owner[id(weight)] = layer
    for param in {id(p): p for p in plan.param_map.values()}.values():
        prec = plan.precisions[id(param)]
        if prec.scaled_grad and param.requires_grad:
            param.register_post_accumulate_grad_hook(QuantizeGrad(prec.grad, owner.get(id(param))))
    return model


def _stored_param(param: nn.Parameter, prec: ParamPrecision) -> nn.Parameter:
    """``param`` in the storage its precision asks for (the same object when it already is)."""
    if not prec.scaled_weight or (isinstance(param, ScalingTensor) and param.payload.dtype == prec.weight.dtype):
        return param
    return nn.Parameter(quantize(param.detach(), prec.weight), requires_grad=param.requires_grad)


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, opt_level: str) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    owned = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:5])
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not in the model (shapes {shapes}); "
            "build the optimizer from model.parameters() of the model you pass to initialize"
        )
    if opt_level == "O1":
        return
    from .optim import FP8Adam, FP8AdamW

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, FP8Adam, FP8AdamW)):
        raise ValueError(
            f"opt_level={opt_level} replaces torch.optim.Adam/AdamW by FP8 optimizers; got "
            f"{type(optimizer).__name__}. Use Adam/AdamW, or opt_level='O1' to keep your optimizer"
        )
    if isinstance(optimizer, (FP8Adam, FP8AdamW)):
        return
    on = sorted({k for g in optimizer.param_groups for k in _UNSUPPORTED_ADAM_FLAGS if g.get(k)})
    if on:
        raise ValueError(f"opt_level={opt_level}: the FP8 optimizers do not support {on}; turn them off or use O1")
    if any(isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups):
        raise ValueError(f"opt_level={opt_level}: the FP8 optimizers take a float lr, not a tensor; pass lr as a float")
    if any(optimizer.state.values()):
        raise ValueError(
            f"opt_level={opt_level} needs a fresh optimizer (this one has taken steps): call initialize "
            "before training, and load optimizer checkpoints into the optimizer it returns"
        )


def _repoint(optimizer: torch.optim.Optimizer, param_map: dict[int, nn.Parameter]) -> None:
    """Swap the optimizer's parameters for their new objects in place, moving their state."""
    for group in optimizer.param_groups:
        new_params = [param_map.get(id(p), p) for p in group["params"]]
        for old, new in zip(group["params"], new_params):
            if old is not new and old in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(old)
        group["params"] = new_params


def _fp8_optimizer(optimizer, param_map, precisions, options: dict) -> torch.optim.Optimizer:
    """The FP8Adam/FP8AdamW that replaces a torch Adam/AdamW: same hyper-parameters and groups;
    a group whose parameters need different state formats is split into one group per format."""
    from .optim import FP8Adam, FP8AdamW

    if isinstance(optimizer, (FP8Adam, FP8AdamW)):
        _repoint(optimizer, param_map)
        return optimizer
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay"))
    cls = FP8AdamW if decoupled else FP8Adam
    groups = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params" and k not in _TORCH_ADAM_KEYS}
        by_format: dict[tuple, list] = {}
        for p in group["params"]:
            new = param_map.get(id(p), p)
            prec = precisions[id(new)]
            master = prec.master or (prec.weight if prec.scaled_weight else FP16)
            by_format.setdefault((prec.exp_avg.name, prec.exp_avg_sq.name, master.name), []).append(new)
        for (m, v, master), params in by_format.items():
            groups.append(
                {**settings, "params": params, "exp_avg_dtype": m, "exp_avg_sq_dtype": v, "master_dtype": master}
            )
    d = optimizer.defaults
    return cls(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"], **options)
