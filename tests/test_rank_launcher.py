"""tests/rank_launcher.py through its fork server: what a launch prints and returns is what the ranks
did, and a client killed by a test's timeout takes its launcher and ranks with it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a server that imports torch, and ranks

LAUNCHER = Path(__file__).resolve().parent / "rank_launcher.py"

RANK_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} in {os.getcwd()} sees {os.environ.get('PROBE')}", flush=True)
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
open(os.path.join(sys.argv[1], f"printed{rank}-{os.environ.get('PROBE')}"), "w").close()
if sys.argv[2] == "sleep":
    time.sleep(600)
if sys.argv[2] == "fail" and rank == 1:
    # a failing rank stops the others (as torchrun): fail only once rank 0 has printed its line
    printed = os.path.join(sys.argv[1], f"printed0-{os.environ.get('PROBE')}")
    deadline = time.time() + 60
    while not os.path.exists(printed) and time.time() < deadline:
        time.sleep(0.01)
    sys.exit(3)
if sys.argv[2] == "store":
    # before any rank joins a process group, the store is there to join as a client
    import datetime, torch.distributed as dist
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=20))
    store.set(f"rank{rank}", "here")
    print(f"rank {rank} met rank {1 - rank}: {store.get(f'rank{1 - rank}').decode()}", flush=True)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # an exited rank its parent has not reaped yet is gone


def test_launches_through_one_server_and_end_with_their_client(tmp_path):
    fork_dir = tmp_path / "fork"
    fork_dir.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "FP8LM_TEST_FORK_DIR": str(fork_dir), "OMP_NUM_THREADS": "1", "PROBE": "first"}
    run = [sys.executable, str(LAUNCHER), "2", str(script), str(tmp_path)]
    try:
        first = subprocess.run([*run, "ok"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr
        assert f"rank 1 of 2 in {tmp_path} sees first" in first.stdout
        (server_pid,) = [int(p.read_text()) for p in fork_dir.glob("*.pid")]

        # The same server forks the next launch, with this client's environment and exit code.
        second = subprocess.run(
            [*run, "fail"], env={**env, "PROBE": "second"}, capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 3 and "rank 0 of 2" in second.stdout and "sees second" in second.stdout
        assert [int(p.read_text()) for p in fork_dir.glob("*.pid")] == [server_pid]

        # A test's timeout kills the client alone (SIGKILL): its ranks go with it.
        for p in tmp_path.glob("pid*"):
            p.unlink()
        client = subprocess.Popen([*run, "sleep"], env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while sum(1 for p in tmp_path.glob("pid*") if p.read_text()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = [int(p.read_text()) for p in tmp_path.glob("pid*")]
        assert len(ranks) == 2 and all(alive(pid) for pid in ranks)
        client.send_signal(signal.SIGKILL)
        client.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in ranks)
    finally:
        for pid_file in fork_dir.glob("*.pid"):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)


def test_the_launcher_serves_the_store_the_ranks_join(tmp_path):
    """As torchrun's agent: no rank listens on a port found free earlier (another process may have
    taken it since); the launcher holds the store's port before the ranks start."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "FP8LM_TEST_FORK_DIR"}
    run = [sys.executable, str(LAUNCHER), "2", str(script), str(tmp_path), "store"]
    done = subprocess.run(run, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 met rank 1: here" in done.stdout and "rank 1 met rank 0: here" in done.stdout
