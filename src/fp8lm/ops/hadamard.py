"""The random Hadamard transform that NVFP4 applies to both inputs of the weight-gradient GEMM.

``M = H D / sqrt(n)``: ``H`` the Sylvester Hadamard matrix of order ``n`` (16), ``D`` a diagonal of
signs drawn from a seed. ``M`` is orthogonal, so transforming both operands along the GEMM's
reduction dimension (the tokens) in groups of ``n`` leaves their product unchanged,
``(M g)^T (M x) = g^T x``, while it spreads each group's outliers over the group before the
operands are quantized. Rows are padded with zeros to a multiple of ``n``; the padding stays (it
is transformed like the rest, and both operands carry it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["HADAMARD_SIZE", "random_signs", "hadamard_matrix", "random_hadamard"]

HADAMARD_SIZE = 16
_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of ``value``."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def random_signs(seed: int, n: int = HADAMARD_SIZE) -> list[int]:
    """``n`` signs (+1 or -1) drawn from ``seed``: plain Python, constants to ``torch.compile``."""
    return [1 - 2 * (_mix(seed * n + i) & 1) for i in range(n)]


def hadamard_matrix(seed: int, n: int = HADAMARD_SIZE, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``M = H D / sqrt(n)`` (``n`` a power of two; see the module doc), float32 or ``dtype``."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard transform has a power-of-two size, got {n}")
    signs = random_signs(seed, n)
    scale = 1.0 / math.sqrt(n)
    rows = [[scale * signs[j] * (-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]
    return torch.tensor(rows, dtype=dtype, device=device)


def random_hadamard(x: torch.Tensor, seed: int, n: int = HADAMARD_SIZE) -> torch.Tensor:
    """``x`` (R, C) transformed along its rows in groups of ``n`` (float32, ``ceil(R / n) * n`` rows).

    On CUDA a BF16 or FP16 ``x`` is multiplied as it is, with FP32 accumulation (``torch.bmm``'s
    ``out_dtype``), rather than upcast first: ``M``'s entries, ``+-1 / sqrt(n)`` with ``n`` a
    power of four, are exact in those formats and so are their products with ``x``, so the result
    is the float32 transform's up to summation order, without a float32 copy of ``x``."""
    pad = -x.shape[0] % n
    half = x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and _exact_in_half(n)
    x = x if half else x.to(torch.float32)
    x = F.pad(x, (0, 0, 0, pad)) if pad else x
    groups = x.reshape(x.shape[0] // n, n, x.shape[1])
    m = hadamard_matrix(seed, n, x.device, x.dtype)
    if half:
        out = torch.bmm(m.expand(groups.shape[0], n, n), groups, out_dtype=torch.float32)
        return out.reshape(x.shape)
    return torch.matmul(m, groups).reshape(x.shape)


def _exact_in_half(n: int) -> bool:
    """Whether ``1 / sqrt(n)`` is a power of two (``n`` a power of four): exact in BF16 and FP16."""
    return n.bit_length() % 2 == 1
