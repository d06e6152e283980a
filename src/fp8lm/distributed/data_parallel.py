"""`FP8DataParallel`: DDP-like data parallelism whose gradient all-reduce sends FP8.

Gradients are grouped into buckets (reverse registration order, about the order backward
produces them). A post-accumulate-grad hook marks a parameter ready; when a whole bucket is
ready its FP8 payloads go out asynchronously (the all-to-all half of the reduction) while
backward carries on. At the end of backward a queued callback finishes every bucket: FP32
shard sums, agreed output scales, all-gather, and the averaged gradients written back, so when
``loss.backward()`` returns every rank holds identical gradients.

A ScalingTensor gradient already in the wire format (E4M3 from `fp8lm.nn.FP8Linear`) is sent
as its bits with its own scale and gets its result back the same way; any other gradient
(plain FP32 / BF16, or another payload format) is quantized per tensor for the wire and gets the
dequantized average. The gradients `sent_in_bf16` names (those the policy stores in 16 bits: the
output head's; those of layers switched to high precision) go in BF16 instead, summed in FP32
(`BF16Reduction`), as FSDP2's reduce-scatter sends them. Buckets are launched in the same order
on every rank, whatever order the hooks fire in, so the collectives always match.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..formats import E4M3, Format, format_of
from ..tensor import ScalingTensor, gemm_layers_by_weight
from . import comm
from .autoscale import AutoScaler
from .reduction import SCALINGS, BF16Reduction, FlatLayout, FP8Reduction, dequantize_payload, split_by_wire

__all__ = ["FP8DataParallel", "broadcast_module"]


def broadcast_module(module: nn.Module, group=None, src: int = 0, skip: Iterable[torch.Tensor] = ()) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (ScalingTensors by payload
    and scale, so the copies are bit-identical), except those in ``skip``."""
    skipped = {id(t) for t in skip}
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in skipped:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t  # a tensor-parallel rank's part
        for part in [t.payload, t.scale] if isinstance(t, ScalingTensor) else [t.data]:
            comm.broadcast(part, src, group)


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready: set[int] = set()
        self.autoscaler: AutoScaler | None = None
        # launched: (positions in params, reduction) for the FP8 and the BF16 gradients
        self.reductions: list[tuple[list[int], FP8Reduction | BF16Reduction]] = []

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


class FP8DataParallel(nn.Module):
    """Wrap ``module`` so that backward averages its gradients over ``process_group`` in FP8.

    ``bucket_mb``: most FP8 payload (MiB, 1 byte per element) per bucket. ``fmt``: wire format.
    ``scaling``: ``"local"`` (each rank scales its own tensors, sums in FP32; nothing saturates)
    or ``"shared"`` (the paper's shared scale with an automatic factor mu per bucket, see
    `AutoScaler`; ``max_saturated_fraction`` and ``autoscale_window`` configure it).
    Parameters and buffers are broadcast from rank 0 at construction. ``local_params``: parameters
    each rank holds alone (an expert-parallel rank's experts): neither broadcast nor synchronized.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        bucket_mb: float = 25,
        *,
        fmt: Format | str = E4M3,
        scaling: str = "local",
        max_saturated_fraction: float = 1e-5,
        autoscale_window: int = 1000,
        local_params: Iterable[nn.Parameter] = (),
    ):
        super().__init__()
        _, world_size = comm.check_group(process_group)
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        fmt = format_of(fmt)
        if not fmt.is_fp8:
            raise ValueError(f"the wire format must be FP8 (E4M3 or E5M2), got {fmt}")
        self.module = module
        self.process_group = process_group
        self.fmt, self.scaling = fmt, scaling
        self.world_size = world_size
        local = {id(p) for p in local_params}
        broadcast_module(module, process_group, skip=[p for p in module.parameters() if id(p) in local])
        cap = bucket_mb * 2**20
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in local]
        self._buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        for p in reversed(params):
            if current and sum(q.numel() for q in current) + p.numel() > cap:
                self._buckets.append(_Bucket(current))
                current = []
            current.append(p)
        if current:
            self._buckets.append(_Bucket(current))
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._layer_of = gemm_layers_by_weight(module)
        if scaling == "shared":
            for b in self._buckets:
                b.autoscaler = AutoScaler(1.0, max_saturated_fraction, autoscale_window)
        self._sync = True
        self._callback_queued = False
        self._next_launch = 0
        self.last_sync: dict = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate local gradients without communicating."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- backward-time machinery -------------------------------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            self._launched_in_backward = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        # Launch strictly in bucket order so every rank issues the same collectives.
        while self._next_launch < len(self._buckets):
            nxt = self._buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self._launched_in_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros(p.shape, device=p.device) for p in bucket.params]
        for in_bf16, positions in split_by_wire(bucket.params, self._layer_of):
            parts = [grads[i] for i in positions]
            layout = FlatLayout.contiguous([g.numel() for g in parts], self.world_size)
            if in_bf16:
                reduction: FP8Reduction | BF16Reduction = BF16Reduction(parts, layout, self.process_group, average=True)
            else:
                mu = bucket.autoscaler.mu if bucket.autoscaler is not None else 1.0
                reduction = FP8Reduction(parts, layout, self.process_group, self.fmt, self.scaling, mu=mu, average=True)
            bucket.reductions.append((positions, reduction.start()))
        self._next_launch += 1

    def _finish(self) -> None:
        try:
            self._reduce_all()
        except RuntimeError as e:
            raise RuntimeError(
                f"FP8DataParallel gradient sync failed on rank {dist.get_rank()} (another rank may have died "
                f"or stopped responding; see its log): {e}"
            ) from e
        finally:
            for b in self._buckets:
                b.ready.clear()
                b.reductions = []
            self._next_launch = 0
            self._callback_queued = False

    def _reduce_all(self) -> None:
        while self._next_launch < len(self._buckets):  # buckets with unused parameters
            self._launch(self._buckets[self._next_launch])
        for b in self._buckets:
            for _, reduction in b.reductions:
                reduction.reduce()
                reduction.start_gather()
        for b in self._buckets:
            for positions, reduction in b.reductions:
                for i, result in zip(positions, reduction.results(), strict=True):
                    _write_grad(b.params[i], result)
                if b.autoscaler is not None and isinstance(reduction, FP8Reduction):
                    # counted: every rank's quantized inputs and the quantized sums
                    numel = sum(b.params[i].numel() for i in positions)
                    b.autoscaler.update(reduction.global_saturated(), numel * (self.world_size + 1))
        self.last_sync = {
            "buckets": len(self._buckets),
            "launched_during_backward": self._launched_in_backward,
        }

    # -- telemetry and checkpoints -----------------------------------------------------------
    def autoscale_stats(self) -> list[dict]:
        """Per bucket: ``numel`` and, with shared scaling, ``mu``, ``clean_steps`` and
        ``last_saturated_fraction``."""
        return [
            {"numel": b.numel, **(b.autoscaler.state_dict() if b.autoscaler is not None else {})} for b in self._buckets
        ]

    def get_extra_state(self) -> dict:
        return {
            "scaling": self.scaling,
            "autoscalers": [b.autoscaler.state_dict() for b in self._buckets if b.autoscaler],
        }

    def set_extra_state(self, state: dict) -> None:
        scalers = [b.autoscaler for b in self._buckets if b.autoscaler is not None]
        if state.get("scaling") != self.scaling or len(state.get("autoscalers", [])) != len(scalers):
            raise ValueError(
                f"checkpoint has scaling={state.get('scaling')!r} with {len(state.get('autoscalers', []))} "
                f"bucket scalers; this wrapper has scaling={self.scaling!r} with {len(scalers)}: "
                "wrap the model with the same scaling and bucket_mb as when it was saved"
            )
        for scaler, s in zip(scalers, state["autoscalers"]):
            scaler.load_state_dict(s)


def _write_grad(param: nn.Parameter, result: torch.Tensor) -> None:
    """Write a reduced gradient (a `ScalingTensor` off the FP8 wire, a BF16 tensor off the BF16
    one) into ``param.grad``, in the gradient's own storage where it has one."""
    grad = param.grad
    fp8 = isinstance(result, ScalingTensor)
    if fp8 and isinstance(grad, ScalingTensor) and grad.payload.dtype == result.payload.dtype:
        grad.payload.copy_(result.payload.view(grad.shape))
        grad.scale.copy_(result.scale)
        return
    value = dequantize_payload(result.payload, result.scale_inv) if fp8 else result.float()
    if grad is not None:
        grad.copy_(value.view(grad.shape))
    else:
        param.grad = value.view(param.shape).to(param.dtype)
