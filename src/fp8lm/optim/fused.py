"""The fused multi-tensor Adam step over low-precision state (`fused_adam_step_`).

The step is fused per tensor in one pass over the low-precision state, never materializing the FP32
state of the model. Its new scales are set before the pass, from a-priori bounds on the new amaxes
(`fp8lm.optim.functional.amax_bounds`) built from the exact amaxes of the stored state and gradients
(`stored_amaxes`, integer reductions) and Adam's bound on its update ratio; the pass dequantizes,
updates and writes the state requantized. Tensors with an FP8 second moment first take an exact
amax pass (its range is too small to give up a binade). A non-finite gradient or bound anywhere is
found before anything is written, and the step is skipped as a whole.

Where the passes run (``kernel``): ``"auto"`` puts all CPU tensors of a step in one call into
fp8lm's C kernel (`fp8lm.optim.native`, which also measures the amaxes of what it stores so the next
step need not re-read the state) and `torch.compile`-s the pass per tensor elsewhere (dynamic shapes:
one graph per combination of dtypes, whatever the tensor sizes); ``"compile"`` always uses the
compiled pass; ``"eager"`` runs it eagerly on bounded chunks. All give the same stored values (the C
kernel up to torch's CPU ``sqrt`` being 1 ulp off, rarely). docs/optimizer.md has the reasoning and
docs/measurements/optimizer.md the measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..formats import Format, format_of
from ..ops import library
from ..ops.cast import saturating_cast
from ..ops.fastpath import FastPath
from ..scaling import pow2_scale
from . import native
from .functional import adam_update, amax_bounds
from .slots import AdamSlot

__all__ = [
    "KERNELS",
    "COMPILED_STEP",
    "fused_adam_step_",
    "stored_amaxes",
    "amaxes_pass",
    "write_pass",
    "run_pass",
    "no_stall",
]

KERNELS = ("auto", "compile", "eager")
# Where compilation fails (no C++ compiler, say), warn once and run the passes eagerly.
COMPILED_STEP = FastPath("compiled optimizer step", fallback="eager ops")
# Elements per chunk of the eager path: its FP32 temporaries stay in the CPU caches and bounded.
_EAGER_CHUNK = 1 << 16
# Inductor by default stores an intermediate to memory once it has many reads or ops (an FP32
# buffer the size of the tensor). The pass is elementwise: everything stays in registers.
_INDUCTOR_OPTIONS: dict[str, Any] = {
    "realize_opcount_threshold": 1 << 20,
    "realize_reads_threshold": 1 << 20,
    "realize_acc_reads_threshold": 1 << 20,
}
_OP_ORDER = [0, 3, 1, 2]  # the adam ops take the scales of w, g, m, v; slots list w, m, v, g


def _updated(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hyperparams):
    """Dequantize one tensor's state and apply `adam_update`."""
    # Multiplying by 1/scale is exact (a power of two) and much cheaper than dividing.
    return adam_update(
        w.float() * (1 / w_scale),
        g.float() * (1 / g_scale),
        m.float() * (1 / m_scale),
        v.float() * (1 / v_scale),
        *hyperparams.unbind(),
    )


def amaxes_pass(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hyperparams):
    """The exact amaxes of the new weight, first and second moment, as a (3,) tensor (for an FP8
    second moment, see `fused_adam_step_`). A non-finite input makes its amax non-finite."""
    w_new, m_new, v_new = _updated(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hyperparams)
    return torch.stack([w_new.abs().amax(), m_new.abs().amax(), v_new.abs().amax()])


def write_pass(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hyperparams, scales, fmts):
    """Compute the new values and store them in place, requantized with the new ``scales`` (weight,
    m, v); a low-precision first moment is rounded so that its decay cannot stall (`no_stall`)."""
    w_new, m_new, v_new = _updated(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hyperparams)
    w_fmt, m_fmt, v_fmt = fmts
    # An element whose second moment underflows to 0 loses its first moment too: otherwise the next
    # step would divide a surviving m by eps alone and take a step far larger than lr. v >= 0 rounds
    # to 0 exactly when v * scale <= half the smallest subnormal (a tie rounds to the even 0); the
    # comparison needs no round trip through the storage format.
    m_new = torch.where(v_new * scales[2] <= v_fmt.min_subnormal / 2, 0.0, m_new)
    m_stored = saturating_cast(m_new, scales[1], m_fmt)
    if m_fmt.bytes < 4:  # FP32's resolution makes the stall negligible
        m_stored = no_stall(m_stored, m_new, m.float() * (1 / m_scale), scales[1], m_fmt)
    w.copy_(saturating_cast(w_new, scales[0], w_fmt))
    m.copy_(m_stored)
    v.copy_(saturating_cast(v_new, scales[2], v_fmt))


_CODE_DTYPES = {1: torch.uint8, 2: torch.int16}


def no_stall(
    stored: torch.Tensor, new: torch.Tensor, old: torch.Tensor, scale: torch.Tensor, fmt: Format
) -> torch.Tensor:
    """``stored`` (the payload of ``new * scale`` rounded to nearest), moved one code toward zero
    where the old value was subnormal in ``fmt`` and ``|new| < |old|`` but the rounding kept it at
    least ``|old|``.

    Rounding to nearest has fixed points for a decaying value: in E4M3's subnormals ``0.9 * 2`` units
    round back to 2, so a first moment whose gradient has gone to zero never reaches zero, and Adam
    keeps stepping that element by ``m / sqrt(v)`` (both stuck) every step, the same way, forever
    (measured in docs/measurements/training.md, "Loss fidelity"). Above the subnormals a decay by ``1 - beta1`` more
    than half a relative code (``2**-(mantissa bits + 1)``: ``beta1 < 15/16`` for E4M3) always moves
    a value, and rounding there is left alone: forcing it down wherever a slowly shrinking value
    rounds back biases every first moment low. Payloads are
    sign-magnitude, so one code toward zero is the integer payload minus one.
    """
    rounded = stored.float()
    old_scaled = old.abs() * scale
    stalled = (old_scaled < fmt.min_normal) & (new.abs() < old.abs()) & (rounded.abs() >= old_scaled) & (rounded != 0)
    codes = stored.view(_CODE_DTYPES[stored.element_size()])
    return (codes - stalled.to(codes.dtype)).view(stored.dtype)


_compiled_passes: dict[Callable, Callable] = {}


def _compiled(fn: Callable) -> Callable:
    if fn not in _compiled_passes:
        _compiled_passes[fn] = torch.compile(fn, dynamic=True, fullgraph=True, options=_INDUCTOR_OPTIONS)
    return _compiled_passes[fn]


def _compiled_or_eager(fn: Callable, *args):
    """``fn(*args)`` compiled while `COMPILED_STEP` works, else eagerly."""
    return COMPILED_STEP.run(lambda: _compiled(fn)(*args), lambda: fn(*args))


def run_pass(fn: Callable, slot: AdamSlot, kernel: str, *extra):
    """Run a pass (`amaxes_pass` or `write_pass`) on a whole slot, compiled (``kernel`` other than
    ``"eager"``, while `COMPILED_STEP` works), or eagerly on bounded chunks of it."""
    args = (*slot.pass_args(), *extra)
    if kernel != "eager" and COMPILED_STEP.enabled:
        return _compiled_or_eager(fn, *args)
    w, w_scale, g, g_scale, m, m_scale, v, v_scale, hyperparams = slot.pass_args()
    n = w.numel()
    if n <= _EAGER_CHUNK:
        return fn(*args)
    outs = []
    for a in range(0, n, _EAGER_CHUNK):
        b = a + _EAGER_CHUNK
        outs.append(fn(w[a:b], w_scale, g[a:b], g_scale, m[a:b], m_scale, v[a:b], v_scale, hyperparams, *extra))
    return None if outs[0] is None else torch.stack(outs).amax(dim=0)


def _op_rows(w, g, m, v, scales, hyperparams):
    """Per tensor of the adam ops' lists: `write_pass`'s and `amaxes_pass`'s arguments."""
    for i, (wi, gi, mi, vi) in enumerate(zip(w, g, m, v)):
        w_scale, g_scale, m_scale, v_scale = scales[i].unbind()
        yield i, (wi, w_scale, gi, g_scale, mi, m_scale, vi, v_scale, hyperparams[i])


@library.adam_step.register_kernel("cuda")
def _adam_step_in_torch_ops(w, g, m, v, scales, new_scales, hyperparams) -> torch.Tensor:
    """``torch.ops.fp8lm.adam_step`` off the CPU: the compiled `write_pass` per tensor, then the
    amaxes of what it stored."""
    for i, args in _op_rows(w, g, m, v, scales, hyperparams):
        fmts = (format_of(w[i].dtype), format_of(m[i].dtype), format_of(v[i].dtype))
        _compiled_or_eager(write_pass, *args, new_scales[i], fmts)
    return stored_amaxes([t for group in zip(w, m, v) for t in group]).view(len(w), 3)


@library.adam_amaxes.register_kernel("cuda")
def _adam_amaxes_in_torch_ops(w, g, m, v, scales, hyperparams) -> torch.Tensor:
    """``torch.ops.fp8lm.adam_amaxes`` off the CPU: the compiled `amaxes_pass` per tensor."""
    rows = [_compiled_or_eager(amaxes_pass, *args) for _, args in _op_rows(w, g, m, v, scales, hyperparams)]
    return torch.stack(rows) if rows else scales.new_empty((0, 3))


def stored_amaxes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Exact ``abs().amax()`` of each (non-empty) float tensor, as float32; NaN or inf where one is held.

    One vectorized reduction pass per tensor and no temporary. 2- and 4-byte floats: ``aminmax``.
    FP8 (torch has no float reductions for it, and its conversions are scalar on CPU): the bits are
    sign-magnitude, so the largest positive code is the max of the int8 view and the largest negative
    one the max of the uint8 view (less 128).
    """
    out = torch.empty(len(tensors), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, rows in by_dtype.items():
        if dtype.itemsize == 1:
            positive = torch.stack([tensors[i].view(torch.int8).max() for i in rows]).to(torch.int16)
            negative = torch.stack([tensors[i].view(torch.uint8).max() for i in rows]).to(torch.int16) - 128
            codes = torch.maximum(positive, negative).clamp(min=0)
            out[rows] = codes.to(torch.uint8).view(dtype).float()
        else:
            lo, hi = zip(*(torch.aminmax(tensors[i]) for i in rows))
            out[rows] = torch.maximum(torch.stack(hi).float(), -torch.stack(lo).float())
    return out


def _state_amaxes(slots: list[AdamSlot], use_native: bool) -> torch.Tensor:
    """The stored amaxes (n, 4: w, m, v, g payloads): those the slots know, the others measured
    (gradients are always new)."""
    payloads = [t for s in slots for t in s.step_payloads()]
    known = [a for s in slots for a in (*s.stored, None)]
    missing = [i for i, a in enumerate(known) if a is None]
    stored = torch.tensor([0.0 if a is None else a for a in known], dtype=torch.float32, device=slots[0].w.device)
    if missing:
        stored[missing] = (native.stored_amaxes if use_native else stored_amaxes)([payloads[i] for i in missing])
    return stored.view(len(slots), 4)


def _exact_amaxes(slots, rows, current, hyperparams, use_op: bool, kernel: str) -> torch.Tensor:
    """The exact amaxes of the new w, m, v of the slots at ``rows`` (n, 3), from a pass that writes nothing."""
    if use_op:
        w, g, m, v = zip(*((slots[i].w, slots[i].g, slots[i].m, slots[i].v) for i in rows))
        return torch.ops.fp8lm.adam_amaxes(w, g, m, v, current[rows][:, _OP_ORDER], hyperparams[rows])
    return torch.stack([run_pass(amaxes_pass, slots[i], kernel) for i in rows])


def _new_scales(slots: list[AdamSlot], bounds: torch.Tensor, previous: torch.Tensor, fmts) -> torch.Tensor:
    """Power-of-two scales (n, 3) for amaxes up to ``bounds``; a non-finite bound keeps the previous
    scale, and a plain (unscaled) weight keeps its scale of 1."""
    fmax = torch.tensor([[f.max for f in row] for row in fmts], dtype=torch.float32, device=bounds.device)
    unscaled = torch.tensor([not s.w_scaled for s in slots], device=bounds.device)
    bounds[:, 0] = torch.where(unscaled, torch.nan, bounds[:, 0])
    return pow2_scale(bounds, fmax, previous=previous)


def _write(slots, current, scales, hyperparams, fmts, use_op: bool, kernel: str) -> None:
    """Store every slot's new state with the new ``scales``; remember the stored amaxes where known."""
    if use_op:
        w, g, m, v = zip(*((s.w, s.g, s.m, s.v) for s in slots))
        written = torch.ops.fp8lm.adam_step(w, g, m, v, current[:, _OP_ORDER], scales, hyperparams)
        for s, a_w in zip(slots, written[:, 0].unbind()):
            s.written_w_amax = a_w if s.w_scaled else None
        if written.device.type == "cpu":  # elsewhere reading them back would be a host sync
            for s, (a_w, a_m, a_v) in zip(slots, written.tolist()):
                s.stored = (a_w, a_m, a_v)
            return
    else:
        for s, row, f in zip(slots, scales, fmts):
            run_pass(write_pass, s, kernel, row, f)
            s.written_w_amax = None
    for s in slots:
        s.stored = (None, None, None)


def fused_adam_step_(slots: list[AdamSlot], kernel: str = "auto") -> bool:
    """Update every slot in place in one pass per tensor, or nothing at all when any gradient or
    bound is non-finite. Returns True when the step was applied, False when it was skipped.
    ``kernel``: one of `KERNELS` (see the module docstring).

    The new scales come before the pass from a-priori bounds on the new amaxes (`amax_bounds`),
    built from the exact amaxes of the stored state and gradient (cheap integer reductions).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    if not slots:
        return True
    payloads = [t for s in slots for t in s.step_payloads()]
    use_native = kernel == "auto" and all(map(native.supports, payloads)) and native.available()
    use_op = use_native or (kernel == "auto" and all(t.device.type == "cuda" for t in payloads))
    stored = _state_amaxes(slots, use_native)
    current = torch.stack([t for s in slots for t in s.step_scales()]).view(-1, 4)
    hyperparams = torch.stack([s.step_hyperparams() for s in slots])
    max_ratio = torch.tensor([s.max_ratio for s in slots], device=hyperparams.device)
    bounds = amax_bounds(stored / current, hyperparams, max_ratio)
    # An FP8 second moment has too little range to give up a binade of it: its tensors take an exact
    # first pass for their new amaxes (measured: bounds cost accuracy there, docs/optimizer.md).
    exact = [i for i, s in enumerate(slots) if s.v.element_size() == 1]
    checked = [stored.view(-1), bounds[:, 1], bounds[:, 2]]
    if exact:
        exact_amaxes = _exact_amaxes(slots, exact, current, hyperparams, use_op, kernel)
        checked.append(exact_amaxes.view(-1))
    if not bool(torch.isfinite(torch.cat(checked)).all()):
        return False
    if exact:
        bounds[exact] = exact_amaxes
    fmts: list[tuple[Format, Format, Format]] = [s.formats() for s in slots]
    scales = _new_scales(slots, bounds, current[:, :3], fmts)
    _write(slots, current, scales, hyperparams, fmts, use_op, kernel)
    # The pass reads the old scales; all of them change only now, in one multi-tensor copy.
    old = [t for s in slots for t in s.step_scales()[:3]]
    torch._foreach_copy_(old, list(scales.reshape(-1).unbind()))
    return True
