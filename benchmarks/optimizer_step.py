"""Optimizer step time and memory: FP8AdamW (O2 layout) vs torch.optim.AdamW on the same parameters.

The parameter set is that of a GPT (default: 4 layers, 384 wide, byte vocabulary). torch's AdamW
runs on FP32 parameters with FP32 gradients (foreach, and fused where the device has it); FP8AdamW on
the O2 layout: FP16 scaled weights (the master), E4M3 gradients for matrices, FP32 1-D parameters.
Prints one JSON object: median step time of each (timed interleaved, see `interleaved_step_times`),
the ratio to torch's best, peak extra memory during a step (allocator peak on CUDA; peak resident
set on Linux CPUs) and optimizer-state bytes.

    python benchmarks/optimizer_step.py [--layers 4 --width 384 --steps 20 --device cpu --threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch
from common import machine

import fp8lm
from fp8lm.optim import FP8AdamW

_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def gpt_shapes(layers: int, width: int, vocab: int = 256, block: int = 256) -> list[tuple[int, ...]]:
    """Parameter shapes of a nanoGPT-style model (biases, LayerNorms, tied lm_head)."""
    shapes = [(vocab, width), (block, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,), (width,)]


def torch_params(shapes, device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device)
        params.append(p)
    return params


def fp8_params(shapes, device) -> list[torch.Tensor]:
    params = []
    for p in torch_params(shapes, device):
        if p.dim() < 2:
            params.append(p)
            continue
        q = torch.nn.Parameter(fp8lm.quantize(p.detach(), fp8lm.FP16))
        q.grad = fp8lm.quantize(p.grad, fp8lm.E4M3)
        params.append(q)
    return params


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state, shared storages counted once."""
    seen, total = set(), 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved_step_times(opts: dict, device: str, steps: int, warmup: int) -> dict[str, list[float]]:
    """Step times of each optimizer, timed in rounds that step every optimizer once, in a shuffled
    order: a change in the load of a shared machine hits all of them alike, so their ratios stay
    meaningful."""
    for _ in range(warmup):
        for opt in opts.values():
            opt.step()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in opts}
    order = list(opts.items())
    shuffle = random.Random(0).shuffle
    for _ in range(steps):
        # A new order each round: what runs just before a step (which caches it leaves cold, which
        # threads it leaves spinning) changes that step's time, so no optimizer keeps one neighbour.
        shuffle(order)
        for name, opt in order:
            t0 = time.perf_counter()
            opt.step()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_extra_bytes(opt, device: str) -> int:
    """Peak memory allocated during one step beyond what was allocated before it.

    CUDA: the caching allocator's peak. CPU: the peak resident set size (Linux), reset just before
    the step; it runs in a process with every allocation of 64 KiB or more mmap-ed (see `main`), so freed
    temporaries leave the resident set and reused heap memory cannot hide a new one.
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    base = _proc_status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    opt.step()
    return 1024 * (_proc_status_kb("VmHWM") - base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads")
    ap.add_argument("--skip-eager", action="store_true", help="leave out FP8AdamW(kernel='eager') (slow on big models)")
    ap.add_argument("--peak-memory-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.peak_memory_only and not args.device.startswith("cuda") and sys.platform == "linux":
        # Peak memory on CPU is measured in a child process in which glibc maps every allocation of
        # 64 KiB or more on its own and unmaps it when freed, so that the resident set follows the
        # live tensors. That setting slows some allocators' users down (torch's fused AdamW: 2.3 ->
        # 3.4 ms), so the step times come from this process, under the default malloc.
        child = subprocess.run(
            [sys.executable, *sys.argv, "--peak-memory-only"],
            env={**os.environ, _MMAP_ENV: "65536"},
            capture_output=True,
            text=True,
            check=True,
        )
        peaks = json.loads(child.stdout)
    else:
        peaks = None
    torch.set_num_threads(args.threads)
    shapes = gpt_shapes(args.layers, args.width)
    dev = args.device

    variants = {
        "torch_adamw_foreach": lambda: torch.optim.AdamW(torch_params(shapes, dev), foreach=True),
        "torch_adamw_fused": lambda: torch.optim.AdamW(torch_params(shapes, dev), fused=True),
        "fp8adamw": lambda: FP8AdamW(fp8_params(shapes, dev)),
        "fp8adamw_fp8_exp_avg_sq": lambda: FP8AdamW(fp8_params(shapes, dev), exp_avg_sq_dtype=fp8lm.E4M3),
        "fp8adamw_eager": lambda: FP8AdamW(fp8_params(shapes, dev), kernel="eager"),
    }
    if args.skip_eager:
        del variants["fp8adamw_eager"]
    results, opts = {}, {}
    for name, make in variants.items():
        try:
            opts[name] = make()
            opts[name].step()  # the first step allocates the state (and compiles)
        except (RuntimeError, ValueError) as err:  # e.g. fused=True on a device without the kernel
            results[name] = {"error": str(err).splitlines()[0]}
            opts.pop(name, None)
    if args.peak_memory_only:
        print(json.dumps({name: peak_extra_bytes(opt, dev) for name, opt in opts.items()}))
        return
    times = interleaved_step_times(opts, dev, args.steps, args.warmup)
    for name, opt in opts.items():
        results[name] = {
            "step_ms": 1e3 * statistics.median(times[name]),
            "peak_extra_bytes": peaks[name] if peaks is not None else peak_extra_bytes(opt, dev),
            "state_bytes": state_bytes(opt),
        }
    torch_best = min(
        (results[k] for k in ("torch_adamw_foreach", "torch_adamw_fused") if "step_ms" in results[k]),
        key=lambda r: r["step_ms"],
    )
    for name, r in results.items():
        if name.startswith("fp8") and "step_ms" in r:
            r["time_ratio_vs_torch_best"] = r["step_ms"] / torch_best["step_ms"]
            r["state_memory_ratio_vs_torch"] = r["state_bytes"] / torch_best["state_bytes"]
    print(
        json.dumps(
            {
                "benchmark": "optimizer_step",
                "machine": machine(),
                "device": dev,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "num_params": sum(torch.Size(s).numel() for s in shapes),
                "layers": args.layers,
                "width": args.width,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
