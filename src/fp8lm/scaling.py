"""Scale factors: power-of-two scales from amax, and the per-tensor scaling state.

Convention (MS-AMP, Transformer Engine, torchao): ``fp8 = cast(x * scale)``, ``x ~ fp8 * scale_inv``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .formats import Format

__all__ = [
    "compute_scale",
    "pow2_scale",
    "ScalingMeta",
    "ScalingSpec",
    "scale_and_record_",
    "scale_for_amax_",
    "record_",
    "OUTLIER_OVERFLOW",
]

# How far beyond the format's max a delayed-scaled tensor may reach before it counts as an outlier.
OUTLIER_OVERFLOW = 16.0
# Scales stop at 2**-126 (float32's smallest normal number) and 2**MAX_SCALE_EXPONENT. The top is
# well below float32's 2**127 so that a scale can later be divided (gradient clipping divides a
# gradient's scale by its coefficient) and stay finite: a BF16 tensor's scale, from BF16's float32-
# sized range, would otherwise sit at the top and overflow on the first clipped step. No FP8 or
# FP16 tensor needs more: its amax would have to be under 1e-26.
MAX_SCALE_EXPONENT = 100


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
    scale = torch.exp2(exp.clamp(-126.0, float(MAX_SCALE_EXPONENT)))
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
    return torch.full(shape, 2.0 ** min(max(exp, -126), MAX_SCALE_EXPONENT), dtype=torch.float32)


@dataclass(frozen=True)
class ScalingSpec:
    """How one tensor stream is scaled: its format, amax history length (0: current scaling) and
    margin. Frozen and hashable, so ``torch.compile`` treats it as a constant."""

    fmt: Format
    history_len: int
    margin: int

    @property
    def delayed(self) -> bool:
        return self.history_len > 0

    @property
    def fits(self) -> tuple[float, float]:
        """The range a tensor's scaled amax may take before it is an outlier (see `ScalingMeta`);
        a margin lowers both ends."""
        low = math.sqrt(self.fmt.max * self.fmt.min_normal)
        return low * 2.0**-self.margin, self.fmt.max * OUTLIER_OVERFLOW


def scale_and_record_(spec: ScalingSpec, state: tuple[torch.Tensor, ...], amax: torch.Tensor) -> torch.Tensor:
    """The scale to cast a tensor of amax ``amax`` with, and that amax recorded in ``state``
    (`ScalingMeta.state`, updated in place), in tensor ops only: no host sync, and traceable by
    ``torch.compile`` with no graph break and no value-dependent recompile.

    Gives the numbers of the CPU path (`ScalingMeta.scale_for`): current scaling and the first
    delayed step scale from the tensor's own amax; later delayed steps from the history, except
    an outlier, which restarts the history and is scaled from its own amax too. The amax is
    needed before the cast, so a delayed cast here reads its tensor twice (amax, then cast)."""
    scale, amax_history, step, rescales, last_amax = state
    amax = amax.to(torch.float32)
    last_amax.copy_(amax)
    own = pow2_scale(amax, spec.fmt.max, spec.margin, scale)
    if not spec.delayed:
        scale.copy_(own)
        amax_history.copy_(amax.reshape(1))
        return own
    first = step == 0
    reference = torch.where(first, own, scale)
    low, high = spec.fits
    scaled = amax * reference
    finite = torch.isfinite(amax)
    outlier = finite & (amax > 0) & ((scaled < low) | (scaled > high))
    used = torch.where(first | outlier, own, scale)
    amax_history.masked_fill_(outlier, 0.0)
    rescales.add_(outlier.to(rescales.dtype))
    slot = (step % amax_history.numel()).reshape(1)
    amax_history.index_put_((slot,), torch.where(finite, amax, 0.0).reshape(1))
    scale.copy_(pow2_scale(amax_history.amax(), spec.fmt.max, spec.margin, used))
    step.add_(1)
    return used


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
        self.spec = ScalingSpec(fmt, history_len, margin)

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
    def state(self) -> tuple[torch.Tensor, ...]:
        """The buffers ``(scale, amax_history, step, rescales, last_amax)``, which the scaling
        functions (`scale_and_record_`) update in place."""
        return (self.scale, self.amax_history, self.step, self.rescales, self.last_amax)

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

    def mark_recorded(self) -> None:
        """Note that an amax was recorded through `state` (by `scale_and_record_` or `record_`),
        so that `scale_known_in_advance` says so without reading the ``step`` buffer."""
        self._has_history = self.delayed

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        """The scale to quantize ``x`` with, and record its amax in the history."""
        lo, hi = torch.aminmax(x.detach())  # one pass; ~3-4x faster on CPU than abs().amax()
        amax = torch.maximum(hi.float(), -lo.float())
        if self.amax_history.device != amax.device:
            self.to(amax.device)
        scale = scale_for_amax_(self.spec, self.state, amax)
        self._has_history = self.delayed
        return scale

    def record(self, amax: torch.Tensor) -> bool:
        """Delayed scaling: add the amax of a tensor cast with ``scale`` to the history and derive
        the next scale (in place). Returns True when the tensor was an outlier for that scale
        (see the class docstring): ``scale`` is then its own current scale, to cast it again
        with. Off the CPU the check stays on the device (no sync): the history restarts and
        ``rescales`` counts, but it returns False, so only the following steps are rescaled."""
        self._has_history = True
        return record_(self.spec, self.state, amax)

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
        self.scale.copy_(state["scale"])
        self.amax_history.copy_(state["amax_history"])
        self.step.copy_(torch.as_tensor(state["step"]))
        self.rescales.copy_(torch.as_tensor(state.get("rescales", 0)))  # absent before outliers were counted
        self._has_history = bool(self.step > 0)


def _on_cpu_eagerly(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s value costs nothing: a CPU tensor outside ``torch.compile`` tracing
    (where a Python number would specialize the graph on its value)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def scale_for_amax_(spec: ScalingSpec, state: tuple[torch.Tensor, ...], amax: torch.Tensor) -> torch.Tensor:
    """The scale to cast a tensor of amax ``amax`` with, its amax recorded in ``state`` (in place):
    `scale_and_record_`, in Python arithmetic on CPU (a dozen tiny tensor ops cost more there)."""
    if not _on_cpu_eagerly(amax):
        return scale_and_record_(spec, state, amax)
    scale, amax_history, step, _, last_amax = state
    if not spec.delayed:
        scale.copy_(compute_scale(amax, spec.fmt, spec.margin, scale))
        amax_history[0] = amax
        last_amax.copy_(amax)
        return scale.clone()
    if int(step) == 0:  # no history yet: the first step scales just in time so it does not overflow
        scale.copy_(compute_scale(amax, spec.fmt, spec.margin, scale))
    used = scale.clone()
    if record_(spec, state, amax):
        used = scale.clone()  # an outlier: scaled from its own amax
    return used


def record_(spec: ScalingSpec, state: tuple[torch.Tensor, ...], amax: torch.Tensor) -> bool:
    """`ScalingMeta.record` on a state tuple (`ScalingMeta.state`)."""
    scale, amax_history, _, rescales, last_amax = state
    amax = amax.to(torch.float32)
    last_amax.copy_(amax)
    if not _on_cpu_eagerly(amax):
        _record_on_device(spec, state, amax)
        return False
    value = amax.item()
    low, high = spec.fits
    scaled = value * scale.item()
    outlier = value > 0 and math.isfinite(value) and not low <= scaled <= high
    if outlier:
        amax_history.zero_()
        rescales += 1
    _append(spec, state, value if math.isfinite(value) else 0.0)
    return outlier


def _record_on_device(spec: ScalingSpec, state: tuple[torch.Tensor, ...], amax: torch.Tensor) -> None:
    """`record_` in tensor ops only."""
    scale, amax_history, _, rescales, _ = state
    low, high = spec.fits
    scaled = amax * scale
    finite = torch.isfinite(amax)
    outlier = finite & (amax > 0) & ((scaled < low) | (scaled > high))
    amax_history.masked_fill_(outlier, 0.0)
    rescales.add_(outlier.to(rescales.dtype))
    _append(spec, state, torch.where(finite, amax, 0.0))


def _append(spec: ScalingSpec, state: tuple[torch.Tensor, ...], amax: torch.Tensor | float) -> None:
    scale, amax_history, step = state[:3]
    if isinstance(amax, float):
        amax_history[int(step) % amax_history.numel()] = amax
    else:  # a tensor index: no host sync
        slot = step % amax_history.numel()
        amax_history.index_put_((slot.reshape(1),), amax.reshape(1))
    scale.copy_(compute_scale(amax_history.amax(), spec.fmt, spec.margin, scale))
    step.add_(1)
