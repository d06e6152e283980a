"""Peak resident memory of packing one big corpus file (`fp8lm.train.data.pack`), measured in a
child process: packing streams, so the peak must stay far below the file's size.

    python benchmarks/pack_memory.py --size-mb 1024

Writes a text file of ``--size-mb`` MiB (printable lines from a seeded generator) in a temporary
folder, packs it in a fresh interpreter (``resource.getrusage``'s ``ru_maxrss`` after packing, and
after the imports alone), checks that the two splits hold exactly the file's bytes, and deletes
everything. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

MIB = 1 << 20

CHILD = """
import json, resource, sys, time
from fp8lm.train.data import pack, path_documents
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
splits = pack(*path_documents(sys.argv[1]), sys.argv[2], 0.05)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_rss_bytes": peak, "rss_after_imports_bytes": imported, "pack_s": seconds, **splits.info}))
"""


def write_corpus(path: Path, size: int, seed: int) -> None:
    """``size`` bytes of printable lines, written a MiB at a time."""
    rng = random.Random(seed)
    words = [bytes(rng.choices(range(97, 123), k=rng.randint(1, 9))) for _ in range(4096)]
    block = bytearray()
    while len(block) < MIB:
        block += b" ".join(rng.choices(words, k=12)) + b"\n"
    block = block[:MIB]
    with open(path, "wb") as f:
        written = 0
        while written < size:
            piece = bytes(block[: min(MIB, size - written)])
            f.write(piece)
            written += len(piece)
            block = block[1:] + block[:1]  # not one repeated MiB: every block differs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    size = args.size_mb * MIB
    with tempfile.TemporaryDirectory() as tmp:
        corpus, cache = Path(tmp) / "corpus.txt", Path(tmp) / "cache"
        t0 = time.perf_counter()
        write_corpus(corpus, size, args.seed)
        write_s = time.perf_counter() - t0
        child = subprocess.run([sys.executable, "-c", CHILD, str(corpus), str(cache)], capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(child.stderr)
        result = json.loads(child.stdout)
        result.pop("source")  # a temporary path
        packed = sum(f.stat().st_size for f in cache.glob("*.bin"))
    print(
        json.dumps(
            {
                "benchmark": "pack_memory",
                "config": vars(args),
                "machine": machine(),
                "file_bytes": size,
                "packed_bytes": packed,
                "all_bytes_packed": packed == size,
                **result,
                "peak_rss_over_file": result["peak_rss_bytes"] / size,
                "packing_rss_over_file": (result["peak_rss_bytes"] - result["rss_after_imports_bytes"]) / size,
                "write_corpus_s": write_s,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
