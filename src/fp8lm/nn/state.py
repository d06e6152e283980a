"""State of converted models: plain checkpoints of low-precision parameters, and FP8 scaling state.

A converted model's ``state_dict()`` holds plain dequantized tensors (exact: an FP16 or FP8 value
times a power of two is a float32 value), so it loads into the unconverted model and with
``torch.load(weights_only=True)``; ``load_state_dict`` copies into the ScalingTensor parameters,
which requantizes. The delayed-scaling state of FP8 layers (amax histories) is not part of the
model's weights (its buffers are not persistent, so ``state_dict()`` stays the plain model's):
`scaling_state_dict` / `load_scaling_state_dict` save and restore it for an exact resume.
"""

from __future__ import annotations

from torch import nn

from ..scaling import ScalingMeta
from ..tensor import ScalingTensor

__all__ = ["dequantize_entries", "register_plain_state_dict", "scaling_state_dict", "load_scaling_state_dict"]


def dequantize_entries(state_dict: dict, prefix: str, names) -> None:
    """Replace the ScalingTensor values of ``prefix + name`` entries by plain dequantized tensors."""
    for name in names:
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, ScalingTensor):
            state_dict[key] = value.dequantize(value.dtype)


def _plain_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    dequantize_entries(state_dict, prefix, module._parameters)


def register_plain_state_dict(module: nn.Module) -> None:
    """Make ``module.state_dict()`` hold its own ScalingTensor parameters dequantized (once per module)."""
    if getattr(module, "_fp8lm_plain_state_dict", False):
        return
    module.register_state_dict_post_hook(_plain_state_dict_hook)
    module._fp8lm_plain_state_dict = True  # type: ignore[assignment]  # a flag, not a tensor or submodule


def _metas(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, ScalingMeta):
            yield name, module


def scaling_state_dict(model: nn.Module) -> dict[str, dict]:
    """The scaling state (scale, amax history, step, rescales) of every `ScalingMeta` in the
    model, keyed ``"<module name>.<attribute>"``; plain tensors (weights_only-safe)."""
    return {key: meta.scaling_state() for key, meta in _metas(model)}


def load_scaling_state_dict(model: nn.Module, state: dict[str, dict]) -> None:
    """Restore `scaling_state_dict` output (also as saved by earlier versions). Keys must match
    exactly; all are checked before any state changes."""
    metas = dict(_metas(model))
    missing, unexpected = sorted(metas.keys() - state.keys()), sorted(state.keys() - metas.keys())
    if missing or unexpected:
        raise ValueError(
            f"scaling state does not fit this model: missing {missing}, unexpected {unexpected}; "
            "load it into a model converted with the same options"
        )
    for key, meta in metas.items():
        if state[key]["amax_history"].shape != meta.amax_history.shape:
            raise ValueError(
                f"scaling state {key!r} has an amax history of {state[key]['amax_history'].numel()}, the model "
                f"{meta.amax_history.numel()}; convert the model with the same recipe history_len"
            )
    for key, meta in metas.items():
        meta.load_scaling_state(state[key])
