"""Scale factors: power-of-two scales from amax, and the per-tensor scaling state.

Convention (MS-AMP, Transformer Engine, torchao): ``fp8 = cast(x * scale)``, ``x ~ fp8 * scale_inv``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .formats import Format

__all__ = ["compute_scale", "pow2_scale", "ScalingMeta", "OUTLIER_OVERFLOW"]

# How far beyond the format's max a delayed-scaled tensor may reach before it counts as an outlier.
OUTLIER_OVERFLOW = 16.0


def compute_scale(
    amax: torch.Tensor | float, fmt: Format, margin: int = 0, previous: torch.Tensor | None = None
) -> torch.Tensor:
    """Power-of-two scale ``2**(floor(log2(fmt.max / amax)) - margin)`` as a float32 tensor.

    A power of two makes the multiplication by the scale exact. An amax of 0, NaN or inf carries
    no information, so it keeps ``previous`` (1 when there is none). Works elementwise on a tensor
    of amaxes.
    """
    if (
        isinstance(amax, torch.Tensor)
        and amax.device.type == "cpu"
        and amax.numel() == 1
        and (previous is None or previous.numel() == 1)
        and not torch.compiler.is_compiling()
    ):  # traced, a Python float would specialize the graph on its value
        return _scalar_scale(float(amax), fmt, margin, previous, amax.shape)
    return pow2_scale(torch.as_tensor(amax, dtype=torch.float32), fmt.max, margin, previous)


def pow2_scale(
    amax: torch.Tensor, fmax: torch.Tensor | float, margin: int = 0, previous: torch.Tensor | None = None
) -> torch.Tensor:
    """`compute_scale` on a float32 tensor of amaxes with the format's largest value ``fmax``, a
    number or a tensor broadcasting with ``amax`` (tensors of different formats in one call)."""
    if previous is None:
        previous = torch.ones_like(amax)
    else:
        previous = torch.as_tensor(previous, dtype=torch.float32, device=amax.device)
    valid = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(valid, amax, torch.ones_like(amax))
    exp = torch.floor(torch.log2(fmax / safe)) - margin
    # float32 exponents stop at +-126 for normal numbers; clamp so the scale stays finite and non-zero.
    scale = torch.exp2(exp.clamp(-126.0, 126.0))
    return torch.where(valid, scale, previous)


def _scalar_scale(amax: float, fmt: Format, margin: int, previous: torch.Tensor | None, shape) -> torch.Tensor:
    """`compute_scale` of one CPU value in Python arithmetic, without a dozen tiny tensor ops
    (measured 42 us a call before; training calls it several times per layer and step). Double
    precision is exact here: amax and fmt.max are float32 values, so their ratio is never within
    double rounding of a power of two unless it is one."""
    if not (math.isfinite(amax) and amax > 0):
        if previous is None:
            return torch.ones(shape, dtype=torch.float32)
        return previous.to(torch.float32).reshape(shape).clone()
    exp = math.floor(math.log2(fmt.max / amax)) - margin
    return torch.full(shape, 2.0 ** min(max(exp, -126), 126), dtype=torch.float32)


class ScalingMeta(nn.Module):
    """Scaling state of one tensor stream (an input, an output gradient, ...), in buffers.

    ``history_len`` > 0 is delayed scaling: the scale for this step comes from the max over the
    last ``history_len`` amaxes, which were recorded by earlier steps. ``history_len == 0`` is
    current (just-in-time) scaling: the scale comes from the tensor itself.

    State (buffers, so ``named_buffers()``, ``.to()`` and ``deepcopy`` see it): ``scale``,
    ``amax_history``, ``step`` (records so far, int64), ``rescales`` and ``last_amax``. They are
    not persistent: a converted model's ``state_dict()`` stays the plain model's (it loads into the
    unconverted model); `scaling_state` / `load_scaling_state` (and
    `fp8lm.nn.scaling_state_dict` for a whole model) save and restore them for an exact resume.

    ``amax_history`` is a ring buffer: the amax of recorded step ``k`` sits at ``k % history_len``
    (only the max over it matters; writing in place spares the shift of every step).

    Outliers: a delayed scale fits the recent past, so one spike (a loss times 1e30) would
    saturate its own step and then, kept in the history, scale the next ``history_len`` steps to
    all zeros. A tensor whose amax, times the scale it is cast with, lands more than 16 times
    above the format's max or below ``sqrt(max * min_normal)`` (the top half of the format's
    normal range unused) is an outlier: the history restarts from its amax, it is scaled from its
    own amax (current scaling for that step), and ``rescales`` counts it. Ordinary steps are
    untouched. A non-finite amax is not recorded (it carries no scale; the step is skipped).
    """

    scale: torch.Tensor
    amax_history: torch.Tensor
    step: torch.Tensor
    rescales: torch.Tensor
    last_amax: torch.Tensor

    def __init__(self, fmt: Format, history_len: int = 16, margin: int = 0):
        super().__init__()
        if history_len < 0:
            raise ValueError(f"history_len must be >= 0 (0 = current scaling), got {history_len}")
        self.fmt, self.history_len, self.margin = fmt, history_len, margin
        for name, value in (
            ("scale", torch.ones((), dtype=torch.float32)),
            ("amax_history", torch.zeros(max(history_len, 1), dtype=torch.float32)),
            ("step", torch.zeros((), dtype=torch.int64)),
            ("rescales", torch.zeros((), dtype=torch.int64)),
            ("last_amax", torch.zeros((), dtype=torch.float32)),  # as given: inf or NaN too
        ):
            self.register_buffer(name, value, persistent=False)
        # Whether step > 0, cached so that asking reads no device memory (on CUDA: no host sync);
        # step only grows, so only loading a state sets it back.
        self._has_history = False
        # The range a tensor's scaled amax may take before it is an outlier (a margin lowers both).
        low = math.sqrt(self.fmt.max * self.fmt.min_normal)
        self._fits = (low * 2.0**-self.margin, self.fmt.max * OUTLIER_OVERFLOW)

    def _apply(self, fn, recurse=True):
        # .to(device) moves the state; .to(dtype) / .half() keep it float32 (scales are float32 by contract).
        super()._apply(fn, recurse)
        for name, buf in self._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    def extra_repr(self) -> str:
        return f"fmt={self.fmt.name}, history_len={self.history_len}, margin={self.margin}"

    @property
    def delayed(self) -> bool:
        return self.history_len > 0

    @property
    def scale_inv(self) -> torch.Tensor:
        return self.scale.reciprocal()

    @property
    def scale_known_in_advance(self) -> bool:
        """Delayed scaling with history: the scale for the next tensor does not depend on it, so
        the cast and the amax can share one pass (`record` the amax afterwards)."""
        return self.delayed and self._has_history

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        """The scale to quantize ``x`` with, and record its amax in the history."""
        lo, hi = torch.aminmax(x.detach())  # one pass; ~3-4x faster on CPU than abs().amax()
        amax = torch.maximum(hi.float(), -lo.float())
        if self.amax_history.device != amax.device:
            self.to(amax.device)
        if not self.delayed:
            self.scale = compute_scale(amax, self.fmt, self.margin, self.scale)
            self.amax_history[0] = amax
            self.last_amax.copy_(amax)
            return self.scale
        if not self.scale_known_in_advance:
            # No history yet: the first step scales just in time so it does not overflow.
            self.scale = compute_scale(amax, self.fmt, self.margin, self.scale)
        scale = self.scale
        if self.record(amax):
            scale = self.scale  # an outlier: scaled from its own amax
        return scale

    def record(self, amax: torch.Tensor) -> bool:
        """Delayed scaling: add the amax of a tensor cast with ``scale`` to the history and derive
        the next scale (a new tensor: the one the tensor was cast with stays as it was). Returns
        True when the tensor was an outlier for that scale (see the class docstring): ``scale`` is
        then its own current scale, to cast it again with. Off the CPU the check stays on the
        device (no sync): the history restarts and ``rescales`` counts, but it returns False, so
        only the following steps are rescaled."""
        amax = amax.to(torch.float32)
        self.last_amax.copy_(amax)
        if amax.device.type == "cpu" and not torch.compiler.is_compiling():
            value = amax.item()
            low, high = self._fits
            scaled = value * self.scale.item()
            outlier = value > 0 and math.isfinite(value) and not low <= scaled <= high
            if outlier:
                self.amax_history.zero_()
                self.rescales += 1
            self._append(value if math.isfinite(value) else 0.0)
            return outlier
        self._record_on_device(amax)
        return False

    def _record_on_device(self, amax: torch.Tensor) -> None:
        """`record` in tensor ops only."""
        low, high = self._fits
        scaled = amax * self.scale
        finite = torch.isfinite(amax)
        outlier = finite & (amax > 0) & ((scaled < low) | (scaled > high))
        self.amax_history.masked_fill_(outlier, 0.0)
        self.rescales += outlier
        self._append(torch.where(finite, amax, 0.0))

    def _append(self, amax: torch.Tensor | float) -> None:
        slot = self.step % self.amax_history.numel()
        if isinstance(amax, float):
            self.amax_history[int(slot)] = amax
        else:  # a tensor index: no host sync
            self.amax_history.index_put_((slot.reshape(1),), amax.reshape(1))
        self.scale = compute_scale(self.amax_history.amax(), self.fmt, self.margin, self.scale)
        self.step += 1
        self._has_history = True

    def scaling_state(self) -> dict:
        """Copies of the state (plain tensors; weights_only-safe) for `load_scaling_state`."""
        return {
            "scale": self.scale.clone(),
            "amax_history": self.amax_history.clone(),
            "step": self.step.clone(),
            "rescales": self.rescales.clone(),
        }

    def load_scaling_state(self, state: dict) -> None:
        """Restore `scaling_state` output (also the form saved before the state lived in buffers,
        with an int ``step`` and maybe no ``rescales``), in place and on this state's device."""
        if state["amax_history"].shape != self.amax_history.shape:
            raise ValueError(
                f"amax history of length {state['amax_history'].numel()} does not fit this layer's "
                f"history_len={self.history_len}; build the model with the same history length"
            )
        self.scale = state["scale"].to(self.scale.device, torch.float32).clone()
        self.amax_history.copy_(state["amax_history"])
        self.step.copy_(torch.as_tensor(state["step"]))
        self.rescales.copy_(torch.as_tensor(state.get("rescales", 0)))  # absent before outliers were counted
        self._has_history = bool(self.step > 0)
