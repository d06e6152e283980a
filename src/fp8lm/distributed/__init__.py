"""Distributed FP8: collectives with uint8 payloads and scales, byte accounting, automatic
gradient scaling, `FP8DataParallel`, FP8 ZeRO (opt_level O3) and FSDP2 with FP8 communication
(`fully_shard`), on stock torch.distributed.
`fp8lm.distributed.comm` is where all of it hands tensors to torch.distributed."""

from . import comm
from .accounting import comm_stats, ddp_bytes, reset_comm_stats
from .autoscale import AutoScaler
from .checkpoint import load_checkpoint, load_fsdp_checkpoint, save_checkpoint, save_fsdp_checkpoint
from .collectives import (
    bf16_all_reduce,
    fp8_all_gather,
    fp8_all_reduce,
    fp8_all_reduce_error_bound,
    fp8_reduce_scatter,
    shared_scale_all_reduce,
)
from .data_parallel import FP8DataParallel, broadcast_module
from .expert_parallel import ExpertParallelMoE, expert_parallel
from .fsdp import fully_shard, precompute_fp8_scales, refresh_gathers
from .mesh import ParallelDims, ParallelMesh
from .reduction import SCALINGS, BF16Reduction, FlatLayout, FP8Reduction, LocalScaling, SharedScaling, sent_in_bf16
from .runtime import is_distributed, rank, setup, shutdown, world_size
from .sequence_moe import SequenceExpertParallelMoE, SequenceParallelMoE, sequence_parallel_experts
from .tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput, SharedReplicatedInput
from .wrap import wrap
from .zero import FP8ZeroOptimizer, partition_by_size

__all__ = [
    "comm",
    "ParallelDims",
    "ParallelMesh",
    "comm_stats",
    "reset_comm_stats",
    "ddp_bytes",
    "AutoScaler",
    "FP8DataParallel",
    "broadcast_module",
    "ExpertParallelMoE",
    "expert_parallel",
    "SequenceParallelMoE",
    "SequenceExpertParallelMoE",
    "sequence_parallel_experts",
    "SCALINGS",
    "FlatLayout",
    "FP8Reduction",
    "BF16Reduction",
    "sent_in_bf16",
    "bf16_all_reduce",
    "LocalScaling",
    "SharedScaling",
    "fp8_all_gather",
    "fp8_all_reduce",
    "fp8_all_reduce_error_bound",
    "fp8_reduce_scatter",
    "shared_scale_all_reduce",
    "setup",
    "shutdown",
    "is_distributed",
    "rank",
    "world_size",
    "FP8ZeroOptimizer",
    "partition_by_size",
    "save_checkpoint",
    "load_checkpoint",
    "wrap",
    "fully_shard",
    "precompute_fp8_scales",
    "refresh_gathers",
    "save_fsdp_checkpoint",
    "load_fsdp_checkpoint",
    "FP8ColwiseParallel",
    "FP8RowwiseParallel",
    "PrepareFP8ModuleInput",
    "SharedReplicatedInput",
]
