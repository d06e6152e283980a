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

A DTensor parameter (FSDP2's shards) gets DTensor payloads laid out like it, so each rank stores
only its shard; scales stay plain 0-d tensors, one value for the whole tensor on every rank
(`fp8lm.optim.sharded` keeps them agreed).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..formats import Format, format_of
from ..ops.cast import saturating_cast
from ..scaling import compute_scale
from ..tensor import ScalingTensor
from .dtensor import local_tensor, mesh_reduce, sharded_like

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
    p = local_tensor(p)
    if isinstance(p, ScalingTensor):
        return p.payload.dtype == master_fmt.dtype
    return p.dtype == master_fmt.dtype or p.element_size() > master_fmt.bytes


def init_state(state: dict, p: torch.Tensor, group: dict) -> dict:
    """Fill an empty ``state`` of ``p`` with zero moments (and a master copy where ``p`` cannot be
    its own master) in the formats of its param ``group``; returns it."""
    m_fmt, v_fmt, master_fmt = (format_of(group[k]) for k in FORMAT_KEYS)
    local = local_tensor(p)
    dev = local.device
    state["step"] = 0
    state["exp_avg"] = sharded_like(torch.zeros(local.shape, dtype=m_fmt.dtype, device=dev), p)
    state["exp_avg_scale"] = torch.ones((), dtype=torch.float32, device=dev)
    state["exp_avg_sq"] = sharded_like(torch.zeros(local.shape, dtype=v_fmt.dtype, device=dev), p)
    state["exp_avg_sq_scale"] = torch.ones((), dtype=torch.float32, device=dev)
    if not param_is_master(p, master_fmt):
        value = local.detach().dequantize() if isinstance(local, ScalingTensor) else local.detach().float()
        scale = compute_scale(_whole_amax(value, p), master_fmt)
        state["master"] = sharded_like(saturating_cast(value, scale, master_fmt), p)
        state["master_scale"] = scale
    return state


def _whole_amax(local_value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The amax of the whole tensor of which ``local_value`` is this rank's part (0 when empty)."""
    local_amax = local_value.abs().amax() if local_value.numel() else local_value.new_zeros(())
    return mesh_reduce(local_amax.float(), p.device_mesh, "max") if isinstance(p, DTensor) else local_amax


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
    out: dict = {"step": int(saved["step"])}
    for key in expected:
        out[key] = _copy_laid_out_like(name, key, saved[key], p)
        out[key + "_scale"] = saved[key + "_scale"].to(local_tensor(p).device, torch.float32, copy=True)
    return out


def _copy_laid_out_like(name: str, key: str, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A copy of saved state tensor ``t`` on ``p``'s device, refused unless sharded as ``p`` is."""
    local, local_p = local_tensor(t), local_tensor(p)
    if isinstance(t, DTensor) != isinstance(p, DTensor) or local.shape != local_p.shape:
        raise ValueError(
            f"{name}.load_state_dict: state {key!r} holds {tuple(local.shape)} elements on this rank, its parameter "
            f"{tuple(local_p.shape)}; load sharded (FSDP2) state with "
            "torch.distributed.checkpoint.state_dict.set_state_dict, which lays it out like the parameters"
        )
    return sharded_like(local.to(local_p.device, copy=True), p)


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
