"""Optimizers with low-precision state: `FP8AdamW` and `FP8Adam`."""

from .adam import FP8Adam, FP8AdamW

__all__ = ["FP8Adam", "FP8AdamW"]
