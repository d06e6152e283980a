"""What every fp8lm optimizer shares about non-finite gradients: one skip counter and one clip.

A step whose gradients hold an inf or NaN anywhere is skipped as a whole (no parameter or state
changes). `SkipsNonFiniteSteps` is the contract, mixed into `FP8Adam`, `FP8AdamW` and
`fp8lm.distributed.FP8ZeroOptimizer`:

- ``skipped_steps``: int, counted once per skipped step, saved in ``state_dict()`` and restored by
  ``load_state_dict``;
- ``last_step_skipped``: bool, whether the latest ``step()`` was skipped;
- ``clip_grad_norm_(max_norm, norm_type=2.0, error_if_nonfinite=False)``: clips the gradients of the
  optimizer's parameters by their total norm and returns it; `fp8lm.clip_grad_norm_(optimizer, ...)`
  calls it. An optimizer whose gradients are sharded across ranks overrides it with the global norm.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..grad import clip_grad_norm_

__all__ = ["SkipsNonFiniteSteps"]

logger = logging.getLogger(__name__)


class SkipsNonFiniteSteps:
    """Mixin for ``torch.optim.Optimizer`` subclasses (listed before it in the bases); see the module
    docstring. A subclass's ``step`` reports each step once through `record_step`."""

    skipped_steps: int = 0
    last_step_skipped: bool = False
    param_groups: list[dict[str, Any]]

    def record_step(self, applied: bool) -> None:
        """Note whether a step was applied; a skipped one is counted and logged as a warning."""
        self.last_step_skipped = not applied
        if not applied:
            self.skipped_steps += 1
            logger.warning(
                "%s: non-finite gradient, step skipped (no parameter or state changed); %d skipped so far",
                type(self).__name__,
                self.skipped_steps,
            )

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """`fp8lm.clip_grad_norm_` over this optimizer's parameters; returns the total norm."""
        params = [p for group in self.param_groups for p in group["params"]]
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()  # type: ignore[misc]
        out["skipped_steps"] = self.skipped_steps
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
