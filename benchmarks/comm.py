"""FP8 vs BF16 vs FP32 gradient all-reduce: time, bytes sent (comm_stats) and error.

Run under torchrun, e.g. (4 gloo ranks, a 100M-element FP32 gradient per rank):

    torchrun --nproc_per_node 4 benchmarks/comm.py --numel 100000000 --reps 3

Rank 0 prints one JSON object. Times are medians over ``--reps`` after one warm-up call, each
call between barriers; on a CPU-only machine they include the local quantize / sum work, which
is what a gloo run pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from fp8lm.distributed import (  # noqa: E402
    comm_stats,
    ddp_bytes,
    fp8_all_reduce,
    reset_comm_stats,
    setup,
    shared_scale_all_reduce,
    shutdown,
)


def timed(fn, reps: int):
    fn()  # warm-up (first use compiles the fused cast)
    times, out = [], None
    for _ in range(reps):
        dist.barrier()
        reset_comm_stats()
        start = time.perf_counter()
        out = fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times), comm_stats(), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=10_000_000, help="gradient elements per rank")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rank, world = setup(timeout_s=1800)
    g = torch.Generator().manual_seed(rank)
    grad = torch.randn(args.numel, generator=g) * 1e-3

    def plain(dtype):
        def run():
            t = grad.to(dtype, copy=True)
            dist.all_reduce(t)
            return t.float() / world

        return run

    results = {}
    t_fp32, _, exact = timed(plain(torch.float32), args.reps)
    exact_norm = float(exact.norm())
    t_bf16, _, bf16 = timed(plain(torch.bfloat16), args.reps)
    results["fp32"] = {"seconds": t_fp32, "bytes_sent": ddp_bytes(args.numel, 4, world)}
    results["bf16"] = {
        "seconds": t_bf16,
        "bytes_sent": ddp_bytes(args.numel, 2, world),
        "rel_l2_error_vs_fp32": float((bf16 - exact).norm()) / exact_norm,
    }
    del bf16
    t, stats, out = timed(lambda: fp8_all_reduce(grad, average=True), args.reps)
    results["fp8"] = {
        "seconds": t,
        "bytes_sent": stats["total_bytes"],
        "comm_stats": stats,
        "rel_l2_error_vs_fp32": float((out - exact).norm()) / exact_norm,
    }
    del out
    t, stats, (out, saturated) = timed(lambda: shared_scale_all_reduce(grad, mu=1.0 / world, average=True), args.reps)
    results["fp8_shared_scale_pre"] = {
        "seconds": t,
        "bytes_sent": stats["total_bytes"],
        "saturated": saturated,
        "rel_l2_error_vs_fp32": float((out - exact).norm()) / exact_norm,
    }
    del out
    for key in ("fp8", "fp8_shared_scale_pre", "bf16"):
        results[key]["bytes_vs_fp32"] = results[key]["bytes_sent"] / results["fp32"]["bytes_sent"]
        results[key]["bytes_vs_bf16"] = results[key]["bytes_sent"] / results["bf16"]["bytes_sent"]
        results[key]["time_vs_bf16"] = results[key]["seconds"] / t_bf16
    if rank == 0:
        print(
            json.dumps(
                {
                    "benchmark": "grad_all_reduce",
                    "world_size": world,
                    "backend": dist.get_backend(),
                    "numel": args.numel,
                    "reps": args.reps,
                    "results": results,
                    "machine": machine(),
                },
                indent=2,
            )
        )
    shutdown(0)


if __name__ == "__main__":
    main()
