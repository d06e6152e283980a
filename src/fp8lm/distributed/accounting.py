"""Bytes sent per collective kind, by the standard algorithm cost.

Every collective fp8lm issues (all go through `fp8lm.distributed.comm`) records what *this rank*
sends under the usual ring-algorithm costs, for a tensor of ``size`` bytes in total on ``N`` ranks:

- all-reduce: ``2 (N-1)/N * size``
- reduce-scatter, all-gather, all-to-all (``expert_all_to_all`` too: an expert-parallel mixture's
  token exchanges): ``(N-1)/N * size`` of the full (concatenated) tensor
- broadcast: ``(N-1)/N * size`` (pipelined ring)
- send: ``size`` (point to point: all of it); recv: nothing (the sender counts those bytes), but
  the call is counted

Scales travel in their own small collectives and are counted like any other bytes. The counts
are per process, so they are comparable across runs whatever the backend actually does.

Next to that cost, each call records the bytes this rank *handed* to the process group: the
tensor it contributes (the input of an all-gather, reduce-scatter or all-to-all, the reduced
tensor, a broadcast's tensor on its source, a sent tensor; nothing for a receive), i.e. exactly
the ``nbytes`` of the tensors passed in to be sent.
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = [
    "KINDS",
    "collective_bytes",
    "ddp_bytes",
    "record",
    "comm_stats",
    "reset_comm_stats",
    "set_counting",
    "counting",
]

# expert_all_to_all: an expert-parallel mixture's token exchanges (all-to-alls, counted apart from
# the gradient reductions' own all-to-alls)
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "expert_all_to_all", "broadcast", "send", "recv")

_bytes: dict[str, float] = defaultdict(float)
_handed: dict[str, int] = defaultdict(int)
_calls: dict[str, int] = defaultdict(int)
_counting = True  # off: record() returns at once and torch's functional collectives go uncounted


def set_counting(enabled: bool) -> bool:
    """Turn byte counting on or off (on by default); returns the previous setting. Off, counting
    costs one check per collective, and no dispatch mode wraps tensor-parallel steps."""
    global _counting
    previous, _counting = _counting, bool(enabled)
    return previous


def counting() -> bool:
    """Whether collectives are being counted (`set_counting`)."""
    return _counting


def collective_bytes(kind: str, full_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for a collective of ``kind`` over a tensor of ``full_bytes`` in total."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}: use one of {', '.join(KINDS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if kind in ("send", "recv"):
        return full_bytes if kind == "send" else 0.0
    share = (world_size - 1) / world_size
    return (2 * share if kind == "all_reduce" else share) * full_bytes


def ddp_bytes(numel: int, bytes_per_element: int, world_size: int) -> float:
    """What plain DDP sends per step to all-reduce ``numel`` gradients of that element size."""
    return collective_bytes("all_reduce", numel * bytes_per_element, world_size)


def record(
    kind: str, full_bytes: float, world_size: int, handed_bytes: int = 0, sent: torch.Tensor | None = None
) -> None:
    """Count one collective of ``kind`` over ``full_bytes`` (the whole tensor, all ranks' parts) to
    which this rank handed a tensor of ``handed_bytes``. ``sent``: the tensor it hands over (any
    tensor of the collective), which a graph ``torch.compile`` traces needs: there the count is
    an op of the graph (`record_collective`) on that tensor, run each time the graph runs."""
    if not _counting:
        return
    cost = collective_bytes(kind, full_bytes, world_size)
    if torch.compiler.is_compiling():
        if sent is None:
            raise ValueError(f"counting a {kind} in a compiled graph needs the tensor it sends (sent=)")
        record_collective(sent, kind, cost, int(handed_bytes))
        return
    _count(kind, cost, handed_bytes)


def _count(kind: str, cost: float, handed_bytes: int) -> None:
    _bytes[kind] += cost
    _handed[kind] += handed_bytes
    _calls[kind] += 1


@torch.library.custom_op("fp8lm::record_collective", mutates_args=())
def record_collective(sent: torch.Tensor, kind: str, cost: float, handed_bytes: int) -> None:
    """`record` as an op of a compiled graph (dynamo reads Python counters once, when it traces).
    It reads nothing of ``sent``: the tensor places the op in the pass (forward or backward) that
    issues the collective, where AOTAutograd's partitioner keeps it (an op without tensor inputs
    it copies into the forward graph as well)."""
    _count(kind, cost, handed_bytes)


@record_collective.register_fake
def _(sent: torch.Tensor, kind: str, cost: float, handed_bytes: int) -> None:
    return None


# An op without outputs is dead code to the graphs' passes unless it is known to have effects.
torch.fx.node.has_side_effect(torch.ops.fp8lm.record_collective.default)


def comm_stats() -> dict:
    """Bytes this rank sent since the last reset: ``total_bytes``, ``<kind>_bytes`` and
    ``<kind>_calls`` for every kind in `KINDS` (the algorithm cost); ``handed_bytes`` and
    ``<kind>_handed_bytes``: the bytes of the tensors it handed to the process group."""
    stats: dict = {"total_bytes": sum(_bytes.values()), "handed_bytes": sum(_handed.values())}
    for kind in KINDS:
        stats[f"{kind}_bytes"] = _bytes[kind]
        stats[f"{kind}_calls"] = _calls[kind]
        stats[f"{kind}_handed_bytes"] = _handed[kind]
    return stats


def reset_comm_stats() -> None:
    """Set every count back to zero."""
    _bytes.clear()
    _handed.clear()
    _calls.clear()
