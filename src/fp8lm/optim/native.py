"""The FP8 optimizer's CPU kernel (``fp8lm/ops/csrc/adam.c``): all tensors of a step in one call.

torch.compile's CPU code converts FP8 one element at a time on CPUs without AVX-512 FP8 support,
which made the compiled per-tensor step 4x slower than torch's fused FP32 AdamW; the kernel does
those conversions with vectorized bit operations and updates all tensors in one call, on torch's own
OpenMP threads. Its results equal a float32 reference of the step bit for bit
(``tests/test_native_adam.py``). Building and loading: `fp8lm.ops.native`; where the library is
unavailable the optimizer uses its torch.compile step (`fp8lm.optim.fused`).
"""

from __future__ import annotations

import torch

from ..ops import native as _kernels
from ..ops.native import DTYPE_CODES, supports
from ..ops.native import amaxes as stored_amaxes

__all__ = ["available", "supports", "adam_pass", "stored_amaxes", "DTYPE_CODES"]


def available() -> bool:
    """Whether the kernel is (or can be) loaded; builds it on the first call."""
    return _kernels.available()


def adam_pass(
    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    scales: torch.Tensor,
    new_scales: torch.Tensor,
    hyperparams: torch.Tensor,
    write: bool,
) -> torch.Tensor:
    """Run the kernel over ``tensors`` (per tensor: weight, gradient, first and second moment
    payloads, contiguous CPU tensors of the `DTYPE_CODES` dtypes) with ``scales`` (n, 4: current
    scales of w, g, m, v), ``new_scales`` (n, 3: w, m, v) and ``hyperparams`` (n, 8: `adam_update`'s
    coefficients). ``write``: store the new w, m, v in place and return the amaxes of the stored
    payloads (n, 3); otherwise store nothing and return the amaxes of the new values (n, 3), NaN
    where one is NaN. The caller checks `available` first."""
    return _kernels.adam_step([t for group in tensors for t in group], scales, new_scales, hyperparams, write)
