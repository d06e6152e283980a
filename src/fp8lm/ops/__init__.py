"""Kernels: the saturating cast and the FP8 GEMM dispatcher."""
