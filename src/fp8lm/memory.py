"""`memory_report`: the real storage bytes of a model's training state, by kind.

Counts what is allocated, not what the dtypes suggest: a ScalingTensor contributes its payload's
storage (and its scale, under ``scales``), and every storage is counted once, however many tensors
view it (tied weights, views into one flat buffer: the whole storage goes to the first tensor seen).
Of a DTensor (FSDP2's sharded parameters, their gradients and optimizer state) it counts this
rank's shard: on a rank, the report is that rank's bytes, and ``bytes_per_param`` divides them by
the whole model's parameter count.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .scaling import ScalingMeta
from .tensor import ScalingTensor

__all__ = ["memory_report", "REPORT_KEYS"]

# Kinds of storage, in the order of the report. ``buffers``: module buffers and other tensors a
# module holds as attributes; ``other``: optimizer state that is none of the named kinds (e.g. the
# step counters of torch's optimizers).
REPORT_KEYS = ("weights", "master_weights", "gradients", "exp_avg", "exp_avg_sq", "scales", "buffers", "other")

# Optimizer state keys -> report kind (fp8lm's optimizers and torch's Adam/AdamW).
_STATE_KINDS = {
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "master": "master_weights",
    "exp_avg_scale": "scales",
    "exp_avg_sq_scale": "scales",
    "master_scale": "scales",
}


class _Tally:
    """Bytes per kind, each storage counted once."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(REPORT_KEYS, 0)
        self._seen: set[tuple[torch.device, int]] = set()

    def add(self, kind: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        if isinstance(t, DTensor):  # an FSDP2 shard: this rank holds (and counts) its local part
            t = t.to_local()
        if isinstance(t, ScalingTensor):
            self.add(kind, t.payload)
            self.add("scales", t.scale)
            return
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.data_ptr() != 0 and key in self._seen:
            return
        self._seen.add(key)
        self.bytes[kind] += storage.nbytes()


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Storage bytes of ``model``'s parameters, gradients, buffers and FP8 scaling state, and of
    ``optimizer``'s state, as they exist when called: gradients freed by ``zero_grad()`` count 0
    (call it after ``backward()`` for the training state with gradients; activations are not counted).

    Returns a dict with the bytes of ``weights``, ``master_weights`` (optimizer-held masters; 0 when
    the weights are the masters), ``gradients``, ``exp_avg``, ``exp_avg_sq``, ``scales`` (of
    ScalingTensors, optimizer state and the FP8 layers' scaling state), ``buffers``, ``other``, their
    ``total``, ``num_params`` (elements of the model's distinct parameters) and
    ``bytes_per_param`` (``total / num_params``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memory_report expects an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"memory_report's optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    tally = _Tally()
    params = list(model.parameters())  # distinct Parameter objects: tied weights appear once
    param_ids = {id(p) for p in params}
    for p in params:
        tally.add("weights", p)
        tally.add("gradients", p.grad)
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in param_ids:
                tally.add("buffers", value)
        kind = "scales" if isinstance(module, ScalingMeta) else "buffers"  # an FP8 layer's scaling state
        for buf in module._buffers.values():
            tally.add(kind, buf)
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tally.add(_STATE_KINDS.get(key, "other"), value)
    report: dict = dict(tally.bytes)
    report["total"] = sum(tally.bytes.values())
    report["num_params"] = sum(p.numel() for p in params)
    report["bytes_per_param"] = report["total"] / max(report["num_params"], 1)
    return report
