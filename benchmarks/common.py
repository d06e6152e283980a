"""Helpers shared by the benchmark scripts: timing, a description of the machine, and the result's
JSON printed and written."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def machine() -> dict:
    """What the numbers were measured on."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_capability"] = list(torch.cuda.get_device_capability())
    return info


def emit(result: dict, path: str | Path | None = None) -> None:
    """Print ``result`` as JSON and, given ``path``, write the same text there."""
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")


def median_time(fn, reps: int = 7, warmup: int = 2, sync=None) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` calls."""
    sync = sync or (torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed large blocks for reuse instead of returning them to the OS.

    PyTorch's CPU allocator takes every large tensor from malloc, which by default maps fresh
    pages for it, so each new tensor pays page faults on first touch (measured: a 256 MB clone
    costs 5-8x a copy into an existing buffer). With a high mmap threshold the heap is reused,
    as a caching allocator does on GPU. Returns whether the setting was applied.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if platform.system() != "Linux" or name is None:
        return False
    libc = ctypes.CDLL(name)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    big = 1 << 30
    return bool(libc.mallopt(M_MMAP_THRESHOLD, big)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * big))
