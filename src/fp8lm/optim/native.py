"""The CPU multi-tensor Adam kernel (``adam_kernel.c``): built on first use, called through ctypes.

torch.compile's CPU code converts FP8 one element at a time on CPUs without AVX-512, which made the
compiled per-tensor step 4x slower than torch's fused FP32 AdamW; the C kernel does those conversions
with vectorized bit operations and updates all tensors of a step in one call, on torch's own
OpenMP threads (``torch.get_num_threads()``). Its results are bit-identical to the eager step
(``tests/test_native_adam.py``).

The library is compiled with the system C compiler (``$CC``, else ``cc``) into a cache directory
(``$FP8LM_CACHE_DIR``, else ``~/.cache/fp8lm``), keyed by the source, the flags and the CPU; about a
second, once per machine. ``FP8LM_NATIVE_ADAM=0`` disables it. Where it cannot be built (no
compiler, say) fp8lm warns once and the optimizer uses its torch.compile step.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = ["available", "supports", "adam_pass", "stored_amaxes", "DTYPE_CODES"]

_SOURCE = Path(__file__).with_name("adam_kernel.c")
# -ffp-contract=off: no fused multiply-add, so the results equal torch's eager float32 arithmetic.
# -fno-math-errno lets sqrtf vectorize. -march=native: built on, and cached for, this CPU.
# -fopenmp: libgomp.so.1, which resolves to the one torch has loaded: one thread pool for both (a
# second pool would compete with torch's spinning workers: measured 2x slower right after torch ops).
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
DTYPE_CODES = {
    torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4,
}

_library: ctypes.CDLL | None = None
_failed = os.environ.get("FP8LM_NATIVE_ADAM", "1") == "0"


def _cpu_signature() -> str:
    """The CPU's model and feature flags: a library built with -march=native only runs there."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    if "FP8LM_CACHE_DIR" in os.environ:
        return Path(os.environ["FP8LM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fp8lm"


def _build() -> Path:
    compiler = os.environ.get("CC", "cc")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join([compiler, *_FLAGS]).encode(), _cpu_signature().encode()]))
    target = _cache_dir() / f"adam_kernel-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once (ranks) never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _failed
    if _library is None and not _failed:
        try:
            lib = ctypes.CDLL(str(_build()))
            lib.adam_step.restype = ctypes.c_int
            p = ctypes.c_void_p
            lib.adam_step.argtypes = [ctypes.c_int64, p, p, p, p, p, p, ctypes.c_int, p, ctypes.c_int]
            lib.stored_amax.restype = ctypes.c_int
            lib.stored_amax.argtypes = [ctypes.c_int64, p, p, p, p, ctypes.c_int]
            _library = lib
        except Exception as err:  # the kernel is an optimization: the torch.compile step remains
            _failed = True
            warnings.warn(f"fp8lm: native CPU Adam kernel unavailable ({type(err).__name__}: {err}); "
                          "using the torch.compile step")
    return _library


def available() -> bool:
    """Whether the kernel is (or can be) loaded; builds it on the first call."""
    return _load() is not None


def supports(t: torch.Tensor) -> bool:
    return t.is_cpu and t.dtype in DTYPE_CODES and t.is_contiguous()


def _pointers(tensors: list[torch.Tensor]):
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    dtypes = torch.tensor([DTYPE_CODES[t.dtype] for t in tensors], dtype=torch.int32)
    return ptrs, dtypes


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("fp8lm: the native Adam kernel could not allocate its work buffers")


def stored_amaxes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Exact ``abs().amax()`` of each tensor (contiguous CPU tensors of the `DTYPE_CODES` dtypes) as
    float32, NaN or inf where one is held: an integer max over the magnitude bits, one call."""
    ptrs, dtypes = _pointers(tensors)
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    out = torch.empty(len(tensors), dtype=torch.float32)
    _check(_load().stored_amax(len(tensors), ptrs, dtypes.data_ptr(), numels.data_ptr(), out.data_ptr(),
                               torch.get_num_threads()))
    return out


def adam_pass(
    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    scales: torch.Tensor, new_scales: torch.Tensor, hp: torch.Tensor, write: bool,
) -> torch.Tensor:
    """Run the kernel over ``tensors`` (per tensor: weight, gradient, first and second moment
    payloads, contiguous CPU tensors of the `DTYPE_CODES` dtypes) with ``scales`` (n, 4: current
    scales of w, g, m, v), ``new_scales`` (n, 3: w, m, v) and ``hp`` (n, 8: `adam_update`'s
    hyper-parameters). ``write``: store the new w, m, v in place and return the amaxes of the stored
    payloads (n, 3); otherwise store nothing and return the amaxes of the new values (n, 3), NaN
    where one is NaN. The caller checks `available` first."""
    n = len(tensors)
    ptrs, dtypes = _pointers([t for group in tensors for t in group])
    numels = torch.tensor([group[0].numel() for group in tensors], dtype=torch.int64)
    scales, new_scales, hp = (x.detach().to(torch.float32).contiguous() for x in (scales, new_scales, hp))
    amax = torch.empty(n, 3, dtype=torch.float32)
    _check(_load().adam_step(
        n, ptrs, dtypes.data_ptr(), numels.data_ptr(), scales.data_ptr(), new_scales.data_ptr(), hp.data_ptr(),
        int(write), amax.data_ptr(), torch.get_num_threads(),
    ))
    return amax
