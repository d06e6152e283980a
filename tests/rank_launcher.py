"""Starts N local ranks of ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) with the environment
``torchrun --standalone`` gives them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ...), forked from this one process after it has imported torch and fp8lm's training
stack once. As torchrun's agent does, this process serves the rendezvous store on a port it already
holds, and the ranks join it as clients (``TORCHELASTIC_USE_AGENT_STORE``): no port is found free
and then listened on by a rank, which another process can take in between.

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

Under pytest (``FP8LM_TEST_FORK_DIR``, set by tests/conftest.py) even that one import is paid once
per session: this script, importing nothing heavy, hands its arguments, environment, working
directory and standard streams to a fork server (this script with ``--serve``), which imported
torch and fp8lm once and forks a launcher per request. A server serves one environment (the
variables that imports read: ``OMP_*``, ``TORCH*``, ``PYTHON*``, ...); another environment starts
another server. The launcher ends when this client does (a test's timeout), its ranks with it;
SIGTERM, SIGINT and SIGHUP sent to the client are passed on to the launcher.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings

FORK_DIR = "FP8LM_TEST_FORK_DIR"
# Variables read while torch and fp8lm import: a server serves only clients that agree on them.
IMPORT_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTHON", "FP8LM", "CUDA", "LD_")
SERVER_IDLE_S = 600.0  # a server left behind by a killed pytest exits after this long unused

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


def run_rank(rank: int, world: int, store_env: dict[str, str], target: list[str]) -> int:
    """In the forked child: torchrun's variables, then the module or script as ``__main__``."""
    os.environ.update(
        store_env,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        ROLE_WORLD_SIZE=str(world),
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


def read_port(fd: int) -> int | None:
    """In the forked child: the store's port, which the launcher writes once the store listens;
    None when the launcher closed the pipe without one."""
    data = b""
    while len(data) < 4:
        chunk = os.read(fd, 4 - len(data))
        if not chunk:
            return None
        data += chunk
    return struct.unpack("!I", data)[0]


def launch(argv: list[str], started=None) -> int:
    """Fork the ranks (after importing `PRELOAD`), serve their rendezvous store and wait for them;
    ``started()`` is called once they run. Returns the launcher's exit code."""
    from dist_launch import agent_store_env, hosted_store  # this script's folder is first on sys.path

    world, target = int(argv[0]), argv[1:]
    logs = None
    if target[:1] == ["--logs"]:
        logs, target = target[1], target[2:]
    for name in PRELOAD:
        __import__(name)
    children: dict[int, int] = {}
    launcher = os.getpid()
    # The ranks are forked before the store starts its thread (a fork copies only the forking
    # thread) and wait on this pipe for its port.
    port_in, port_out = os.pipe()
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            die_with(launcher)
            os.close(port_out)
            if logs is not None:
                to_log(os.path.join(logs, f"rank{rank}.log"))
            port = read_port(port_in)
            if port is None:
                print("rank_launcher: the launcher ended before its store listened", file=sys.stderr)
                os._exit(1)
            code = run_rank(rank, world, agent_store_env(port), target)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = rank
    os.close(port_in)
    try:
        store = hosted_store(world)  # kept alive until every rank has ended
        os.write(port_out, struct.pack("!I", store.port) * world)  # one write: each rank reads 4 bytes
    finally:
        os.close(port_out)
    if started is not None:
        started()
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


# -- the fork server ---------------------------------------------------------------------------


def _server_path(fork_dir: str, env) -> str:
    imports = sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV) and k != FORK_DIR)
    if any(not os.path.isabs(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p):
        imports.append(("cwd", os.getcwd()))  # a relative PYTHONPATH imports from the working directory
    key = hashlib.sha1(json.dumps([sys.executable, imports]).encode()).hexdigest()[:16]
    return os.path.join(fork_dir, key + ".sock")


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _server(path: str) -> socket.socket | None:
    """A connection to the server of ``path``, started first if there is none (one per path: a lock
    file), or None when it cannot start."""
    sock = _connect(path)
    if sock is not None:
        return sock
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(path)
        if sock is not None:
            return sock
        with open(path + ".log", "ab") as log:
            server = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve", path],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        with open(path[: -len(".sock")] + ".pid", "w") as f:
            f.write(str(server.pid))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            sock = _connect(path)
            if sock is not None:
                return sock
            time.sleep(0.05)
    return None


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def through_server(fork_dir: str, argv: list[str]) -> int | None:
    """Run ``argv`` by the fork server of this environment; None when there is none to be had."""
    sock = _server(_server_path(fork_dir, os.environ))
    if sock is None:
        return None
    with sock:
        request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        streams = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
        socket.send_fds(sock, [struct.pack("!I", len(request))], streams)
        sock.sendall(request)
        try:
            (pid,) = struct.unpack("!i", _recv_exact(sock, 4))
        except EOFError:
            return None  # the server went away before it forked: launch here
        received: list[int] = []

        def forward(sig, frame):
            received.append(sig)
            os.kill(pid, sig)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        try:
            (code,) = struct.unpack("!i", _recv_exact(sock, 4))
            return code
        except EOFError:
            if received:  # ended by the signal passed on: end as it would have ended this process
                signal.signal(received[0], signal.SIG_DFL)
                os.kill(os.getpid(), received[0])
            print("rank_launcher: the launcher ended without an exit code", file=sys.stderr)
            return 1


def _handle(conn: socket.socket) -> None:
    """In a child of the server: one launch with the client's streams, environment and directory."""
    msg, fds, _, _ = socket.recv_fds(conn, 4, 3)
    (length,) = struct.unpack("!I", msg)
    request = json.loads(_recv_exact(conn, length))
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [os.path.abspath(__file__), *request["argv"]]
    conn.sendall(struct.pack("!i", os.getpid()))

    def end_with_the_client():  # after the ranks are forked: a thread, not a process
        conn.recv(1)  # the client sends nothing more: this returns when it is gone
        os._exit(1)  # the ranks follow (PR_SET_PDEATHSIG)

    try:
        code = launch(
            request["argv"], started=lambda: threading.Thread(target=end_with_the_client, daemon=True).start()
        )
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    conn.sendall(struct.pack("!i", code))


def serve(path: str) -> None:
    """Import `PRELOAD`, then fork one launcher per connection until idle for `SERVER_IDLE_S`."""
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(SERVER_IDLE_S)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            break
        conn.settimeout(None)
        while True:  # reap the launchers that ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        pid = os.fork()
        if pid == 0:
            listener.close()
            try:
                _handle(conn)
            finally:
                os._exit(0)
        conn.close()
    listener.close()
    for leftover in (path, path[: -len(".sock")] + ".pid"):  # no pid left for another process to reuse
        if os.path.exists(leftover):
            os.unlink(leftover)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        serve(argv[1])
        return 0
    fork_dir = os.environ.get(FORK_DIR)
    if fork_dir:
        code = through_server(fork_dir, argv)
        if code is not None:
            return code
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
