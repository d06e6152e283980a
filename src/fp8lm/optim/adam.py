"""FP8 Adam/AdamW: FP8 first moment, FP16 second moment and FP16 master weight, each with a scale.

Layout per parameter (FP8-LM level 2, 6 bytes/param with an FP8 gradient):

- master weight: the parameter itself when it already stores ``master_dtype`` (a ScalingTensor with
  an FP16 payload under O2, updated in place: payload and scale), or when it is a plain tensor at
  least as precise as the master (an FP32 parameter stays FP32: a coarser copy could only lose
  precision and would cost memory). Otherwise (e.g. a BF16 parameter with an FP16 master, or an FP8
  weight) the optimizer keeps ``state["master"]`` and writes the result back to the parameter.
- ``exp_avg``: ``exp_avg_dtype`` payload (E4M3 by default) with a power-of-two scale.
- ``exp_avg_sq``: ``exp_avg_sq_dtype`` payload (FP16 by default; E4M3 or E5M2 for about 5 bytes per
  parameter) with a power-of-two scale. Where a stored ``v`` underflows to 0, ``m`` is zeroed too
  (see `_write_pass`); docs/optimizer.md compares this with storing ``sqrt(v)``, which measured worse.

All state is plain tensors (payload ``state[k]``, float32 ``state[k + "_scale"]``), so the optimizer's
``state_dict()`` loads with ``torch.load(weights_only=True)``.

The step is fused per tensor in one pass over the low-precision state, never materializing the FP32
state of the model. Its new scales are set before the pass, from a-priori bounds on the new amaxes
(`fused_adam_step_`) built from the exact amaxes of the stored state and gradients (`stored_amaxes`,
integer reductions) and Adam's bound on its update ratio (`adam_ratio_bound`); the pass dequantizes,
updates and writes the state requantized. Tensors with an FP8 second moment first take an exact
amax pass (its range is too small to give up a binade). A non-finite gradient or bound anywhere is
found before anything is written, and the step is skipped as a whole. On CPUs the passes over all
tensors are one call into fp8lm's C kernel (`fp8lm.optim.native`), which also measures the amaxes
of what it stores so the next step need not re-read the state; elsewhere they are
`torch.compile`-d per tensor (dynamic shapes: one graph per combination of dtypes, whatever the
tensor sizes); ``compiled=False`` runs them eagerly on bounded chunks. docs/optimizer.md has the
reasoning and the measurements.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..formats import E4M3, FP16, Format, format_of
from ..ops.cast import saturating_cast
from ..scaling import compute_scale, pow2_scale
from ..tensor import ScalingTensor
from . import native

__all__ = ["FP8Adam", "FP8AdamW", "adam_update", "adam_ratio_bound", "AdamSlot", "fused_adam_step_", "stored_amaxes"]

logger = logging.getLogger(__name__)

_MASTER_FORMATS = ("FP16", "BF16", "FP32")
_FORMAT_KEYS = ("exp_avg_dtype", "exp_avg_sq_dtype", "master_dtype")
# Elements per chunk of the eager path: its FP32 temporaries stay in the CPU caches and bounded.
_EAGER_CHUNK = 1 << 16


def adam_update(w, g, m, v, lr, beta1, beta2, eps, decay, l2, bias_correction1, bias_correction2_sqrt):
    """One Adam step on dequantized values: returns the new ``(w, m, v)``.

    ``decay = 1 - lr * weight_decay`` with ``l2 = 0`` is AdamW's decoupled decay; ``decay = 1`` with
    ``l2 = weight_decay`` is Adam's L2 penalty. Same operation order as ``torch.optim.AdamW``.
    Works on tensors of any float dtype (float64 in the tests) and on scalars or 0-d tensors.
    """
    g = g + l2 * w
    w = w * decay
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    # Scalar reciprocals: one vector division per element (m / denom) instead of three.
    denom = v.sqrt() * (1 / bias_correction2_sqrt) + eps
    w = w - (lr / bias_correction1) * (m / denom)
    return w, m, v


def adam_ratio_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` Adam reaches at ``step`` (1-based) for any gradients, in
    exact arithmetic; ``inf`` where there is none (``beta2 = 0 < beta1``).

    Cauchy-Schwarz on ``m_t = (1-b1) sum_k b1^k g_(t-k)`` against ``v_t = (1-b2) sum_k b2^k g_(t-k)^2``
    gives ``m_t^2 <= (1-b1)^2 / (1-b2) * S_t * v_t`` with ``S_t = sum_(k<t) (b1^2/b2)^k``, reached by
    gradients proportional to ``(b1/b2)^k``; bias correction multiplies the ratio by
    ``sqrt(1 - b2^t) / (1 - b1^t)``. For the default betas it grows from 1 (step 1) to about 7.3.
    """
    if beta1 == 0.0:
        series = 1.0
    elif beta2 == 0.0:
        series = 1.0 if step == 1 else math.inf
    else:
        r = beta1 * beta1 / beta2
        try:
            series = step if r == 1.0 else (1.0 - r**step) / (1.0 - r)
        except OverflowError:
            series = math.inf
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(series) * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def _updated(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hp):
    """Dequantize one tensor's state and apply `adam_update`."""
    # Multiplying by 1/scale is exact (a power of two) and much cheaper than dividing.
    return adam_update(
        w.float() * (1 / w_scale), g.float() * (1 / g_scale), m.float() * (1 / m_scale), v.float() * (1 / v_scale),
        *hp.unbind(),
    )


def _amaxes_pass(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hp):
    """The exact amaxes of the new weight, first and second moment, as a (3,) tensor (for an FP8
    second moment, see `fused_adam_step_`). A non-finite input makes its amax non-finite."""
    w_new, m_new, v_new = _updated(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hp)
    return torch.stack([w_new.abs().amax(), m_new.abs().amax(), v_new.abs().amax()])


def _write_pass(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hp, scales, fmts):
    """Compute the new values and store them in place, requantized with the new ``scales`` (weight,
    m, v)."""
    w_new, m_new, v_new = _updated(w, w_scale, g, g_scale, m, m_scale, v, v_scale, hp)
    w_fmt, m_fmt, v_fmt = fmts
    # An element whose second moment underflows to 0 loses its first moment too: otherwise the next
    # step would divide a surviving m by eps alone and take a step far larger than lr. v >= 0 rounds
    # to 0 exactly when v * scale <= half the smallest subnormal (a tie rounds to the even 0); the
    # comparison needs no round trip through the storage format.
    m_new = torch.where(v_new * scales[2] <= v_fmt.min_subnormal / 2, 0.0, m_new)
    w.copy_(saturating_cast(w_new, scales[0], w_fmt))
    m.copy_(saturating_cast(m_new, scales[1], m_fmt))
    v.copy_(saturating_cast(v_new, scales[2], v_fmt))


_compiled_passes: dict[Callable, Callable] = {}
_compile_works = True
# Inductor by default stores an intermediate to memory once it has many reads or ops (an FP32
# buffer the size of the tensor). The pass is elementwise: everything stays in registers.
_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 1 << 20, "realize_reads_threshold": 1 << 20,
                     "realize_acc_reads_threshold": 1 << 20}


def _compiled(fn: Callable) -> Callable:
    if fn not in _compiled_passes:
        _compiled_passes[fn] = torch.compile(fn, dynamic=True, fullgraph=True, options=_INDUCTOR_OPTIONS)
    return _compiled_passes[fn]


def _call(fn: Callable, compiled: bool, *args, **kwargs):
    """``fn`` compiled when asked and possible; where compilation fails (no C++ compiler, say),
    warn once and run it eagerly from then on: the results are the same, only slower."""
    global _compile_works
    if compiled and _compile_works:
        try:
            return _compiled(fn)(*args, **kwargs)
        except Exception as err:  # compilation is an optimization: any failure falls back to eager
            _compile_works = False
            warnings.warn(f"fp8lm: compiled optimizer step unavailable ({type(err).__name__}: {err}); using eager ops")
    return fn(*args, **kwargs)


@dataclass
class AdamSlot:
    """One tensor's optimizer state as flat (1-D, contiguous) payloads with 0-d float32 scales.

    ``w`` is the master weight; ``w_scaled`` False means a plain tensor whose scale stays 1.
    ``g_scale`` is 1 for a plain gradient. ``hp`` holds `adam_update`'s hyper-parameters in its
    argument order up to ``bias_correction2_sqrt`` (a tensor, so that a changing lr or step never
    recompiles). ``max_ratio`` is the bound on ``|m / denom|`` that sets the new weight's scale (twice
    `adam_ratio_bound` times ``bias_correction1``; inf for none beyond ``|m| / eps``); an element
    beyond it saturates at the weight's range. Scales are updated in place.

    ``stored`` optionally gives the amaxes of the stored ``w``, ``m``, ``v`` payloads when the caller
    knows them (None for one to be measured); after a step, `fused_adam_step_` sets it to the
    amaxes of what it stored where it knows them (the native kernel measures them as it writes).
    """

    w: torch.Tensor
    w_scale: torch.Tensor
    w_scaled: bool
    g: torch.Tensor
    g_scale: torch.Tensor
    m: torch.Tensor
    m_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    hp: torch.Tensor
    max_ratio: float = math.inf
    stored: tuple[float | None, float | None, float | None] = (None, None, None)

    def pass_args(self) -> tuple:
        return (self.w, self.w_scale, self.g, self.g_scale, self.m, self.m_scale, self.v, self.v_scale, self.hp)

    def formats(self) -> tuple[Format, Format, Format]:
        return format_of(self.w.dtype), format_of(self.m.dtype), format_of(self.v.dtype)


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


_BOUND_SLACK = 1 + 2.0**-16  # covers FP32 rounding in the kernel, far below any format's resolution


def fused_adam_step_(slots: list[AdamSlot], compiled: bool = True) -> bool:
    """Update every slot in place in one pass per tensor, or nothing at all when any gradient or
    bound is non-finite. Returns True when the step was applied, False when it was skipped.

    The new scales come before the pass from a-priori bounds on the new amaxes, built from the exact
    amaxes of the stored state and gradient (cheap integer reductions): ``|m'| <= b1 |m| + (1-b1) |g|``,
    ``v' <= b2 v + (1-b2) g^2``, ``|w'| <= decay |w| + lr / bc1 * max_ratio`` (see docs/optimizer.md).
    """
    if not slots:
        return True
    n = len(slots)
    payloads = [t for s in slots for t in (s.w, s.m, s.v, s.g)]
    use_native = compiled and all(map(native.supports, payloads)) and native.available()
    # Measure only the amaxes the slots do not know already (gradients are always new).
    known = [a for s in slots for a in (*s.stored, None)]
    missing = [i for i, a in enumerate(known) if a is None]
    stored = torch.tensor([0.0 if a is None else a for a in known], dtype=torch.float32, device=slots[0].w.device)
    if missing:
        stored[missing] = (native.stored_amaxes if use_native else stored_amaxes)([payloads[i] for i in missing])
    stored = stored.view(n, 4)
    current = torch.stack([t for s in slots for t in (s.w_scale, s.m_scale, s.v_scale, s.g_scale)]).view(n, 4)
    a_w, a_m, a_v, a_g = (stored / current).unbind(1)
    hp = torch.stack([s.hp for s in slots])
    lr, beta1, beta2, eps, decay, l2, bc1, _ = hp.unbind(1)
    native_scales = current[:, [0, 3, 1, 2]]  # the kernel's order: w, g, m, v
    g_bound = a_g + l2 * a_w
    m_bound = (beta1 * a_m + (1 - beta1) * g_bound) * _BOUND_SLACK
    v_bound = (beta2 * a_v + (1 - beta2) * g_bound * g_bound) * _BOUND_SLACK
    # An FP8 second moment has too little range to give up a binade of it: its tensors take an exact
    # first pass for their new amaxes (measured: bounds cost accuracy there, docs/optimizer.md).
    exact = [i for i, s in enumerate(slots) if s.v.element_size() == 1]
    if exact and use_native:
        exact_amaxes = native.adam_pass(
            [(slots[i].w, slots[i].g, slots[i].m, slots[i].v) for i in exact],
            native_scales[exact], current[exact, :3], hp[exact], write=False,
        )
    elif exact:
        exact_amaxes = torch.stack([_run(_amaxes_pass, slots[i], compiled) for i in exact])
    checked = [stored.view(-1), m_bound, v_bound] + ([exact_amaxes.view(-1)] if exact else [])
    if not bool(torch.isfinite(torch.cat(checked)).all()):
        return False
    # |m / denom| <= |m| / eps as well: a finite bound even without Adam's (beta2 = 0).
    eps_ratio = torch.where(eps > 0, m_bound / eps, math.inf)
    max_ratio = torch.minimum(torch.tensor([s.max_ratio for s in slots], device=eps.device), eps_ratio)
    # A non-finite weight bound (none exists: beta2 = 0 and eps = 0) keeps the previous scale.
    w_bound = (decay * a_w + lr / bc1 * max_ratio) * _BOUND_SLACK
    bounds = torch.stack([w_bound, m_bound, v_bound], dim=1)
    if exact:
        bounds[exact] = exact_amaxes
    previous = current[:, :3]
    fmts = [s.formats() for s in slots]
    fmax = torch.tensor([[f.max for f in row] for row in fmts], dtype=torch.float32, device=bounds.device)
    # A plain (unscaled) weight keeps its scale of 1: its bound is made invalid.
    unscaled = torch.tensor([not s.w_scaled for s in slots], device=bounds.device)
    bounds[:, 0] = torch.where(unscaled, math.nan, bounds[:, 0])
    scales = pow2_scale(bounds, fmax, previous=previous)
    if use_native:
        written = native.adam_pass([(s.w, s.g, s.m, s.v) for s in slots], native_scales, scales, hp, write=True)
        for s, amaxes in zip(slots, written.tolist()):
            s.stored = tuple(amaxes)
    else:
        for s, row, f in zip(slots, scales, fmts):
            _run(_write_pass, s, compiled, row, f)
            s.stored = (None, None, None)
    # The pass reads the old scales; all of them change only now, in one multi-tensor copy.
    old = [t for s in slots for t in (s.w_scale, s.m_scale, s.v_scale)]
    torch._foreach_copy_(old, list(scales.reshape(-1).unbind()))
    return True


def _run(fn: Callable, s: AdamSlot, compiled: bool, *extra):
    """Run a pass on a whole slot (compiled) or on bounded chunks of it (eager)."""
    w, w_scale, g, g_scale, m, m_scale, v, v_scale, hp = s.pass_args()
    n = w.numel()
    if compiled and _compile_works or n <= _EAGER_CHUNK:
        return _call(fn, compiled, w, w_scale, g, g_scale, m, m_scale, v, v_scale, hp, *extra)
    outs = []
    for a in range(0, n, _EAGER_CHUNK):
        b = a + _EAGER_CHUNK
        outs.append(fn(w[a:b], w_scale, g[a:b], g_scale, m[a:b], m_scale, v[a:b], v_scale, hp, *extra))
    return None if outs[0] is None else torch.stack(outs).amax(dim=0)


@dataclass
class _ParamSlot:
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
    def _sources(p: torch.Tensor, state: dict) -> tuple:
        if "master" in state:
            return state["master"], state["master_scale"], True
        if isinstance(p, ScalingTensor):
            return p.payload, p.scale, True
        return None, None, False

    @classmethod
    def build(cls, p: torch.Tensor, state: dict, staged: list) -> "_ParamSlot":
        w_base, w_scale, w_scaled = cls._sources(p, state)
        w = w_base if w_base is not None else p.data
        cacheable = w.is_contiguous()
        if not cacheable:  # updated on a contiguous copy, written back after the step
            staged.append((w, w := w.contiguous()))
        m, v = state["exp_avg"], state["exp_avg_sq"]
        slot = AdamSlot(
            w=w.view(-1), w_scale=w_scale, w_scaled=w_scaled,
            g=None, g_scale=None, m=m.view(-1), m_scale=state["exp_avg_scale"],
            v=v.view(-1), v_scale=state["exp_avg_sq_scale"], hp=None,
        )
        return cls(slot, (w_base, m, v), (w_scale, slot.m_scale, slot.v_scale), p.data_ptr(), cacheable)

    def holds(self, p: torch.Tensor, state: dict) -> bool:
        w_base, w_scale, w_scaled = self._sources(p, state)
        return (
            w_base is self.bases[0] and (not w_scaled or w_scale is self.scales[0])
            and state["exp_avg"] is self.bases[1] and state["exp_avg_sq"] is self.bases[2]
            and state["exp_avg_scale"] is self.scales[1] and state["exp_avg_sq_scale"] is self.scales[2]
            and p.data_ptr() == self.data_ptr
        )

    def known_amaxes(self) -> tuple:
        stored = self.slot.stored
        if self.versions is None:
            return None, None, None
        return tuple(
            a if b is not None and b._version == version else None
            for a, b, version in zip(stored, self.bases, self.versions)
        )

    def remember_versions(self) -> None:
        self.versions = tuple(b._version if b is not None else None for b in self.bases)


# -- the Optimizer classes ----------------------------------------------------------------------


class _FP8AdamBase(torch.optim.Optimizer):
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
        compiled: bool = True,
    ):
        """``weight_decay=None`` is the class's default: 1e-2 for FP8AdamW (as torch's AdamW), 0 for
        FP8Adam. ``compiled=False`` runs the same step eagerly in bounded chunks."""
        if weight_decay is None:
            weight_decay = self.default_weight_decay
        name = type(self).__name__
        if amsgrad:
            raise ValueError(f"{name} does not support amsgrad=True; use torch.optim.{name[3:]} for AMSGrad")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype, master_dtype=master_dtype,
        )
        _validate_group(name, defaults)
        # Formats by name, so that param groups (and the state_dict) hold only plain values.
        defaults.update({k: format_of(defaults[k]).name for k in _FORMAT_KEYS})
        self.compiled = compiled
        self.skipped_steps = 0
        self.last_step_skipped = False
        # parameter -> its slot, kept across steps while the same tensors hold its state (see _ParamSlot).
        self._param_slots: dict[torch.Tensor, _ParamSlot] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyper-parameters and formats are validated first (formats stored as names)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"a param group must be a dict, got {type(param_group).__name__}")
        group = {**self.defaults, **param_group}
        group.pop("params", None)
        _validate_group(type(self).__name__, group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            _check_param_dtype(type(self).__name__, p)
        normalized = dict(param_group, params=params)
        for key in _FORMAT_KEYS:
            if key in normalized:
                normalized[key] = format_of(normalized[key]).name
        super().add_param_group(normalized)

    # -- state ----------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if state:
            return state
        m_fmt, v_fmt, master_fmt = (format_of(group[k]) for k in _FORMAT_KEYS)
        dev = p.device
        state["step"] = 0
        state["exp_avg"] = torch.zeros(p.shape, dtype=m_fmt.dtype, device=dev)
        state["exp_avg_scale"] = torch.ones((), dtype=torch.float32, device=dev)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=v_fmt.dtype, device=dev)
        state["exp_avg_sq_scale"] = torch.ones((), dtype=torch.float32, device=dev)
        if not _param_is_master(p, master_fmt):
            value = p.detach().dequantize() if isinstance(p, ScalingTensor) else p.detach().float()
            scale = compute_scale(value.abs().amax(), master_fmt)
            state["master"] = saturating_cast(value, scale, master_fmt)
            state["master_scale"] = scale
        return state

    def _slot(self, p: torch.Tensor, group: dict, state: dict, staged: list, hps: dict) -> AdamSlot:
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; use torch.optim.SparseAdam")
        if grad.shape != p.shape:
            raise RuntimeError(f"gradient of shape {tuple(grad.shape)} does not match its parameter {tuple(p.shape)}")
        step = state["step"] + 1
        key = (id(group), step, p.device)  # parameters of a group at the same step share one vector
        if key not in hps:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            decay, l2 = (1 - lr * wd, 0.0) if self.decoupled_weight_decay else (1.0, wd)
            hp = torch.tensor(
                [lr, beta1, beta2, group["eps"], decay, l2, 1 - beta1**step, math.sqrt(1 - beta2**step)],
                dtype=torch.float32, device=p.device,
            )
            # Twice Adam's own bound: room for the rounding of the stored m and v; never reached in practice.
            hps[key] = hp, 2 * (1 - beta1**step) * adam_ratio_bound(beta1, beta2, step)
        entry = self._param_slots.get(p)
        if entry is None or not entry.holds(p, state):
            entry = _ParamSlot.build(p, state, staged)
            if entry.cacheable:
                self._param_slots[p] = entry
        slot = entry.slot
        if ("one", p.device) not in hps:  # the scale of plain tensors, shared by the step's slots
            hps["one", p.device] = torch.ones((), dtype=torch.float32, device=p.device)
        one = hps["one", p.device]
        if not slot.w_scaled:
            slot.w_scale = one
        if isinstance(grad, ScalingTensor):
            slot.g, slot.g_scale = grad.payload.reshape(-1), grad.scale
        else:
            slot.g, slot.g_scale = grad.reshape(-1), one
        slot.hp, slot.max_ratio = hps[key]
        slot.stored = entry.known_amaxes()
        return slot

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One fused step over all parameters with a gradient; skipped as a whole (and counted in
        ``skipped_steps``, flagged in ``last_step_skipped``) when any gradient is non-finite."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, slots, staged, hps = [], [], [], {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                state = self._init_state(p, group)
                slots.append(self._slot(p, group, state, staged, hps))
                params.append(p)
        try:
            applied = fused_adam_step_(slots, compiled=self.compiled)
        finally:
            for slot in slots:  # cached slots keep nothing of this step alive (gradients, temporaries)
                slot.g = slot.g_scale = slot.hp = None
                if not slot.w_scaled:
                    slot.w_scale = None
        self.last_step_skipped = not applied
        if not applied:
            self.skipped_steps += 1
            logger.warning(
                "%s: non-finite gradient, step skipped (no parameter or state changed); %d skipped so far",
                type(self).__name__, self.skipped_steps,
            )
            return loss
        for original, contiguous in staged:
            original.copy_(contiguous)
        for p in params:
            entry = self._param_slots.get(p)
            if entry is not None:
                entry.remember_versions()
        for p in params:
            state = self.state[p]
            state["step"] += 1
            if "master" in state:
                value = state["master"].float() / state["master_scale"]
                p.data.copy_(value) if not isinstance(p, ScalingTensor) else p.copy_(value)
        return loss

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors (payloads and scales separately) and numbers: loads with weights_only=True."""
        out = super().state_dict()
        out["skipped_steps"] = self.skipped_steps
        return out

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
            _validate_group(name, {k: v for k, v in saved.items() if k != "params"})
            for pid, p in zip(saved["params"], group["params"]):
                if pid in state_dict["state"]:
                    loaded[p] = _checked_state(name, state_dict["state"][pid], p, saved)
        super().load_state_dict({**state_dict, "state": {}})
        for p, state in loaded.items():
            self.state[p] = state
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))


class FP8AdamW(_FP8AdamBase):
    """AdamW (decoupled weight decay) with FP8 first moment, FP16 second moment and FP16 master
    weight by default; see the module docstring for the layout and `docs/optimizer.md`."""

    decoupled_weight_decay = True
    default_weight_decay = 1e-2


class FP8Adam(_FP8AdamBase):
    """Adam (weight decay as an L2 penalty on the gradient) with FP8/FP16 state like `FP8AdamW`."""

    decoupled_weight_decay = False
    default_weight_decay = 0.0


# -- validation ---------------------------------------------------------------------------------


def _validate_group(name: str, group: dict) -> None:
    missing = [k for k in ("lr", "betas", "eps", "weight_decay", *_FORMAT_KEYS) if k not in group]
    if missing:
        raise ValueError(f"{name}: param group lacks {missing}; is this state from another optimizer?")
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    if isinstance(lr, torch.Tensor) or not lr >= 0:
        raise ValueError(f"{name}: lr must be a float >= 0, got {lr!r}")
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps!r}")
    if not wd >= 0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {wd!r}")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {betas!r}")
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        format_of(group[key])  # raises a ValueError naming the valid formats
    master = format_of(group["master_dtype"])
    if master.name not in _MASTER_FORMATS:
        raise ValueError(f"{name}: master_dtype must be one of {', '.join(_MASTER_FORMATS)}, got {master!r}")


def _check_param_dtype(name: str, p: torch.Tensor) -> None:
    if not isinstance(p, torch.Tensor) or p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        what = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
        raise TypeError(f"{name} optimizes float32, float16 or bfloat16 parameters, got {what}")


def _param_is_master(p: torch.Tensor, master_fmt: Format) -> bool:
    """Whether the parameter itself can serve as the master weight (see the module docstring)."""
    if isinstance(p, ScalingTensor):
        return p.payload.dtype == master_fmt.dtype
    return p.dtype == master_fmt.dtype or p.element_size() > master_fmt.bytes


def _checked_state(name: str, saved: dict, p: torch.Tensor, group: dict) -> dict:
    """A copy of one parameter's saved state on ``p``'s device, after checking it fits ``p``."""
    m_fmt, v_fmt, master_fmt = (format_of(group[k]) for k in _FORMAT_KEYS)
    expected = {"exp_avg": m_fmt.dtype, "exp_avg_sq": v_fmt.dtype}
    if not _param_is_master(p, master_fmt):
        expected["master"] = master_fmt.dtype
    missing = [k for k in ("step", *expected, *(k + "_scale" for k in expected)) if k not in saved]
    if missing:
        raise ValueError(f"{name}.load_state_dict: parameter state lacks {missing}; is this an {name} checkpoint?")
    for key, dtype in expected.items():
        t = saved[key]
        if t.dtype != dtype or t.shape != p.shape:
            raise ValueError(
                f"{name}.load_state_dict: state {key!r} is {t.dtype} of shape {tuple(t.shape)}, expected {dtype} "
                f"of shape {tuple(p.shape)}; load into an optimizer over the same model with the same formats"
            )
    out = {"step": int(saved["step"])}
    for key in expected:
        out[key] = saved[key].to(p.device, copy=True)
        out[key + "_scale"] = saved[key + "_scale"].to(p.device, torch.float32, copy=True)
    return out
