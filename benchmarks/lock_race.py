"""Two `fp8lm train` on one ``--out``, the second started 0 to ``--max-gap`` seconds after the
first: exactly one must run and the other be refused in one line, and the finished run's files
must be what a run alone writes.

    python benchmarks/lock_race.py --trials 20 --max-gap 2 --seed 0

Each trial starts both processes on a new folder (a tiny model, a few steps, one shared token
cache packed beforehand) and checks: exit codes 0 and 2; the refused one's stderr is one
``fp8lm train: error:`` line; the folder holds the same files as a solo run's and its
``metrics.jsonl`` is byte-identical to it; the files hashed when the winner exited are unchanged
after the other one exited. Prints one JSON object: the counts and every trial.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "email"  # real text, the same on every machine


def command(out: Path, cache: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fp8lm.cli",
        "train",
        "--model",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--telemetry-every",
        "0",
        "--steps",
        str(steps),
        "--data",
        str(CORPUS),
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
        "--no-progress",
    ]


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` but the lock file, by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def trial(out: Path, cache: Path, steps: int, gap: float, solo: dict[str, str]) -> dict:
    procs = [subprocess.Popen(command(out, cache, steps), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)]
    time.sleep(gap)
    procs.append(subprocess.Popen(command(out, cache, steps), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    at_winner_exit = None
    while any(p.poll() is None for p in procs):
        winner_done = any(p.returncode == 0 for p in procs)
        if winner_done and at_winner_exit is None:
            at_winner_exit = hashes(out)
        time.sleep(0.05)
    results = [(p.returncode, p.communicate()[1].decode(errors="replace")) for p in procs]
    final = hashes(out)
    if at_winner_exit is None:  # both ended within one poll: the last state is the winner's
        at_winner_exit = final
    codes = [rc for rc, _ in results]
    refused = [err for rc, err in results if rc != 0]
    line = refused[0].strip().replace(str(out), "OUT") if len(refused) == 1 else ""
    one_line = len(refused) == 1 and refused[0].count("\n") == 1 and line.startswith("fp8lm train: error: ")
    traceback = any("Traceback" in err for _, err in results)
    same_files = sorted(final) == sorted(solo)
    same_metrics = final.get("metrics.jsonl") == solo.get("metrics.jsonl")
    return {
        "gap_s": round(gap, 3),
        "exit_codes": codes,
        "winner": codes.index(0) if codes.count(0) == 1 else None,
        "one_ran_one_refused": sorted(codes) == [0, 2],
        "refused_in_one_line": one_line,
        "refusal": re.sub(r"pid \d+", "pid N", line),
        "traceback": traceback,
        "files_as_a_solo_run": same_files and same_metrics,
        "unchanged_after_winner_exit": at_winner_exit == final,
    }


def reason(line: str) -> str:
    if "is in use by another run" in line:
        return "lock held"
    if "already holds a training run" in line:
        return "finished run"
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--max-gap", type=float, default=2.0, help="the second start, 0 to this many seconds later")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        solo_out = root / "solo"
        subprocess.run(command(solo_out, root / "cache", args.steps), env=ENV, check=True, capture_output=True)
        solo = hashes(solo_out)
        solo = {k: v for k, v in solo.items() if not k.startswith("cache")}
        trials = []
        for i in range(args.trials):
            result = trial(root / f"run{i}", root / "cache", args.steps, rng.uniform(0, args.max_gap), solo)
            trials.append(result)
            print(json.dumps({"trial": i, **result}), file=sys.stderr, flush=True)
    keys = ("one_ran_one_refused", "refused_in_one_line", "files_as_a_solo_run", "unchanged_after_winner_exit")
    totals = {key: sum(t[key] for t in trials) for key in keys}
    totals["traceback"] = sum(t["traceback"] for t in trials)
    reasons: dict[str, int] = {}
    for t in trials:
        reasons[reason(t["refusal"])] = reasons.get(reason(t["refusal"]), 0) + 1
    print(
        json.dumps(
            {
                "benchmark": "lock_race",
                "config": vars(args),
                "machine": machine(),
                "trials": len(trials),
                "totals": totals,
                "refusal_reasons": reasons,
                "runs": trials,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
