"""`FP8Adam` and `FP8AdamW`: Adam/AdamW with an FP8 first moment, FP16 second moment and FP16
master weight, each with a power-of-two scale (FP8-LM level 2).

The classes are thin: the state layout and its checks are `fp8lm.optim.state`, the step is
`fp8lm.optim.fused.fused_adam_step_` over the `fp8lm.optim.slots` of all parameters, the math is
`fp8lm.optim.functional`, and skipping a non-finite step follows `fp8lm.optim.skipping`.
docs/optimizer.md has the reasoning, docs/measurements/optimizer.md the measurements.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..formats import E4M3, FP16, Format, format_of
from ..tensor import ScalingTensor
from .dtensor import local_tensor
from .functional import adam_hyperparams, adam_ratio_bound
from .fused import KERNELS, fused_adam_step_
from .sharded import ShardedParam, agree_amaxes, agree_scales, agree_shard_scales
from .skipping import SkipsNonFiniteSteps
from .slots import AdamSlot, ParamSlot
from .state import FORMAT_KEYS, check_param_dtype, checked_state, init_state, validate_group

__all__ = ["FP8Adam", "FP8AdamW"]


def _kernel_option(name: str, kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"{name}: kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    return kernel


class _FP8AdamBase(SkipsNonFiniteSteps, torch.optim.Optimizer):
    """Shared implementation of `FP8Adam` (L2 penalty) and `FP8AdamW` (decoupled weight decay)."""

    decoupled_weight_decay: bool
    default_weight_decay: float

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        exp_avg_dtype: Format | str | torch.dtype = E4M3,
        exp_avg_sq_dtype: Format | str | torch.dtype = FP16,
        master_dtype: Format | str | torch.dtype = FP16,
        kernel: str = "auto",
    ):
        """``weight_decay=None`` is the class's default: 1e-2 for FP8AdamW (as torch's AdamW), 0 for
        FP8Adam. ``kernel``: where the step runs, ``"auto"`` (fp8lm's C kernel for CPU tensors,
        ``torch.compile`` elsewhere), ``"compile"`` or ``"eager"`` (plain torch ops in bounded chunks);
        all give the same results."""
        if weight_decay is None:
            weight_decay = self.default_weight_decay
        name = type(self).__name__
        if amsgrad:
            raise ValueError(f"{name} does not support amsgrad=True; use torch.optim.{name[3:]} for AMSGrad")
        self.kernel = _kernel_option(name, kernel)
        defaults: dict[str, Any] = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            master_dtype=master_dtype,
        )
        validate_group(name, defaults)
        # Formats by name, so that param groups (and the state_dict) hold only plain values.
        defaults.update({k: format_of(defaults[k]).name for k in FORMAT_KEYS})
        # parameter -> its slot, kept across steps while the same tensors hold its state (see ParamSlot).
        self._param_slots: dict[torch.Tensor, ParamSlot] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyper-parameters and formats are validated first (formats stored as names)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"a param group must be a dict, got {type(param_group).__name__}")
        group = {**self.defaults, **param_group}
        group.pop("params", None)
        validate_group(type(self).__name__, group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            check_param_dtype(type(self).__name__, p)
        normalized = dict(param_group, params=params)
        for key in FORMAT_KEYS:
            if key in normalized:
                normalized[key] = format_of(normalized[key]).name
        super().add_param_group(normalized)

    # -- the step -------------------------------------------------------------------------------
    def _hyperparams(self, group: dict, step: int, device: torch.device, shared: dict) -> tuple[torch.Tensor, float]:
        """`adam_update`'s coefficients as a tensor, and the bound on ``|m / denom|`` for the new
        weight's scale; shared by the parameters of a group at the same step (cached in ``shared``)."""
        key = (id(group), step, device)
        if key not in shared:
            beta1, beta2 = group["betas"]
            values = adam_hyperparams(
                group["lr"], group["betas"], group["eps"], group["weight_decay"], self.decoupled_weight_decay, step
            )
            # Twice Adam's own bound: room for the rounding of the stored m and v; never reached in practice.
            max_ratio = 2 * (1 - beta1**step) * adam_ratio_bound(beta1, beta2, step)
            shared[key] = torch.tensor(values, dtype=torch.float32, device=device), max_ratio
        return shared[key]

    def _slot(self, p: torch.Tensor, group: dict, state: dict, staged: list, shared: dict) -> AdamSlot:
        """The `AdamSlot` of ``p`` for this step: its cached slot (or a new one) with the gradient."""
        grad = p.grad
        assert grad is not None  # the step collects parameters with a gradient only
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; use torch.optim.SparseAdam")
        if grad.shape != p.shape:
            raise RuntimeError(f"gradient of shape {tuple(grad.shape)} does not match its parameter {tuple(p.shape)}")
        grad = local_tensor(grad)
        entry = self._param_slots.get(p)
        if entry is None or not entry.holds(p, state):
            entry = ParamSlot.build(p, state, staged)
            if entry.cacheable:
                self._param_slots[p] = entry
        slot = entry.slot
        if ("one", p.device) not in shared:  # the scale of plain tensors, shared by the step's slots
            shared["one", p.device] = torch.ones((), dtype=torch.float32, device=p.device)
        one = shared["one", p.device]
        if not slot.w_scaled:
            slot.w_scale = one
        if isinstance(grad, ScalingTensor):
            slot.g, slot.g_scale = grad.payload.reshape(-1), grad.scale
        else:
            slot.g, slot.g_scale = grad.reshape(-1), one
        slot.hyperparams, slot.max_ratio = self._hyperparams(group, state["step"] + 1, p.device, shared)
        slot.stored = entry.known_amaxes()
        return slot

    def _finish_step(self, params: list[torch.Tensor], staged: list) -> None:
        """After an applied step: write back staged weights and masters, count the step. An FP8
        weight written from its master in parts (a tensor-parallel DTensor under FP8 ZeRO) gets
        the scale of the whole tensor: each part requantized to the smallest of their scales."""
        written: dict = defaultdict(list)
        for original, contiguous in staged:
            original.copy_(contiguous)
        for p in params:
            entry = self._param_slots.get(p)
            if entry is not None:
                entry.remember_versions()
                entry.hand_over_weight_amax(local_tensor(p))
            state = self.state[p]
            state["step"] += 1
            if "master" in state:
                value = local_tensor(state["master"]).float() / state["master_scale"]
                weight = local_tensor(p)
                weight.data.copy_(value) if not isinstance(weight, ScalingTensor) else weight.copy_(value)
                if isinstance(p, DTensor) and isinstance(weight, ScalingTensor):
                    written[p.device_mesh].append((weight.payload, weight.scale))
        for mesh, shards in written.items():  # one scale per FP8 weight over its tensor-parallel parts
            agree_shard_scales(shards, mesh)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One fused step over all parameters with a gradient; skipped as a whole (counted in
        ``skipped_steps``, flagged in ``last_step_skipped``) when any gradient is non-finite. DTensor
        parameters (FSDP2) step their shards, with scales agreed over their mesh (`fp8lm.optim.sharded`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params: list[torch.Tensor] = []
        slots: list[AdamSlot] = []
        sharded: list[ShardedParam] = []
        staged: list = []
        shared: dict = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                state = self.state[p] or init_state(self.state[p], p, group)
                slot = self._slot(p, group, state, staged, shared) if local_tensor(p).numel() else None
                if slot is not None:
                    slots.append(slot)
                if isinstance(p, DTensor):
                    sharded.append(
                        ShardedParam(p, state, slot, *self._hyperparams(group, state["step"] + 1, p.device, shared))
                    )
                params.append(p)
        try:
            applied = agree_amaxes(sharded) and fused_adam_step_(slots, kernel=self.kernel)
            if sharded:
                agree_scales(sharded, applied)
        finally:
            for slot in slots:  # cached slots keep nothing of this step alive (gradients, temporaries)
                slot.release_step()
        self.record_step(applied)
        if applied:
            self._finish_step(params, staged)
        return loss

    # -- checkpoints ----------------------------------------------------------------------------
    def forget_amaxes(self) -> None:
        """Drop the amaxes of the stored state that the step kept from the last one (measured as it
        wrote); the next step measures the stored payloads again. A sharded checkpoint's save calls
        it: a run resumed from it has no such measurements, and where the kept ones differ from a
        fresh measurement (seen on tensor-parallel shards) the uninterrupted run and the resumed one
        would choose other scales."""
        self._param_slots.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict`; payload dtypes are kept (torch's loader would cast them to the
        parameter's dtype). Everything is checked before anything changes."""
        name = type(self).__name__
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                f"{name}.load_state_dict: the checkpoint's param groups (sizes "
                f"{[len(s['params']) for s in saved_groups]}) do not match this optimizer's "
                f"({[len(g['params']) for g in self.param_groups]}); build the optimizer over the same parameters"
            )
        loaded: dict[torch.Tensor, dict] = {}
        for saved, group in zip(saved_groups, self.param_groups):
            validate_group(name, {k: v for k, v in saved.items() if k != "params"})
            for pid, p in zip(saved["params"], group["params"]):
                if pid in state_dict["state"]:
                    loaded[p] = checked_state(name, state_dict["state"][pid], p, saved)
        super().load_state_dict({**state_dict, "state": {}})
        for p, state in loaded.items():
            self.state[p] = state


class FP8AdamW(_FP8AdamBase):
    """AdamW (decoupled weight decay) with FP8 first moment, FP16 second moment and FP16 master
    weight by default; see `fp8lm.optim.state` for the layout and `docs/optimizer.md`."""

    decoupled_weight_decay = True
    default_weight_decay = 1e-2


class FP8Adam(_FP8AdamBase):
    """Adam (weight decay as an L2 penalty on the gradient) with FP8/FP16 state like `FP8AdamW`."""

    decoupled_weight_decay = False
    default_weight_decay = 0.0
