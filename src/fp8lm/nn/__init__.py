"""FP8 modules and model conversion: `FP8Linear`, `convert_linears`, `freeze_fp8`, checkpoint
helpers, FP8-saving norms and activations (`fp8lm.nn.saved`), activation checkpointing that
recomputes FP8 casts bit for bit (`fp8lm.nn.checkpoint`), a mixture of experts (`fp8lm.nn.moe`) and
its grouped GEMMs (`GroupedLinear`, `FP8GroupedLinear`)."""

from .checkpoint import checkpoint
from .convert import (
    convert_linears,
    grouped_targets,
    is_convertible,
    linear_targets,
    output_head,
    replace_modules,
    replace_parameters,
)
from .frozen import freeze_fp8
from .grouped import FP8GroupedLinear, GroupedLinear
from .linear import FP8Linear, is_conv1d
from .moe import MoE, Router
from .saved import (
    FP8SavedGELU,
    FP8SavedLayerNorm,
    FP8SavedRMSNorm,
    FP8SavedSwiGLU,
    RMSNorm,
    SwiGLU,
    activation_targets,
    rms_norm,
)
from .state import load_scaling_state_dict, register_plain_state_dict, scaling_state_dict

__all__ = [
    "FP8Linear",
    "GroupedLinear",
    "FP8GroupedLinear",
    "grouped_targets",
    "MoE",
    "Router",
    "convert_linears",
    "linear_targets",
    "output_head",
    "is_convertible",
    "is_conv1d",
    "replace_modules",
    "replace_parameters",
    "freeze_fp8",
    "scaling_state_dict",
    "load_scaling_state_dict",
    "register_plain_state_dict",
    "RMSNorm",
    "rms_norm",
    "SwiGLU",
    "FP8SavedLayerNorm",
    "FP8SavedRMSNorm",
    "FP8SavedGELU",
    "FP8SavedSwiGLU",
    "activation_targets",
    "checkpoint",
]
