"""Automatic precision fallback: move a layer's GEMMs to high precision, and back, by telemetry.

A layer whose FP8 casts lose too much (a fraction of its output gradient or of its stored weight
gradient underflowing to zero, or of its input saturating, above a threshold) for ``patience``
consecutive telemetry samples runs in
high precision (``FP8Linear.high_precision = True``: GEMMs in BF16 under autocast, and the weight
gradient kept in the weight's dtype, since a per-tensor FP8 gradient would lose the same small
values again); once the same statistics, measured as FP8 would
cast them, stay below ``recover_below`` times the threshold for ``patience`` samples, it returns
to FP8. Every switch is returned as an event for the training log. Off unless constructed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torch import nn

__all__ = ["FallbackPolicy", "PrecisionFallback"]


@dataclass(frozen=True)
class FallbackPolicy:
    underflow: float = 0.05  # fraction of non-zero output-gradient values lost to zero
    # fraction of the stored FP8 weight gradient that is zero: per-tensor scaling flushes the rows
    # of rare tokens in an output head (docs/measurements/training.md, "Loss fidelity")
    weight_grad_underflow: float = 0.1
    saturation: float = 1e-3  # fraction of input values clipped at the format's max
    recover_below: float = 0.5  # back to FP8 below this fraction of the thresholds
    patience: int = 2  # consecutive samples before a switch

    def __post_init__(self) -> None:
        if not all(0 < f <= 1 for f in (self.underflow, self.weight_grad_underflow, self.saturation)):
            raise ValueError("fallback thresholds must be fractions in (0, 1]")
        if not 0 <= self.recover_below < 1:
            raise ValueError(f"recover_below must be in [0, 1), got {self.recover_below}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1 sample, got {self.patience}")


class PrecisionFallback:
    """Applies a `FallbackPolicy` to the FP8 layers that a `fp8lm.telemetry.Telemetry` observes."""

    def __init__(self, layers: dict[str, nn.Module], policy: FallbackPolicy = FallbackPolicy()):
        self.layers = layers
        self.policy = policy
        self._over: dict[str, int] = defaultdict(int)
        self._under: dict[str, int] = defaultdict(int)
        self.events: list[dict] = []

    def _excess(self, records: list[dict]) -> dict[str, tuple[float, str]]:
        """Per layer: the worst ratio of a statistic to its threshold, and a description."""
        worst: dict[str, tuple[float, str]] = {}
        for r in records:
            if r["kind"] == "grad_output":
                ratio, what = r["underflow"] / self.policy.underflow, f"output-gradient underflow {r['underflow']:.3g}"
            elif r["kind"] == "weight_grad":
                ratio = r["underflow"] / self.policy.weight_grad_underflow
                what = f"weight-gradient underflow {r['underflow']:.3g}"
            elif r["kind"] == "input":
                ratio, what = r["saturation"] / self.policy.saturation, f"input saturation {r['saturation']:.3g}"
            else:
                continue
            if r["layer"] in self.layers and ratio >= worst.get(r["layer"], (-1.0, ""))[0]:
                worst[r["layer"]] = (ratio, what)
        return worst

    def update(self, records: list[dict]) -> list[dict]:
        """Judge one telemetry sample; switch layers; return this sample's switch events."""
        events = []
        for name, (ratio, what) in self._excess(records).items():
            layer = self.layers[name]
            step = next(r["step"] for r in records if r["layer"] == name)
            self._over[name] = self._over[name] + 1 if ratio > 1 else 0
            self._under[name] = self._under[name] + 1 if ratio < self.policy.recover_below else 0
            if not layer.high_precision and self._over[name] >= self.policy.patience:
                layer.high_precision = True
                events.append({"step": step, "layer": name, "to": "bf16", "reason": f"{what} over threshold"})
            elif layer.high_precision and self._under[name] >= self.policy.patience:
                layer.high_precision = False
                events.append({"step": step, "layer": name, "to": "fp8", "reason": f"{what} back under threshold"})
            if events and events[-1]["layer"] == name:
                self._over[name] = self._under[name] = 0
        self.events += events
        return events

    def state_dict(self) -> dict:
        return {"high_precision": {n: m.high_precision for n, m in self.layers.items()}, "events": list(self.events)}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state["high_precision"]) - set(self.layers)
        if unknown:
            raise ValueError(f"fallback state names layers this model does not have: {sorted(unknown)}")
        for name, on in state["high_precision"].items():
            self.layers[name].high_precision = on
        self.events = list(state["events"])
