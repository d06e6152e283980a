"""FP8 GEMM dispatch: ``torch._scaled_mm`` where it is the fast path, an exact emulation elsewhere.

``fp8_mm(a, b, out_dtype)`` computes ``dequantize(a) @ dequantize(b)`` for two `FP8Operand`s
(float8 payload + dequantization factor ``scale_inv``) with FP32 accumulation and one final
rounding to ``out_dtype``. Two backends give that result:

- ``"scaled_mm"``: ``torch._scaled_mm``. Used on CUDA devices of compute capability >= (8, 9)
  (decided by capability, never by name). On CUDA it needs dims that are multiples of 16 and a
  row-major/column-major operand pair: other shapes are zero-padded (exact) and re-laid out;
  E5M2 x E5M2 has no kernel and is emulated.
- ``"emulated"``: the FP8 values are upcast exactly (every FP8 value is a BF16 value) to BF16 when
  the output is BF16 and the device has fast BF16 GEMMs, else to FP32, with the scale folded into
  the upcast, and multiplied by torch's GEMM, which accumulates in FP32.

CPUs without BF16 instructions (no AVX512-BF16 or AMX, e.g. AVX2-only ones) run torch's BF16 GEMM
through a slow reference path, ~40x slower than its FP32 GEMM (docs/performance.md). There the
emulated FP8 GEMM multiplies in FP32, and `CPUBF16Linear` does the same for the BF16 GEMMs of
``F.linear`` (and of ``torch.addmm(bias, x, weight)``, Hugging Face GPT-2's ``Conv1D``) under
``torch.autocast``: an FP32 GEMM of the BF16-rounded operands, rounded to BF16,
which has the rounding points of a BF16 GEMM with FP32 accumulation.

On CPU both accumulate in FP32 and agree within FP32 summation-order error. Hopper's FP8 tensor
cores accumulate with fewer bits, so there ``_scaled_mm`` is less exact than the emulation.

``"auto"`` picks ``scaled_mm`` on capable GPUs and ``emulated`` on CPU, where ``_scaled_mm`` is
slower than the emulation and torch's own float8 -> bf16 conversion is scalar; `upcast` rebuilds
the BF16 bit pattern with three int16 ops instead. The measurements behind these choices are in
docs/performance.md ("GEMM").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..recipe import BACKENDS
from .cast import FP8_DTYPES, upcast
from .library import traceable_upcast

__all__ = [
    "FP8Operand",
    "fp8_mm",
    "wants_laid_out_operands",
    "upcast",
    "scaled_mm_supported",
    "choose_backend",
    "emulation_dtype",
    "BACKENDS",
    "bf16_gemm_is_fast",
    "CPUBF16Linear",
]


def scaled_mm_supported(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 GEMMs on ``device``: CPU, or CUDA capability >= 8.9."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


def wants_laid_out_operands(device: torch.device | str, backend: str) -> bool:
    """Whether ``fp8_mm`` on ``device`` needs its operands in given memory layouts (``_scaled_mm``
    on CUDA: row-major first, column-major second), so casts should write the transposed payload
    too (`FP8Operand`'s ``relaid``)."""
    device = torch.device(device)
    return device.type == "cuda" and choose_backend(device, backend) == "scaled_mm"


def choose_backend(device: torch.device | str, backend: str = "auto") -> str:
    """The backend ``fp8_mm`` uses on ``device``: ``backend`` resolved (``"auto"``: see module doc)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown FP8 GEMM backend {backend!r}: use one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        return "scaled_mm" if device.type == "cuda" and scaled_mm_supported(device) else "emulated"
    if backend == "scaled_mm" and not scaled_mm_supported(device):
        raise ValueError(
            f"torch._scaled_mm has no FP8 kernel on {device} (needs CPU or CUDA capability >= 8.9); "
            "use backend='emulated' or 'auto'"
        )
    return backend


class FP8Operand:
    """One GEMM operand: a float8 ``data`` payload standing for ``data * scale_inv``.

    The exact high-precision upcast is cached per dtype, so an operand that feeds two GEMMs (the
    output gradient in a linear layer's backward) is converted once. ``.t()`` is a transposed
    view that shares the cache. ``finite=True`` (known, e.g., from the quantized tensor's amax)
    lets the upcast skip its inf/NaN check; None means unknown. ``dequantized``: the exact values
    already at hand (e.g. from `saturating_cast_dequantized`), put in the cache. ``relaid``: the
    same payload in the other memory layout (``data.t().contiguous().t()`` for a row-major
    ``data``), as a cast that writes both gives it (`saturating_cast_transposed`), so that
    ``torch._scaled_mm`` reads whichever layout it needs without a copy.
    """

    __slots__ = ("_base", "_relaid", "scale_inv", "_transposed", "_cache", "finite")

    def __init__(
        self,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        finite: bool | None = None,
        dequantized: torch.Tensor | None = None,
        relaid: torch.Tensor | None = None,
    ):
        if data.dtype not in FP8_DTYPES or data.dim() != 2:
            raise TypeError(f"an FP8Operand is a 2-D float8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
        if relaid is not None and (relaid.shape != data.shape or relaid.dtype != data.dtype):
            raise ValueError(
                f"FP8Operand: relaid must hold data's values, got {relaid.dtype} {tuple(relaid.shape)} "
                f"for {data.dtype} {tuple(data.shape)}"
            )
        self._base = data
        self._relaid = relaid
        self.scale_inv = scale_inv
        self._transposed = False
        self._cache: dict[torch.dtype, torch.Tensor] = {}
        if dequantized is not None:
            self._cache[dequantized.dtype] = dequantized
        self.finite = finite

    @property
    def data(self) -> torch.Tensor:
        return self._base.t() if self._transposed else self._base

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self._base.device

    @property
    def dtype(self) -> torch.dtype:
        return self._base.dtype

    def t(self) -> FP8Operand:
        out = object.__new__(FP8Operand)
        out._base, out._relaid, out.scale_inv = self._base, self._relaid, self.scale_inv
        out._cache, out.finite = self._cache, self.finite
        out._transposed = not self._transposed
        return out

    def stored(self, row_major: bool) -> torch.Tensor | None:
        """``data`` in row-major (contiguous) or column-major (transpose contiguous) layout, where one
        of the stored payloads has it; else None."""
        for t in (self._base, self._relaid):
            if t is not None:
                view = t.t() if self._transposed else t
                if (view if row_major else view.t()).is_contiguous():
                    return view
        return None

    def laid_out(self, row_major: bool) -> torch.Tensor:
        """``data`` in the layout asked for (see `stored`), copied only when no stored payload has it."""
        view = self.stored(row_major)
        if view is not None:
            return view
        return self.data.contiguous() if row_major else self.data.t().contiguous().t()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The exact values as ``dtype`` (cached)."""
        if dtype not in self._cache:
            self._cache[dtype] = traceable_upcast(self._base, self.scale_inv, dtype, self.finite)
        base = self._cache[dtype]
        return base.t() if self._transposed else base


def fp8_mm(
    a: FP8Operand,
    b: FP8Operand,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b) (+ bias)`` as ``out_dtype``; ``a`` is (M, K), ``b`` (K, N).

    FP32 accumulation on both backends; the result differs between them only by the order of the
    FP32 summation. ``bias`` (N,) is added in ``out_dtype``.
    """
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_mm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_mm: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    backend = choose_backend(a.device, backend)
    if backend == "scaled_mm" and not (a.device.type == "cuda" and a.dtype == b.dtype == torch.float8_e5m2):
        return _scaled_mm(a, b, out_dtype, bias)
    compute = emulation_dtype(out_dtype)
    a_hp, b_hp = a.dequantize(compute), b.dequantize(compute)
    if bias is None:
        out = torch.mm(a_hp, b_hp)
    else:
        out = torch.addmm(bias.to(compute), a_hp, b_hp)
    return out.to(out_dtype)


def emulation_dtype(out_dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype the emulated backend upcasts FP8 operands to for an ``out_dtype`` result on
    ``device``: BF16 for a BF16 result where BF16 GEMMs are fast, else FP32."""
    return torch.bfloat16 if out_dtype == torch.bfloat16 and bf16_gemm_is_fast(device) else torch.float32


def _cpu_has_bf16_gemm() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes: assume the native kernels
        return True


# Probed once, at import: torch.compile cannot trace the probes (a graph break inside FP8Linear under
# CPU autocast), and a module constant is a constant to it.
_CPU_HAS_BF16_GEMM = _cpu_has_bf16_gemm()


def bf16_gemm_is_fast(device: torch.device | str) -> bool:
    """Whether torch's BF16 GEMM runs on BF16 hardware on ``device``: any non-CPU device, or a CPU
    with AVX512-BF16 or AMX."""
    return torch.device(device).type != "cpu" or _CPU_HAS_BF16_GEMM


class _BF16Linear(torch.autograd.Function):
    """BF16 ``F.linear`` with FP32 GEMMs: the operands are rounded to BF16 and saved as BF16 (the
    bytes autocast saves), multiplied in FP32, and every result (output, input and weight
    gradients) is rounded to BF16 once, as a BF16 GEMM with FP32 accumulation does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        b = None if bias is None else bias.to(torch.bfloat16).float()
        ctx.save_for_backward(x16, w16)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return F.linear(x16.float(), w16.float(), b).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x16, w16 = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g = grad_out.to(torch.bfloat16).float()
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ w16.float()).to(torch.bfloat16).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g2.t() @ x16.reshape(-1, x16.shape[-1]).float()).to(torch.bfloat16).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(torch.bfloat16).to(b_dtype)
        return grad_x, grad_w, grad_b


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` as BF16 autocast computes it, with FP32 GEMMs (`_BF16Linear`)."""
    with torch.autocast("cpu", enabled=False):
        return _BF16Linear.apply(x, weight, bias)


def _emulates_bf16_gemm(x: torch.Tensor) -> bool:
    """Whether a BF16-autocast GEMM of ``x`` runs on a CPU without BF16 GEMM instructions."""
    return (
        torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and x.device.type == "cpu"
        and not _CPU_HAS_BF16_GEMM
    )


class CPUBF16Linear(TorchFunctionMode):
    """A mode (``with CPUBF16Linear(): ...``) under which ``F.linear`` in CPU BF16 autocast, on a
    CPU without BF16 GEMM instructions, is computed by `_bf16_linear` (see the module docstring),
    and so is ``torch.addmm(bias, x, weight)`` with a bias vector (the linear layer of Hugging Face
    GPT-2's ``Conv1D``, whose weight is stored ``[in, out]``); elsewhere it changes nothing. Enter it
    with ``torch.autocast`` around the forward pass."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and _emulates_bf16_gemm(args[0]):
            return _bf16_linear(*args, **kwargs)
        if (
            func is torch.addmm
            and not kwargs
            and len(args) == 3
            and args[0].dim() == 1
            and _emulates_bf16_gemm(args[1])
        ):
            bias, x, weight = args
            return _bf16_linear(x, weight.t(), bias)
        return func(*args, **kwargs)


def _round_up(n: int, multiple: int = 16) -> int:
    return -(-n // multiple) * multiple


def _scaled_mm(a: FP8Operand, b: FP8Operand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    a_data, b_data = a.data, b.data
    (m, k), n = a_data.shape, b_data.shape[1]
    padded = a_data.device.type == "cuda" and any(d % 16 for d in (m, k, n))
    if padded:
        # cuBLASLt wants multiples of 16; zero rows/columns add exact zeros to every sum.
        mp, kp, np_ = _round_up(m), _round_up(k), _round_up(n)
        a_data = torch.nn.functional.pad(a_data, (0, kp - k, 0, mp - m))
        b_data = torch.nn.functional.pad(b_data, (0, np_ - n, 0, kp - k))
    if a_data.device.type == "cuda":
        # cuBLASLt's FP8 GEMM takes a row-major first and a column-major second operand: a stored
        # payload in that layout where the cast wrote one, else a copy.
        if padded:
            a_data, b_data = a_data.contiguous(), b_data.t().contiguous().t()
        else:
            a_data, b_data = a.laid_out(row_major=True), b.laid_out(row_major=False)
    scale_a = a.scale_inv.to(device=a_data.device, dtype=torch.float32)
    scale_b = b.scale_inv.to(device=a_data.device, dtype=torch.float32)
    # cuBLASLt adds a BF16/FP16 bias in the GEMM's epilogue (no pass over the output of its own);
    # a float32 output, or a padded one, gets it added afterwards.
    fused_bias = bias is not None and not padded and a_data.device.type == "cuda" and out_dtype != torch.float32
    epilogue_bias = bias.to(out_dtype) if bias is not None and fused_bias else None
    out = torch._scaled_mm(a_data, b_data, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, bias=epilogue_bias)
    if padded:
        out = out[:m, :n]
    if bias is not None and not fused_bias:
        out = out + bias.to(out_dtype)
    return out
