"""fp8lm's CPU kernels (``csrc/``): one C library, built on first use, called through ctypes.

On CPUs, torch's FP8 conversions run one element at a time (its vectorized ones need AVX-512 FP8
support in ``at::vec``), inductor's generated code inherits that and costs tens of microseconds of
guards per call, and eager casts take four passes. The kernels here do the conversions with
vectorized bit operations (``csrc/codec.h``) on torch's own OpenMP threads
(``torch.get_num_threads()``): the saturating scaled cast with its amax in one pass, the exact upcast
(``csrc/cast.c``), the group-scaled casts of FP8-saved activations (``csrc/groups.c``) and the FP8
optimizer's multi-tensor step (``csrc/adam.c``, wrapped by `fp8lm.optim.native`). Results equal torch's conversions bit for bit (``tests/test_native_cast.py``,
``tests/test_native_adam.py``).

The library is compiled with the system C compiler (``$CC``, else ``cc``; the one torch.compile
uses too) into a cache directory (``$FP8LM_CACHE_DIR``, else ``~/.cache/fp8lm``), keyed by the
sources, the flags and the CPU: about a second, once per machine. ``FP8LM_NATIVE=0`` disables it.
Where it cannot be built fp8lm warns once and uses its torch paths (same results, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .fastpath import NATIVE, FastPath, NativeBuildError

__all__ = [
    "KERNELS",
    "library",
    "loaded_library",
    "available",
    "loaded",
    "supports",
    "pointers",
    "check",
    "cast",
    "amaxes",
    "amax",
    "upcast",
    "adam_step",
    "group_amax",
    "group_cast",
    "group_upcast",
    "DTYPE_CODES",
]

_CSRC = Path(__file__).with_name("csrc")
# -ffp-contract=off: no fused multiply-add, so the results equal torch's eager float32 arithmetic.
# -fno-math-errno lets sqrtf vectorize. -march=native: built on, and cached for, this CPU.
# -fopenmp: libgomp.so.1, which resolves to the one torch has loaded: one thread pool for both (a
# second pool would compete with torch's spinning workers: measured 2x slower right after torch ops).
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}
_p, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "fp8_cast": [_p, _int, _i64, _f32, _p, _int, _p, _p, _int, _f32, _int],
    "fp8_upcast": [_p, _int, _i64, _f32, _p, _int, _int],
    "adam_step": [_i64, _p, _p, _p, _p, _p, _p, _int, _p, _int],
    "stored_amax": [_i64, _p, _p, _p, _p, _int],
    "group_amax": [_p, _int, _i64, _i64, _p, _int],
    "group_cast": [_p, _int, _i64, _i64, _p, _p, _int, _int],
    "group_upcast": [_p, _int, _i64, _i64, _p, _p, _int, _int],
}

_library: ctypes.CDLL | None = None
# Where the library cannot be built, fp8lm warns once and uses its torch paths.
KERNELS = FastPath("native CPU kernels", fallback="torch ops", switch=NATIVE)


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
    sources = sorted(_CSRC.glob("*.c"))
    key = hashlib.sha256(" ".join([compiler, *_FLAGS]).encode() + _cpu_signature().encode())
    for path in sorted(_CSRC.iterdir()):
        key.update(path.name.encode() + path.read_bytes())
    target = _cache_dir() / f"fp8lm_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once (ranks) never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, f"-I{_CSRC}", *map(str, sources), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NativeBuildError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build()))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on the first call; None where it cannot be built or
    `KERNELS` is disabled."""
    global _library
    if not KERNELS.enabled:
        return None
    if _library is None:
        _library = KERNELS.run(_load, lambda: None)
    return _library


def loaded_library() -> ctypes.CDLL:
    """`library` for a caller that checked `available` first."""
    lib = library()
    if lib is None:
        raise RuntimeError("fp8lm: the native CPU kernels are not loaded; check fp8lm.ops.native.available() first")
    return lib


def loaded() -> bool:
    """Whether the kernels are loaded already (no build or load is attempted: what code that
    ``torch.compile`` may be tracing asks, since loading a library cannot be traced)."""
    return _library is not None and KERNELS.enabled


def available() -> bool:
    """Whether the kernels are (or can be) loaded; builds them on the first call."""
    return library() is not None


def supports(t: torch.Tensor) -> bool:
    """Whether the kernels take ``t``: a contiguous CPU tensor of a `DTYPE_CODES` dtype, with its
    own storage (not a wrapper subclass such as a DTensor, whose data pointer is not its values)."""
    return t.is_cpu and t.dtype in DTYPE_CODES and t.is_contiguous() and not is_traceable_wrapper_subclass(t)


def cast(
    x: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    with_amax: bool,
    dequantized: torch.dtype | None = None,
    scale_inv: float = 1.0,
):
    """``round(clamp(x * scale))`` as ``dtype`` (clamped to the format's range), the exact amax of
    ``x`` as a float32 0-d tensor when asked (NaN where one is NaN), and with ``dequantized`` a
    ``dequantized`` copy of the stored values times ``scale_inv``; None for what is not asked.
    ``x``: see `supports`."""
    out = torch.empty(x.shape, dtype=dtype)
    amax = torch.empty((), dtype=torch.float32) if with_amax else None
    deq = torch.empty(x.shape, dtype=dequantized) if dequantized is not None else None
    loaded_library().fp8_cast(
        x.data_ptr(),
        DTYPE_CODES[x.dtype],
        x.numel(),
        scale,
        out.data_ptr(),
        DTYPE_CODES[dtype],
        amax.data_ptr() if amax is not None else None,
        deq.data_ptr() if deq is not None else None,
        DTYPE_CODES[deq.dtype] if deq is not None else 0,
        scale_inv,
        torch.get_num_threads(),
    )
    return out, amax, deq


def pointers(tensors: list[torch.Tensor]):
    """The kernels' view of ``tensors``: their data pointers and dtype codes (int32 tensor)."""
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    dtypes = torch.tensor([DTYPE_CODES[t.dtype] for t in tensors], dtype=torch.int32)
    return ptrs, dtypes


def check(status: int) -> None:
    if status != 0:
        raise MemoryError("fp8lm: a native CPU kernel could not allocate its work buffers")


def amaxes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Exact ``abs().amax()`` of each tensor (see `supports`, non-empty) as float32, NaN or inf
    where one is held: an integer max over the magnitude bits, one call for all."""
    ptrs, dtypes = pointers(tensors)
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    out = torch.empty(len(tensors), dtype=torch.float32)
    check(
        loaded_library().stored_amax(
            len(tensors), ptrs, dtypes.data_ptr(), numels.data_ptr(), out.data_ptr(), torch.get_num_threads()
        )
    )
    return out


def amax(x: torch.Tensor) -> torch.Tensor:
    """`amaxes` of one tensor, as a 0-d tensor."""
    return amaxes([x])[0]


def upcast(data: torch.Tensor, scale_inv: float, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale_inv`` as ``dtype`` (exact for FP8 data into BF16 or float32); NaN codes stay NaN."""
    out = torch.empty(data.shape, dtype=dtype)
    loaded_library().fp8_upcast(
        data.data_ptr(),
        DTYPE_CODES[data.dtype],
        data.numel(),
        scale_inv,
        out.data_ptr(),
        DTYPE_CODES[dtype],
        torch.get_num_threads(),
    )
    return out


def adam_step(
    tensors: list[torch.Tensor],
    scales: torch.Tensor,
    new_scales: torch.Tensor,
    hyperparams: torch.Tensor,
    write: bool,
) -> torch.Tensor:
    """The FP8 optimizer's multi-tensor pass (``csrc/adam.c``) over ``tensors``: per tensor its
    weight, gradient, first and second moment payloads (see `supports`), in that order.
    ``scales`` (n, 4): their current scales; ``new_scales`` (n, 3): those the new w, m, v are
    stored with; ``hyperparams`` (n, 8): `fp8lm.optim.functional.adam_update`'s coefficients.
    ``write``: store the new w, m, v in place and return the amaxes of the stored payloads (n, 3);
    otherwise store nothing and return the amaxes of the new values (n, 3), NaN where one is NaN."""
    n = len(tensors) // 4
    ptrs, dtypes = pointers(tensors)
    numels = torch.tensor([tensors[4 * i].numel() for i in range(n)], dtype=torch.int64)
    scales, new_scales, hyperparams = (
        x.detach().to(torch.float32).contiguous() for x in (scales, new_scales, hyperparams)
    )
    amax = torch.empty(n, 3, dtype=torch.float32)
    check(
        loaded_library().adam_step(
            n,
            ptrs,
            dtypes.data_ptr(),
            numels.data_ptr(),
            scales.data_ptr(),
            new_scales.data_ptr(),
            hyperparams.data_ptr(),
            int(write),
            amax.data_ptr(),
            torch.get_num_threads(),
        )
    )
    return amax


def group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """The exact amax of each group of ``group`` consecutive elements of ``x`` (see `supports`;
    its numel a multiple of ``group``), float32 of shape (numel / group,): NaN where the group holds
    a NaN, inf where it holds an inf and no NaN."""
    out = torch.empty(x.numel() // group, dtype=torch.float32)
    loaded_library().group_amax(
        x.data_ptr(), DTYPE_CODES[x.dtype], out.numel(), group, out.data_ptr(), torch.get_num_threads()
    )
    return out


def _group_scaled(kernel: str, src: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype):
    out = torch.empty(src.shape, dtype=dtype)
    getattr(loaded_library(), kernel)(
        src.data_ptr(),
        DTYPE_CODES[src.dtype],
        scales.numel(),
        group,
        scales.data_ptr(),
        out.data_ptr(),
        DTYPE_CODES[dtype],
        torch.get_num_threads(),
    )
    return out


def group_cast(x: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``round(clamp(x * scale))`` as ``dtype``, one float32 scale (contiguous) per group of
    ``group`` consecutive elements of ``x`` (see `supports`)."""
    return _group_scaled("group_cast", x, scales, group, dtype)


def group_upcast(data: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``data * (1 / scale)`` as ``dtype``, one float32 scale (contiguous) per group of ``group``
    consecutive elements (exact for FP8 data and power-of-two scales)."""
    return _group_scaled("group_upcast", data, scales, group, dtype)
