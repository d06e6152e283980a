"""The per-parameter state of `FP8Adam`/`FP8AdamW`: its layout, and the checks of param groups and
saved state.

Layout per parameter (FP8-LM level 2, 6 bytes/param with an FP8 gradient):

- master weight: the parameter itself when it already stores ``master_dtype`` (a ScalingTensor with
  an FP16 payload under O2, updated in place: payload and scale), or when it is a plain tensor at
  least as precise as the master (an FP32 parameter stays FP32: a coarser copy could only lose
  precision and would cost memory). Otherwise (e.g. a BF16 parameter with an FP16 master, or an FP8
  weight) the optimizer keeps ``state["master"]`` and writes the result back to the parameter.
- ``exp_avg``: ``exp_avg_dtype`` payload (E4M3 by default) with a power-of-two scale.
- ``exp_avg_sq``: ``exp_avg_sq_dtype`` payload (FP16 by default; E4M3 or E5M2 for about 5 bytes per
  parameter) with a power-of-two scale. Where a stored ``v`` underflows to 0, ``m`` is zeroed too
  (see `fp8lm.optim.fused.write_pass`); docs/optimizer.md compares this with storing ``sqrt(v)``,
  which measured worse.

All state is plain tensors (payload ``state[k]``, float32 ``state[k + "_scale"]``) and the int
``state["step"]``, so an optimizer's ``state_dict()`` loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import torch

from ..formats import Format, format_of
from ..ops.cast import saturating_cast
from ..scaling import compute_scale
from ..tensor import ScalingTensor

__all__ = [
    "FORMAT_KEYS",
    "MASTER_FORMATS",
    "init_state",
    "param_is_master",
    "checked_state",
    "validate_group",
    "check_param_dtype",
]

MASTER_FORMATS = ("FP16", "BF16", "FP32")
FORMAT_KEYS = ("exp_avg_dtype", "exp_avg_sq_dtype", "master_dtype")


def param_is_master(p: torch.Tensor, master_fmt: Format) -> bool:
    """Whether the parameter itself can serve as the master weight (see the module docstring)."""
    if isinstance(p, ScalingTensor):
        return p.payload.dtype == master_fmt.dtype
    return p.dtype == master_fmt.dtype or p.element_size() > master_fmt.bytes


def init_state(state: dict, p: torch.Tensor, group: dict) -> dict:
    """Fill an empty ``state`` of ``p`` with zero moments (and a master copy where ``p`` cannot be
    its own master) in the formats of its param ``group``; returns it."""
    m_fmt, v_fmt, master_fmt = (format_of(group[k]) for k in FORMAT_KEYS)
    dev = p.device
    state["step"] = 0
    state["exp_avg"] = torch.zeros(p.shape, dtype=m_fmt.dtype, device=dev)
    state["exp_avg_scale"] = torch.ones((), dtype=torch.float32, device=dev)
    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=v_fmt.dtype, device=dev)
    state["exp_avg_sq_scale"] = torch.ones((), dtype=torch.float32, device=dev)
    if not param_is_master(p, master_fmt):
        value = p.detach().dequantize() if isinstance(p, ScalingTensor) else p.detach().float()
        scale = compute_scale(value.abs().amax(), master_fmt)
        state["master"] = saturating_cast(value, scale, master_fmt)
        state["master_scale"] = scale
    return state


def checked_state(name: str, saved: dict, p: torch.Tensor, group: dict) -> dict:
    """A copy of one parameter's saved state on ``p``'s device, after checking it fits ``p``
    (``name``: the optimizer's class name, for the errors)."""
    m_fmt, v_fmt, master_fmt = (format_of(group[k]) for k in FORMAT_KEYS)
    expected = {"exp_avg": m_fmt.dtype, "exp_avg_sq": v_fmt.dtype}
    if not param_is_master(p, master_fmt):
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


def validate_group(name: str, group: dict) -> None:
    """Raise a ValueError naming what is wrong with a param group's hyper-parameters or formats."""
    missing = [k for k in ("lr", "betas", "eps", "weight_decay", *FORMAT_KEYS) if k not in group]
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
    if master.name not in MASTER_FORMATS:
        raise ValueError(f"{name}: master_dtype must be one of {', '.join(MASTER_FORMATS)}, got {master!r}")


def check_param_dtype(name: str, p: object) -> None:
    """Raise a TypeError unless ``p`` is a float32, float16 or bfloat16 tensor."""
    if not isinstance(p, torch.Tensor) or p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        what = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
        raise TypeError(f"{name} optimizes float32, float16 or bfloat16 parameters, got {what}")
