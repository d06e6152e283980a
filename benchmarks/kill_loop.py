"""kill -9 of `fp8lm train` at random moments, during checkpoint saves and in the gap between the
final checkpoint and ``summary.json``; each killed run is continued with ``--resume`` (and killed
again) until it finishes, then its ``metrics.jsonl`` is compared with an uninterrupted run's.

    python benchmarks/kill_loop.py --runs 4 --kills 3
    python benchmarks/kill_loop.py --ranks 4 --flags "--tp 2 --pp 2 --pp-microbatches 2" --runs 2 --kills 3

With ``--ranks N`` each attempt is a ``torchrun`` of N ranks (``--flags``: its layout), and a kill
is a kill -9 of the launcher and every rank at once (all stopped first), as when a node dies.

Prints one JSON object: kills per moment, runs finished, runs whose metrics equal the
uninterrupted run's byte for byte, attempts that ended before their kill, the last stderr line of
any attempt that failed, and temporary files left at the end. A tiny model and few steps: a run takes seconds on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# where to kill: a random moment, while a checkpoint's temporary file exists, or when the final
# checkpoint exists but summary.json does not
MOMENTS = ("random", "saving", "final_gap")


LAUNCH: list[str] = []  # set by main: torchrun's command line for --ranks N, empty for one process
FLAGS: list[str] = []  # set by main: the layout's flags (--flags)


def command(out: Path, cache: Path, level: str, steps: int, resume: bool) -> list[str]:
    data = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
    return [
        sys.executable,
        *LAUNCH,
        "-m",
        "fp8lm.cli",
        "train",
        "--model",
        "tiny",
        "--opt-level",
        level,
        "--steps",
        str(steps),
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--eval-every",
        "5",
        "--eval-batches",
        "2",
        "--save-every",
        "2",
        "--keep-checkpoints",
        "2",
        "--data",
        data,
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
        "--no-progress",
        *FLAGS,
        *(["--resume"] if resume else []),
    ]


def seen(out: Path, moment: str, steps: int, pid: int) -> bool:
    """Whether the run in ``out`` (process ``pid``) is at ``moment`` now."""
    checkpoints = out / "checkpoints"
    if moment == "saving":  # its own temporary checkpoint file (under torchrun: rank 0's, any pid)
        suffix = f".pt.tmp{pid}" if not LAUNCH else ".pt.tmp"
        return checkpoints.is_dir() and any(suffix in p.name for p in checkpoints.iterdir())
    final = checkpoints / f"step_{steps:08d}.pt"
    return final.exists() and not (out / "summary.json").exists()


def kill_once(argv: list[str], out: Path, moment: str, steps: int, rng: random.Random, limit_s: float) -> str:
    """Start ``argv``, kill -9 it at ``moment``; returns what happened: killed, finished, or the error line."""
    proc = subprocess.Popen(
        argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + (rng.uniform(0.5, limit_s) if moment == "random" else 600)
    while proc.poll() is None and time.monotonic() < deadline:
        if moment != "random" and seen(out, moment, steps, proc.pid):
            break
        time.sleep(0.002)
    if proc.poll() is None:
        kill_tree(proc.pid)  # the launcher and every rank it started (each in a session of its own)
        proc.wait()
        return "killed"
    return "finished" if proc.returncode == 0 else f"exit {proc.returncode}: {error_line(proc.stderr.read())}"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: torchrun starts each rank in a session of its own,
    so a kill of the launcher's process group would leave the ranks running)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # gone meanwhile
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


def kill_tree(pid: int) -> None:
    """kill -9 of ``pid`` and everything below it, stopped first so that none reacts to another's end."""
    tree = [pid, *descendants(pid)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in tree:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass


def error_line(stderr: str) -> str:
    """fp8lm's one-line error of a failed attempt (under torchrun, among the launcher's report)."""
    lines = stderr.strip().splitlines()
    ours = [line for line in lines if line.startswith("fp8lm train: error")]
    return (ours or lines or [""])[-1]


def trial(
    root: Path, cache: Path, level: str, steps: int, kills: int, rng: random.Random, limit_s: float, counts: dict
) -> tuple[Path, bool]:
    """One run killed ``kills`` times, then resumed to the end; returns its folder and whether it finished."""
    out = root / f"run{len(list(root.iterdir()))}"
    for _ in range(kills):
        if (out / "summary.json").exists():  # finished before a kill: nothing left to kill
            break
        moment = rng.choice(MOMENTS)
        resume = (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step_*.pt"))
        result = kill_once(command(out, cache, level, steps, resume), out, moment, steps, rng, limit_s)
        if result == "killed":
            counts["kills"][moment] += 1
        elif result == "finished":
            counts["finished_before_the_kill"] += 1
        else:
            counts["errors"].append(result)
    resume = (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step_*.pt"))
    if (out / "summary.json").exists():
        return out, True
    done = subprocess.run(command(out, cache, level, steps, resume), env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        counts["errors"].append(error_line(done.stderr))
    return out, done.returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4, help="runs, each killed --kills times (default: %(default)s)")
    p.add_argument("--kills", type=int, default=3, help="kills per run (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="steps per run (default: %(default)s)")
    p.add_argument("--level", default="O2", help="opt level (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default: %(default)s)")
    p.add_argument("--ranks", type=int, default=1, help="torchrun ranks per attempt (default: %(default)s)")
    p.add_argument("--flags", default="", help="the layout's flags of fp8lm train, e.g. '--tp 2 --pp 2'")
    args = p.parse_args()
    FLAGS[:] = args.flags.split()
    if args.ranks > 1:
        LAUNCH[:] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks)]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        cache, runs = tmp_path / "cache", tmp_path / "runs"
        runs.mkdir()
        t0 = time.monotonic()
        subprocess.run(
            command(tmp_path / "whole", cache, args.level, args.steps, False), env=ENV, check=True, capture_output=True
        )
        limit_s = time.monotonic() - t0  # kill at random within one uninterrupted run's time
        reference = (tmp_path / "whole" / "metrics.jsonl").read_bytes()
        counts: dict = {"kills": dict.fromkeys(MOMENTS, 0), "finished_before_the_kill": 0, "errors": []}
        finished = identical = 0
        for _ in range(args.runs):
            out, ok = trial(runs, cache, args.level, args.steps, args.kills, rng, limit_s, counts)
            if ok:
                finished += 1
                identical += (out / "metrics.jsonl").read_bytes() == reference
        leftovers = [str(p.relative_to(runs)) for p in runs.rglob(".*.tmp*")]
    print(
        json.dumps(
            {
                "level": args.level,
                "ranks": args.ranks,
                "flags": args.flags,
                "steps": args.steps,
                "runs": args.runs,
                "finished": finished,
                "metrics_identical": identical,
                **counts,
                "temporaries_left": leftovers,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
