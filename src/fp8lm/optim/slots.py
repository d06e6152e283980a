"""What the fused step works on: one tensor's state as flat payloads and scales (`AdamSlot`), and a
parameter's slot kept across steps while the same tensors hold its state (`ParamSlot`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats import Format, format_of
from ..tensor import ScalingTensor
from .dtensor import local_tensor

__all__ = ["AdamSlot", "ParamSlot"]

Amaxes = tuple[float | None, float | None, float | None]


@dataclass
class AdamSlot:
    """One tensor's optimizer state as flat (1-D, contiguous) payloads with 0-d float32 scales.

    ``w`` is the master weight; ``w_scaled`` False means a plain tensor whose scale stays 1.
    ``g_scale`` is 1 for a plain gradient. ``hyperparams`` holds `adam_update`'s coefficients
    (`adam_hyperparams`, as a tensor, so that a changing lr or step never recompiles). ``max_ratio``
    is the bound on ``|m / denom|`` that sets the new weight's scale (twice `adam_ratio_bound` times
    ``bias_correction1``; inf for none beyond ``|m| / eps``); an element beyond it saturates at the
    weight's range. Scales are updated in place.

    ``stored`` optionally gives the amaxes of the stored ``w``, ``m``, ``v`` payloads when the caller
    knows them (None for one to be measured); after a step, `fused_adam_step_` sets it to the
    amaxes of what it stored where it knows them (the native kernel measures them as it writes),
    and ``written_w_amax`` to the stored ``w`` payload's amax as a 0-d tensor on its device where
    the pass measured it (on a GPU too, where reading it back into ``stored`` would be a host sync).
    Between steps the gradient fields and ``hyperparams`` are None (a cached slot keeps nothing of a
    step alive).
    """

    w: torch.Tensor
    w_scale: torch.Tensor | None
    w_scaled: bool
    g: torch.Tensor | None
    g_scale: torch.Tensor | None
    m: torch.Tensor
    m_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    hyperparams: torch.Tensor | None
    max_ratio: float = math.inf
    stored: Amaxes = (None, None, None)
    written_w_amax: torch.Tensor | None = None

    def step_payloads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w, m, v, g)`` of a slot set up for a step."""
        if self.g is None:
            raise ValueError("AdamSlot has no gradient: set g, g_scale, hyperparams (and w_scale) before a step")
        return self.w, self.m, self.v, self.g

    def step_scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The current scales of ``(w, m, v, g)`` of a slot set up for a step."""
        if self.w_scale is None or self.g_scale is None:
            raise ValueError("AdamSlot has no scale of its weight or gradient: set them before a step")
        return self.w_scale, self.m_scale, self.v_scale, self.g_scale

    def step_hyperparams(self) -> torch.Tensor:
        if self.hyperparams is None:
            raise ValueError("AdamSlot has no hyperparams: set them (adam_hyperparams as a tensor) before a step")
        return self.hyperparams

    def pass_args(self) -> tuple:
        return (
            self.w,
            self.w_scale,
            self.g,
            self.g_scale,
            self.m,
            self.m_scale,
            self.v,
            self.v_scale,
            self.hyperparams,
        )

    def formats(self) -> tuple[Format, Format, Format]:
        return format_of(self.w.dtype), format_of(self.m.dtype), format_of(self.v.dtype)

    def release_step(self) -> None:
        """Drop the step's gradient and hyper-parameters (and a plain weight's shared scale of 1)."""
        self.g = self.g_scale = self.hyperparams = None
        if not self.w_scaled:
            self.w_scale = None


@dataclass
class ParamSlot:
    """A parameter's `AdamSlot` kept across steps, with what it was built from.

    Rebuilding the views and looking up the state every step costs more host time than the kernel's
    share of a small tensor. The slot stays valid while the same tensors hold the weight, moments
    and scales (``holds``). Its ``stored`` amaxes (measured by the kernel as it wrote the state) stay
    valid while those tensors are unchanged: every in-place change bumps a tensor's version, which
    ``remember_versions`` records after each step. A plain parameter's weight (``bases[0]`` None) is
    re-measured every step: changes through ``.data`` do not count in its version.
    """

    slot: AdamSlot
    bases: tuple  # the tensors the slot's w, m, v are views of (w: None for a plain parameter)
    scales: tuple  # the scale tensors of w, m, v
    data_ptr: int  # of the weight (a plain parameter's ``.data`` can be swapped)
    cacheable: bool = True
    versions: tuple | None = None

    @staticmethod
    def weight_source(p: torch.Tensor, state: dict) -> tuple:
        """``(payload, scale, scaled)`` of the weight the optimizer updates for ``p``: its master in
        ``state``, or this rank's ScalingTensor payload and scale, or ``(None, None, False)`` for a
        plain tensor (updated through its ``.data``)."""
        local = local_tensor(p)
        if "master" in state:
            return local_tensor(state["master"]), state["master_scale"], True
        if isinstance(local, ScalingTensor):
            return local.payload, local.scale, True
        return None, None, False

    @classmethod
    def build(cls, p: torch.Tensor, state: dict, staged: list) -> ParamSlot:
        """The slot of ``p`` over its ``state``; a non-contiguous weight is updated on a contiguous
        copy, appended to ``staged`` as ``(original, copy)`` to be written back after the step."""
        w_base, w_scale, w_scaled = cls.weight_source(p, state)
        w = w_base if w_base is not None else local_tensor(p).data
        cacheable = w.is_contiguous()
        if not cacheable:
            staged.append((w, w := w.contiguous()))
        m, v = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        slot = AdamSlot(
            w=w.view(-1),
            w_scale=w_scale,
            w_scaled=w_scaled,
            g=None,
            g_scale=None,
            m=m.view(-1),
            m_scale=state["exp_avg_scale"],
            v=v.view(-1),
            v_scale=state["exp_avg_sq_scale"],
            hyperparams=None,
        )
        data_ptr = local_tensor(p).data_ptr()
        return cls(slot, (w_base, m, v), (w_scale, slot.m_scale, slot.v_scale), data_ptr, cacheable)

    def holds(self, p: torch.Tensor, state: dict) -> bool:
        w_base, w_scale, w_scaled = self.weight_source(p, state)
        return (
            w_base is self.bases[0]
            and (not w_scaled or w_scale is self.scales[0])
            and local_tensor(state["exp_avg"]) is self.bases[1]
            and local_tensor(state["exp_avg_sq"]) is self.bases[2]
            and state["exp_avg_scale"] is self.scales[1]
            and state["exp_avg_sq_scale"] is self.scales[2]
            and local_tensor(p).data_ptr() == self.data_ptr
        )

    def known_amaxes(self) -> Amaxes:
        if self.versions is None:
            return None, None, None
        a_w, a_m, a_v = (
            a if b is not None and b._version == version else None
            for a, b, version in zip(self.slot.stored, self.bases, self.versions)
        )
        return a_w, a_m, a_v

    def remember_versions(self) -> None:
        self.versions = tuple(b._version if b is not None else None for b in self.bases)

    def hand_over_weight_amax(self, weight: torch.Tensor) -> None:
        """After a step: note the amax the pass measured of the stored payload on ``weight`` (this
        rank's parameter) for its readers (`ScalingTensor.note_payload_amax`: FP8Linear then need
        not measure it again), where the pass wrote ``weight``'s own payload (not a master)."""
        amax, self.slot.written_w_amax = self.slot.written_w_amax, None
        if amax is not None and isinstance(weight, ScalingTensor) and weight.payload is self.bases[0]:
            weight.note_payload_amax(amax)
