"""Quantize throughput vs a same-size memory copy, printed as JSON.

Times, on one tensor of float32 values (default 256 MB):
- ``copy``: ``dst.copy_(x)`` into an existing buffer, and ``clone``: a copy into a new tensor;
- ``quantize``: `fp8lm.quantize` (amax pass, then the fused scale-clamp-cast), new payload;
- ``cast_with_amax``: the delayed-scaling kernel (scale known, amax of x taken in the same pass).
Throughput is input bytes per second; ratios compare with the copies.

    python benchmarks/quantize.py [--mb 256] [--device cpu]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import keep_freed_memory, machine, median_time

import fp8lm
from fp8lm.ops.cast import saturating_cast_with_amax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="size of the float32 input in MB")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--fresh-pages", action="store_true", help="leave glibc's default of mapping new pages per large tensor"
    )
    args = parser.parse_args()
    heap_reuse = False if args.fresh_pages else keep_freed_memory()

    numel = args.mb * (1 << 20) // 4
    x = torch.randn(numel, device=args.device)
    dst = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    scale = fp8lm.compute_scale(x.abs().amax(), fp8lm.E4M3)
    times = {
        "copy": median_time(lambda: dst.copy_(x), args.reps),
        "clone": median_time(lambda: x.clone(), args.reps),
        "quantize": median_time(lambda: fp8lm.quantize(x, fp8lm.E4M3), args.reps),
        "cast_with_amax": median_time(lambda: saturating_cast_with_amax(x, scale, fp8lm.E4M3), args.reps),
    }
    gbps = {k: nbytes / t / 1e9 for k, t in times.items()}
    print(
        json.dumps(
            {
                "benchmark": "quantize",
                "machine": machine(),
                "device": args.device,
                "input_mb": args.mb,
                "heap_reuse": heap_reuse,
                "seconds": times,
                "input_GB_per_s": gbps,
                "ratio_quantize_vs_copy": times["copy"] / times["quantize"],
                "ratio_quantize_vs_clone": times["clone"] / times["quantize"],
                "ratio_cast_with_amax_vs_copy": times["copy"] / times["cast_with_amax"],
                "ratio_cast_with_amax_vs_clone": times["clone"] / times["cast_with_amax"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
