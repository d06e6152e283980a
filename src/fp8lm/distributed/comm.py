"""The one place where fp8lm hands tensors to `torch.distributed`.

Every function here issues one call of torch.distributed on ``group`` (the default group when
None), records the bytes this rank sends in `fp8lm.distributed.comm_stats` under its kind (see
`accounting`), and returns the output tensor, or the ``Work`` handle with ``async_op=True``.
Under ``torch.compile`` every collective is issued blocking (the form dynamo traces) and
``async_op=True`` gets a handle whose ``wait`` returns at once.
Tensors of a float8 dtype travel as their ``uint8`` bits (no backend carries float8); summing
them is refused, since no backend can add float8 values (use the FP8 collectives instead).
Anything in fp8lm that communicates (data parallelism, ZeRO, and sharded, tensor- or
pipeline-parallel code) goes through these, so the counts cover all of it.

What torch issues itself through its functional collectives (DTensor's redistributions, such as
torch's own tensor-parallel styles and FSDP2's reduction of a partial gradient over the TP mesh,
and ``loss_parallel``'s reductions) is counted the same way while `CountedFunctionalCollectives`
is active.

`recording_devices` lists the device of every tensor handed over (NCCL refuses CPU tensors, so a
test can check that nothing CPU-side reaches a collective, without a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from . import accounting

__all__ = [
    "check_group",
    "group_device",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
    "CountedFunctionalCollectives",
    "counted_functional_collectives",
    "recording_devices",
    "note_devices",
]

# torch 2.13 renamed the tensor forms to *_single (the old names warn); older releases have only
# the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# (kind, device) of every tensor handed to torch.distributed while `recording_devices` is active;
# None otherwise, so that the check on every collective is one comparison.
_device_log: list[tuple[str, torch.device]] | None = None


@contextmanager
def recording_devices() -> Iterator[list[tuple[str, torch.device]]]:
    """While active, the yielded list gets ``(kind, device)`` for every tensor fp8lm hands to
    torch.distributed (input and output buffers alike), in call order."""
    global _device_log
    previous, _device_log = _device_log, []
    try:
        yield _device_log
    finally:
        _device_log = previous


def note_devices(kind: str, *tensors: torch.Tensor) -> None:
    """Add ``tensors`` to the `recording_devices` list, if one is active (for collectives that torch
    issues itself, such as a pipeline schedule's sends and receives)."""
    if _device_log is not None:
        _device_log.extend((kind, t.device) for t in tensors)


def check_group(group=None) -> tuple[int, int]:
    """``(rank, world size)`` of this process in ``group``; one clear error when torch.distributed
    is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call fp8lm.distributed.setup() (or "
            "torch.distributed.init_process_group) before an fp8lm collective"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def group_device(group=None) -> torch.device:
    """The device a collective over ``group`` runs on when no tensor says so (a rank with nothing
    to send still takes part): the current GPU for NCCL, which has no CPU backend; else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Completed:
    """The handle of a collective issued synchronously although the caller asked for one in flight:
    its ``wait`` has nothing left to wait for."""

    def wait(self, timeout=None) -> bool:
        return True


_COMPLETED = _Completed()


def _issued_async(async_op: bool) -> bool:
    """Whether to issue a collective asynchronously: as asked, except under ``torch.compile``,
    which traces collectives only in their blocking form (into functional collectives whose
    waits the compiler places, overlapping them with the graph's other work)."""
    return async_op and not torch.compiler.is_compiling()


def _handle(work, async_op: bool, output: torch.Tensor):
    """What a collective returns: its handle when asked for one (`_COMPLETED` if it was issued
    synchronously, `_issued_async`), else its output tensor."""
    if not async_op:
        return output
    return _COMPLETED if work is None else work


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the backend can carry it: float8 as its uint8 bits, anything else as is."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _summable(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype.is_floating_point and t.element_size() == 1:
        raise TypeError(
            f"{name} cannot sum {t.dtype} (no backend adds float8 values): "
            "use fp8lm.distributed.fp8_all_reduce or fp8_reduce_scatter"
        )
    return t


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` over the ranks in place with ``op``."""
    _summable(tensor, "all_reduce")
    note_devices("all_reduce", tensor)
    accounting.record("all_reduce", _nbytes(tensor), dist.get_world_size(group), _nbytes(tensor), tensor)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=_issued_async(async_op))
    return _handle(work, async_op, tensor)


def all_gather(output: torch.Tensor, input_tensor: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's ``input_tensor`` concatenated in rank order into ``output`` (``world_size`` times as
    many elements)."""
    note_devices("all_gather", output, input_tensor)
    accounting.record("all_gather", _nbytes(output), dist.get_world_size(group), _nbytes(input_tensor), input_tensor)
    work = _all_gather_tensor(_wire(output), _wire(input_tensor), group=group, async_op=_issued_async(async_op))
    return _handle(work, async_op, output)


def reduce_scatter(
    output: torch.Tensor, input_tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False
):
    """Rank ``r``'s ``output`` becomes chunk ``r`` of ``input_tensor`` reduced over the ranks with ``op``."""
    _summable(input_tensor, "reduce_scatter")
    note_devices("reduce_scatter", output, input_tensor)
    accounting.record(
        "reduce_scatter", _nbytes(input_tensor), dist.get_world_size(group), _nbytes(input_tensor), input_tensor
    )
    work = _reduce_scatter_tensor(output, input_tensor, op=op, group=group, async_op=_issued_async(async_op))
    return _handle(work, async_op, output)


def all_to_all(
    output: torch.Tensor,
    input_tensor: torch.Tensor,
    group=None,
    async_op: bool = False,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    kind: str = "all_to_all",
):
    """Chunk ``j`` of this rank's ``input_tensor`` goes to rank ``j``; chunk ``i`` of ``output`` comes from
    rank ``i`` (equal chunks along the first dimension, or the rows of ``input_splits`` /
    ``output_splits``: then what is counted is the bytes of the chunks sent to the other ranks).
    Counted under ``kind`` (``"expert_all_to_all"`` for an expert-parallel mixture's tokens)."""
    note_devices(kind, output, input_tensor)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    full: float = _nbytes(input_tensor)
    if input_splits is not None and world > 1 and input_tensor.shape[0]:
        row = full // input_tensor.shape[0]
        full = (full - input_splits[rank] * row) * world / (world - 1)  # its cost share: the rows that leave
    accounting.record(kind, full, world, _nbytes(input_tensor), input_tensor)
    work = dist.all_to_all_single(
        _wire(output),
        _wire(input_tensor),
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
        async_op=_issued_async(async_op),
    )
    return _handle(work, async_op, output)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """Rank ``src``'s ``tensor`` (``src`` counted within ``group``) copied into every rank's."""
    note_devices("broadcast", tensor)
    handed = _nbytes(tensor) if dist.get_rank(group) == src else 0
    accounting.record("broadcast", _nbytes(tensor), dist.get_world_size(group), handed, tensor)
    source = dist.get_global_rank(group, src) if group is not None else src
    work = dist.broadcast(_wire(tensor), src=source, group=group, async_op=_issued_async(async_op))
    return _handle(work, async_op, tensor)


def send(tensor: torch.Tensor, dst: int, group=None, async_op: bool = False):
    """Send ``tensor`` to rank ``dst`` of ``group`` (all its bytes count as sent)."""
    return _point_to_point("send", tensor, dst, group, async_op)


def recv(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Receive into ``tensor`` from rank ``src`` of ``group`` (counted as a call; its bytes are the
    sender's)."""
    return _point_to_point("recv", tensor, src, group, async_op)


def _point_to_point(kind: str, tensor: torch.Tensor, peer: int, group, async_op: bool):
    note_devices(kind, tensor)
    handed = _nbytes(tensor) if kind == "send" else 0
    accounting.record(kind, _nbytes(tensor), dist.get_world_size(group), handed, tensor)
    peer = dist.get_global_rank(group, peer) if group is not None else peer
    blocking, non_blocking = (dist.send, dist.isend) if kind == "send" else (dist.recv, dist.irecv)
    if async_op:
        return non_blocking(_wire(tensor), peer, group=group)
    blocking(_wire(tensor), peer, group=group)
    return tensor


# torch's functional collectives (namespace _c10d_functional) -> the kind they are counted as
_FUNCTIONAL_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


def _record_functional(name: str, args: tuple) -> None:
    """Record one functional collective ``name`` called with ``args`` (its schema's order: the
    input tensor(s) first, the group's name last among the positional arguments)."""
    kind = _FUNCTIONAL_KINDS[name]
    inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    group_name = args[3] if kind in ("all_to_all", "reduce_scatter") else args[2]
    group = _resolve_process_group(group_name)
    world = group.size()
    note_devices(kind, *inputs)
    for t in inputs:
        handed = _nbytes(t)
        if kind == "broadcast" and group.rank() != args[1]:
            handed = 0
        accounting.record(kind, handed * world if kind == "all_gather" else _nbytes(t), world, handed)


def counted_functional_collectives() -> contextlib.AbstractContextManager:
    """`CountedFunctionalCollectives` while counting is on (`accounting.set_counting`), else
    nothing: off, a tensor-parallel step runs without a dispatch mode."""
    return CountedFunctionalCollectives() if accounting.counting() else contextlib.nullcontext()


class CountedFunctionalCollectives(TorchDispatchMode):
    """While active, every collective torch issues through its functional API
    (``torch.ops._c10d_functional``: DTensor's redistributions, ``loss_parallel``) is recorded in
    `comm_stats` like fp8lm's own: what this rank hands to the process group, by kind. Tensor
    DTensor runs first, so its collectives are seen on plain tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # DTensor lowers the op into plain ones (its collectives), seen here next
        if func.namespace == "_c10d_functional" and func._opname in _FUNCTIONAL_KINDS:
            _record_functional(func._opname, args)
        return func(*args, **(kwargs or {}))
