"""Worker for the dead-rank test: the last rank dies after one step; the others must fail with
a clear error within the process group's timeout instead of hanging."""

import os
import sys
import time
from pathlib import Path

import torch

from fp8lm.distributed import FP8DataParallel, setup

TIMEOUT_S = 15


def main():
    out = Path(sys.argv[1])
    rank, world = setup(timeout_s=TIMEOUT_S)
    ddp = FP8DataParallel(torch.nn.Linear(8, 8))
    ddp(torch.randn(4, 8)).sum().backward()  # one synchronized step works
    if rank == world - 1:
        os._exit(17)  # killed mid-run
    start = time.monotonic()
    try:
        ddp(torch.randn(4, 8)).sum().backward()
        error = None
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    torch.save({"error": error, "seconds": time.monotonic() - start}, out / f"rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0 if error else 1)


if __name__ == "__main__":
    main()
