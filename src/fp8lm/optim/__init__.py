"""Optimizers with low-precision state: `FP8AdamW` and `FP8Adam`.

Modules: `adam` (the optimizer classes), `state` (their per-parameter state and its checks),
`fused` (the fused multi-tensor step), `slots` (what it works on), `functional` (the Adam math),
`native` (the C kernel of the step on CPUs), `skipping` (the contract of every fp8lm optimizer for
non-finite gradients: ``skipped_steps``, ``last_step_skipped``, ``clip_grad_norm_``).
"""

from .adam import FP8Adam, FP8AdamW
from .skipping import SkipsNonFiniteSteps

__all__ = ["FP8Adam", "FP8AdamW", "SkipsNonFiniteSteps"]
