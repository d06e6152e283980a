"""Distributed FP8: collectives with uint8 payloads and scales, byte accounting, automatic
gradient scaling, `FP8DataParallel` and FP8 ZeRO (opt_level O3), on stock torch.distributed."""

from .accounting import comm_stats, ddp_bytes, reset_comm_stats
from .autoscale import AutoScaler
from .collectives import (
    FlatLayout,
    FP8Reduction,
    fp8_all_gather,
    fp8_all_reduce,
    fp8_all_reduce_error_bound,
    fp8_reduce_scatter,
    shared_scale_all_reduce,
)
from .data_parallel import FP8DataParallel, broadcast_module
from .runtime import is_distributed, rank, setup, shutdown, world_size
from .zero import FP8ZeroOptimizer, partition_by_size
from .checkpoint import load_checkpoint, save_checkpoint
from .wrap import wrap

__all__ = [
    "comm_stats", "reset_comm_stats", "ddp_bytes", "AutoScaler", "FP8DataParallel", "broadcast_module",
    "FlatLayout", "FP8Reduction", "fp8_all_gather", "fp8_all_reduce", "fp8_all_reduce_error_bound",
    "fp8_reduce_scatter", "shared_scale_all_reduce",
    "setup", "shutdown", "is_distributed", "rank", "world_size",
    "FP8ZeroOptimizer", "partition_by_size", "save_checkpoint", "load_checkpoint", "wrap",
]
