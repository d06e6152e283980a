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


def hadamard_matrix(seed: int, n: int = HADAMARD_SIZE, device=None) -> torch.Tensor:
    """``M = H D / sqrt(n)`` (float32, ``n`` a power of two; see the module doc)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard transform has a power-of-two size, got {n}")
    signs = random_signs(seed, n)
    scale = 1.0 / math.sqrt(n)
    rows = [[scale * signs[j] * (-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]
    return torch.tensor(rows, dtype=torch.float32, device=device)


def random_hadamard(x: torch.Tensor, seed: int, n: int = HADAMARD_SIZE) -> torch.Tensor:
    """``x`` (R, C) transformed along its rows in groups of ``n`` (float32, ``ceil(R / n) * n`` rows)."""
    pad = -x.shape[0] % n
    x = F.pad(x.to(torch.float32), (0, 0, 0, pad)) if pad else x.to(torch.float32)
    groups = x.reshape(x.shape[0] // n, n, x.shape[1])
    return torch.matmul(hadamard_matrix(seed, n, x.device), groups).reshape(x.shape)
