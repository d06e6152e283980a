"""Runs a worker script on N local ranks the way torchrun would (its env vars, gloo), and
collects what each rank saved. A rank's exit code must be 0: an abort or a crash fails the test."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def hosted_store(world_size: int) -> torch.distributed.TCPStore:
    """A rendezvous store served from this process on a port the kernel picks and this process
    holds, as torchrun's agent serves one: ranks started with `agent_store_env` join it as clients.

    Why: a port found free and handed to rank 0 to listen on can be taken in between (measured:
    EADDRINUSE once in a full parallel suite, where gloo's own connections take ephemeral ports)."""
    return torch.distributed.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False
    )


def agent_store_env(port: int) -> dict[str, str]:
    """The variables that make `torch.distributed.init_process_group` join the store of `hosted_store`
    on ``port`` as a client, as a worker of torchrun's agent joins the agent's."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def forked_ranks(ranks: int, *args: str) -> list[str]:
    """The command that starts ``ranks`` local ranks of ``args`` (``-m MODULE ...`` or a script) with
    torchrun's environment, forked from one process that imported torch and fp8lm once
    (tests/rank_launcher.py says why). Tests of torchrun itself launch torchrun."""
    return [sys.executable, str(HERE / "rank_launcher.py"), str(ranks), *args]


def launch(script: str, world_size: int, *args: str, timeout: float = 120.0) -> tuple[list[int], list[str], list]:
    """Start ``world_size`` processes of ``tests/<script>`` with torchrun's env vars (forked from one
    process, independent of each other: tests/rank_launcher.py ``--logs``); each gets an output dir
    as its first argument and may save ``rank{r}.pt`` there. Returns the exit codes, the logs and
    the loaded results (None where a rank saved nothing)."""
    with tempfile.TemporaryDirectory() as out:
        logs_dir = Path(out) / "logs"
        logs_dir.mkdir()
        command = forked_ranks(world_size, "--logs", str(logs_dir), str(HERE / script), out, *args)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        launcher = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and every rank it forked
            launcher.wait()
            raise AssertionError(f"{script} on {world_size} ranks did not finish in {timeout} s") from None
        if launcher.returncode != 0:
            raise AssertionError(f"the launcher of {script} failed with exit code {launcher.returncode}")
        codes = [int((logs_dir / f"rank{r}.code").read_text()) for r in range(world_size)]
        logs = [(logs_dir / f"rank{r}.log").read_text() for r in range(world_size)]
        files = [Path(out) / f"rank{r}.pt" for r in range(world_size)]
        results = [torch.load(f, weights_only=False) if f.exists() else None for f in files]
        return codes, logs, results


def run_workers(script: str, world_size: int, *args: str, timeout: float = 120.0) -> list[dict]:
    """`launch`, requiring every rank to exit with 0; returns the loaded results."""
    codes, logs, results = launch(script, world_size, *args, timeout=timeout)
    if any(codes):
        detail = "\n".join(f"--- rank {r} (exit {c}) ---\n{log[-3000:]}" for r, (c, log) in enumerate(zip(codes, logs)))
        raise AssertionError(f"{script} on {world_size} ranks failed:\n{detail}")
    return results


@functools.cache
def run_workers_once(script: str, world_size: int) -> list[dict]:
    """`run_workers` once per test session for a script and world size (shared by test modules)."""
    return run_workers(script, world_size)


def worker_main(checks) -> None:
    """Worker side: join the group, run ``checks(rank, world_size) -> dict``, save it, exit cleanly."""
    import traceback

    from fp8lm.distributed import setup, shutdown

    out = Path(sys.argv[1])
    try:
        rank, world = setup(timeout_s=60)
        result = checks(rank, world, *sys.argv[2:])
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        traceback.print_exc()
        shutdown(1)
    shutdown(0)
