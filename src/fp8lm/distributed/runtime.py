"""Joining and leaving the process group under ``torchrun`` (or anything that sets its env vars)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["setup", "shutdown", "is_distributed", "rank", "world_size"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def setup(backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment; returns (rank, world size).

    ``backend`` defaults to ``cuda:nccl,cpu:gloo`` when CUDA is available (NCCL for the GPU
    tensors every collective of a step uses; gloo for what must stay on the host, such as the
    object collectives of checkpoints and run setup, since NCCL has no CPU backend), gloo otherwise. ``timeout_s`` bounds
    every collective: when a rank dies, the others fail with an error instead of waiting forever.
    Calling it again once initialized returns the current (rank, world size). In a worker that
    ``torchrun --max-restarts`` started again, the process group's keys get a prefix of their own
    (see `_init_restarted`).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"fp8lm.distributed.setup() needs the environment torchrun sets; missing {', '.join(missing)}. "
            "Launch with `torchrun --nproc_per_node N ...`"
        )
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    backend = backend or ("cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(seconds=timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt > 0:
        _init_restarted(backend, attempt, timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _init_restarted(backend: str, attempt: int, timeout: timedelta) -> None:
    """Join the process group in a worker that torchrun restarted. Its agent keeps one store for
    all attempts, and the process group's keys carry no attempt number: a restarted gloo rank can
    read a dead rank's address and fail to connect ("Connection refused", measured with torch
    2.13). The keys of each attempt get their own prefix here."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"fp8lm/attempt_{attempt}", store), rank=rank, world_size=world, timeout=timeout
    )


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def shutdown(exit_code: int = 0) -> None:
    """Leave the process group and end the process with ``exit_code``.

    A gloo worker can abort with SIGABRT in interpreter teardown even after
    ``destroy_process_group()``; flushing, a barrier (on success), destroying the group and
    ``os._exit`` skips that teardown, so the exit code is the one given here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        if exit_code == 0:
            dist.barrier()
        dist.destroy_process_group()
    os._exit(exit_code)
