"""Starts N local ranks of ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) with the environment
``torchrun --standalone`` gives them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free port, ...), forked from this one process after it has imported torch and
fp8lm's training stack once.

Why: a rank started by torchrun spends about 5 s of CPU importing torch, DTensor, Distributed
Checkpoint and the pipelining schedules before it does anything, and torchrun's agent another 2 s;
on a 2-core machine that is most of a short multi-rank test. Forking shares the imported modules
instead. Nothing else differs for the code under test: each rank is its own process with its own
gloo group. As torchrun does, the first rank that fails stops the others (SIGTERM) and its exit code
is this launcher's. The tests of torchrun's own behaviour (its restarts, a rank it kills) launch
torchrun itself.

    python tests/rank_launcher.py 4 -m fp8lm.cli train --tp 2 --fsdp ...
    python tests/rank_launcher.py 2 --logs DIR tests/dist_tp.py OUT   # each rank on its own

With ``--logs DIR`` the ranks are independent processes, as ``tests/dist_launch.launch`` starts
them: rank r writes its output to ``DIR/rank<r>.log`` and its exit code to ``DIR/rank<r>.code``,
and no rank is stopped when another fails (what a survivor does on its own may be under test).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import traceback
import warnings

from dist_launch import free_port  # this script's folder is first on sys.path

PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "fp8lm.cli",
    "fp8lm.train.loop",
)


def run_rank(rank: int, world: int, port: int, target: list[str]) -> int:
    """In the forked child: torchrun's variables, then the module or script as ``__main__``."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            # The module was preloaded on purpose; runpy warns that it runs it again as __main__.
            warnings.filterwarnings("ignore", "'.*' found in sys.modules after import", RuntimeWarning)
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def die_with(parent: int) -> None:
    """Linux: this rank is killed when the launcher dies (a test's timeout kills the launcher alone),
    so no rank outlives a failed test holding a core."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def to_log(path: str) -> None:
    """This process's stdout and stderr (the file descriptors: child processes too) into ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str]) -> int:
    world, target = int(argv[0]), argv[1:]
    logs = None
    if target[:1] == ["--logs"]:
        logs, target = target[1], target[2:]
    for name in PRELOAD:
        __import__(name)
    port = free_port()
    children: dict[int, int] = {}
    launcher = os.getpid()
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            die_with(launcher)
            if logs is not None:
                to_log(os.path.join(logs, f"rank{rank}.log"))
            code = run_rank(rank, world, port, target)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = rank
    failed = 0
    while children:
        pid, status = os.wait()
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if logs is not None:
            with open(os.path.join(logs, f"rank{rank}.code"), "w") as f:
                f.write(str(code))
        elif code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            for other in children:  # torchrun stops the other ranks when one fails
                os.kill(other, signal.SIGTERM)
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
