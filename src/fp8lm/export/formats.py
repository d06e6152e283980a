"""The export formats (no torch import: the command line offers them before it loads anything)."""

FORMATS = ("hf", "hf-fp8")  # BF16 weights; E4M3 linear-layer weights with their scales (compressed-tensors)
