"""`memory_report`: the real storage bytes of a model's training state, by kind; `PeakMemory`:
the most bytes that tensors held at once while a block of code ran.

Counts what is allocated, not what the dtypes suggest: a ScalingTensor contributes its payload's
storage (and its scale, under ``scales``), and every storage is counted once, however many tensors
view it (tied weights, views into one flat buffer: the whole storage goes to the first tensor seen).
Of a DTensor (FSDP2's sharded parameters, their gradients and optimizer state) it counts this
rank's shard: on a rank, the report is that rank's bytes, and ``bytes_per_param`` divides them by
the whole model's parameter count.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from .scaling import ScalingMeta
from .tensor import ScalingTensor

__all__ = ["memory_report", "REPORT_KEYS", "PeakMemory"]

# Kinds of storage, in the order of the report. ``weight_operands``: the GEMM operands that FP8
# layers keep of their weights between forwards (``kept_operands()``); ``buffers``: module buffers
# and other tensors a module holds as attributes; ``other``: optimizer state that is none of the
# named kinds (e.g. the step counters of torch's optimizers).
REPORT_KEYS = (
    "weights",
    "master_weights",
    "gradients",
    "exp_avg",
    "exp_avg_sq",
    "scales",
    "weight_operands",
    "buffers",
    "other",
)

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
        if is_traceable_wrapper_subclass(t):  # another wrapper (an FP32 weight FSDP2 gathers in FP8): its tensors
            for name in t.__tensor_flatten__()[0]:
                self.add(kind, getattr(t, name))
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
    ScalingTensors, optimizer state and the FP8 layers' scaling state), ``weight_operands`` (the
    GEMM operands FP8 layers keep of their weights between forwards on an FP8 GEMM backend),
    ``buffers``, ``other``, their
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
        kept_operands = getattr(module, "kept_operands", None)  # an FP8 layer's (duck-typed: nn is a higher layer)
        for t in kept_operands() if callable(kept_operands) else ():
            tally.add("weight_operands", t)
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


def _plain_storages(t: torch.Tensor):
    """The plain storages under ``t``: a wrapper subclass (a ScalingTensor, a DTensor) is those of
    its inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _plain_storages(inner)
        return
    if t.device.type != "meta":
        yield t.untyped_storage()


class _LiveStorages(TorchDispatchMode):
    """Counts the bytes of the storages that ops create (an op's outputs that alias none of its
    inputs) for as long as they live, and the most at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._tracked: dict[int, weakref.finalize] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for s in _plain_storages(t)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for storage in _plain_storages(t):
                    key = id(storage)
                    if key not in inputs and key not in self._tracked:
                        nbytes = storage.nbytes()
                        self._tracked[key] = weakref.finalize(storage, self._free, key, nbytes)
                        self.live += nbytes
                        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.pop(key, None)
        self.live -= nbytes

    def stop(self) -> None:
        for finalizer in self._tracked.values():
            finalizer.detach()
        self._tracked.clear()


class PeakMemory:
    """Context manager: ``peak``, the most bytes that tensors allocated inside the block held at
    once, and ``total``, that plus what was allocated before it (``baseline`` bytes, given).

    On CUDA from the caching allocator's statistics (``torch.cuda.max_memory_allocated``, which
    counts everything allocated on the device: ``total`` is the device's peak and ``baseline`` is
    not used). Elsewhere, where there are no allocator statistics, a dispatch mode follows every
    storage an op creates until it is freed: a kernel's scratch memory inside one op, storages
    resized in place (FSDP2 frees its gathered parameters so) and allocations on other threads
    are not seen; it slows the block down, so time nothing under it."""

    def __init__(self, device: torch.device | str, baseline: int = 0) -> None:
        self.device = torch.device(device)
        self.baseline = baseline
        self.peak = 0
        self.total = 0
        self._mode: _LiveStorages | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveStorages()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is None:
            torch.cuda.synchronize(self.device)
            self.total = torch.cuda.max_memory_allocated(self.device)
            self.peak = self.total - self._start
            return
        self._mode.__exit__(*exc)
        self._mode.stop()
        self.peak = self._mode.peak
        self.total = self.baseline + self.peak
        self._mode = None
