"""Automatic gradient scaling (FP8-LM, Sec. 3.2): a factor mu per gradient bucket.

With one scale shared by all ranks, the FP8 sum of N gradients can exceed the format's range
(post-scaling) while dividing by N first loses small values (pre-scaling). The paper's way out
is a factor mu that multiplies the gradients before the FP8 reduction and is divided out after:
halved when more than a small fraction of the quantized values saturate, doubled after a long
window of steps without saturation. Every rank sees the same global saturation count, so mu
stays identical on all ranks.
"""

from __future__ import annotations

__all__ = ["AutoScaler"]


class AutoScaler:
    """The factor mu of one gradient bucket.

    ``max_saturated_fraction``: a step whose share of saturated values exceeds it halves mu
    (default 1e-5, the paper's 0.001%). ``window``: that many consecutive steps at or below it
    double mu.
    """

    def __init__(self, mu: float = 1.0, max_saturated_fraction: float = 1e-5, window: int = 1000):
        if not mu > 0:
            raise ValueError(f"mu must be positive, got {mu}")
        if not 0 <= max_saturated_fraction < 1:
            raise ValueError(f"max_saturated_fraction must be in [0, 1), got {max_saturated_fraction}")
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        self.mu = float(mu)
        self.max_saturated_fraction = float(max_saturated_fraction)
        self.window = int(window)
        self.clean_steps = 0
        self.last_saturated_fraction = 0.0

    def update(self, saturated: int, total: int) -> float:
        """Record one step in which ``saturated`` of ``total`` quantized values saturated; returns
        the mu for the next step."""
        if total <= 0 or not 0 <= saturated <= total:
            raise ValueError(f"need 0 <= saturated <= total and total > 0, got {saturated} of {total}")
        self.last_saturated_fraction = saturated / total
        if self.last_saturated_fraction > self.max_saturated_fraction:
            self.mu /= 2
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.mu *= 2
                self.clean_steps = 0
        return self.mu

    def state_dict(self) -> dict:
        return {
            "mu": self.mu,
            "clean_steps": self.clean_steps,
            "last_saturated_fraction": self.last_saturated_fraction,
        }

    def load_state_dict(self, state: dict) -> None:
        mu = float(state["mu"])
        if not mu > 0:
            raise ValueError(f"checkpointed mu must be positive, got {mu}")
        self.mu = mu
        self.clean_steps = int(state["clean_steps"])
        self.last_saturated_fraction = float(state["last_saturated_fraction"])

    def __repr__(self) -> str:
        return f"AutoScaler(mu={self.mu:g}, clean_steps={self.clean_steps}/{self.window})"
