"""What fp8lm's optimizers need of DTensors (FSDP2's parameters, gradients and their state): this
rank's shard, a state tensor laid out like its parameter, and reductions over a device mesh."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["local_tensor", "sharded_like", "mesh_reduce"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def sharded_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local``, this rank's part of a tensor of ``p``'s shape, as a DTensor laid out like the
    DTensor ``p``; ``local`` itself when ``p`` is a plain tensor."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def mesh_reduce(values: torch.Tensor, mesh: DeviceMesh, op: str) -> torch.Tensor:
    """``values`` reduced elementwise (``op``: "max" or "min") over every rank of ``mesh``, as a
    plain tensor: one all-reduce per mesh dimension, through DTensor's collectives."""
    on_mesh = values.to(mesh.device_type)  # NCCL meshes reduce device tensors
    t = DTensor.from_local(on_mesh, mesh, [Partial(op)] * mesh.ndim, run_check=False)
    # One dimension per redistribute: max and min are exact in any order, so reducing dimension by
    # dimension is what one reduction over the flattened mesh gives (and DTensor warns about
    # reduction order only when one redistribute reduces several dimensions).
    for dim in range(mesh.ndim):
        t = t.redistribute(mesh, [Replicate()] * (dim + 1) + [Partial(op)] * (mesh.ndim - dim - 1))
    return t.to_local().to(values.device)
