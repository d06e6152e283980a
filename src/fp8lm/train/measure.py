"""Real storage bytes of the tensors autograd saves for backward (activation memory)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["saved_tensor_bytes"]


def _storages(t: torch.Tensor):
    """(key, storage) of the storages under ``t``, keyed by the storage itself (not its address,
    which a storage freed in place and a later one can share); a wrapper subclass (a
    ScalingTensor) is the storages of its inner tensors (payload and scale), not the size it
    presents. A DTensor (FSDP2) is its local shard's storages."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # a DTensor also names its device mesh
                yield from _storages(inner)
        return
    s = t.untyped_storage()
    yield (t.device, s._cdata), s


def saved_tensor_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of distinct storages that autograd saves for backward while ``fn()`` runs, as they
    hold when it returns.

    Storages are counted once however many saved tensors view them. Storages of ``exclude``
    (the model's parameters, which exist whether or not anything is saved) are not counted, nor
    are storages freed in place by then: FSDP2 frees a gathered weight after its forward (and
    gathers it again for the backward), though the layer saved it.
    """
    excluded = {key for t in exclude for key, _ in _storages(t.detach())}
    seen: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for key, storage in _storages(t):
            if key not in excluded:
                seen[key] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storage.nbytes() for storage in seen.values())
