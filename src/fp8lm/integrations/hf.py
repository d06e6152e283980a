"""Hugging Face `transformers.Trainer` and TRL's `DPOTrainer` with fp8lm, importable without either.

Both trainers accept a ready optimizer (``optimizers=(optimizer, None)``; they build the learning
rate schedule on it), so the integration is an optimizer factory: `fp8_optimizer` converts the
model at an opt level (`fp8lm.initialize`) and returns the FP8 optimizer to hand over. DPO's
frozen reference, stored in FP8 (about one byte per parameter), comes from `frozen_reference`::

    reference = frozen_reference(model)                  # before converting the policy
    optimizer = fp8_optimizer(model, "O2", lr=1e-4)
    trainer = DPOTrainer(model=model, ref_model=reference, optimizers=(optimizer, None), ...)

The trainers' gradient clipping and schedulers work on fp8lm's FP8 gradients and optimizer as on
plain ones. Leave the trainers' ``bf16``/``fp16`` flags off on CPUs without BF16 instructions.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..amp import initialize
from ..nn.frozen import freeze_fp8

__all__ = ["fp8_optimizer", "frozen_reference"]


def fp8_optimizer(
    model: nn.Module,
    opt_level: str = "O2",
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    **options,
) -> torch.optim.Optimizer:
    """Convert ``model`` in place to ``opt_level`` and return its optimizer: AdamW (decay on 2+ dim
    parameters only) as `fp8lm.initialize` adapts it (`fp8lm.optim.FP8AdamW` from O2). ``options``
    go to `fp8lm.initialize`. Pass the result as ``optimizers=(optimizer, None)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("fp8_optimizer: the model has no parameters that require gradients; pass the policy model")
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
    _, optimizer = initialize(model, adamw, opt_level=opt_level, **options)
    return optimizer


def frozen_reference(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` with E4M3 weights (`fp8lm.nn.freeze_fp8`): DPO's reference model.
    Make it before converting the policy with `fp8_optimizer`."""
    return freeze_fp8(copy.deepcopy(model))
