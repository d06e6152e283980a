"""FP8 modules and model conversion: `FP8Linear`, `convert_linears`, checkpoint helpers."""

from .convert import convert_linears, is_convertible, linear_targets, replace_modules, replace_parameters
from .linear import FP8Linear, is_conv1d
from .state import load_scaling_state_dict, register_plain_state_dict, scaling_state_dict

__all__ = [
    "FP8Linear", "convert_linears", "linear_targets", "is_convertible", "is_conv1d",
    "replace_modules", "replace_parameters",
    "scaling_state_dict", "load_scaling_state_dict", "register_plain_state_dict",
]
