"""`fp8lm train` and `fp8lm compare` on 2 gloo ranks: O2 (FP8DataParallel) and O3 (FP8 ZeRO) runs
write their summaries with communication bytes; a rank killed mid-run stops the other with a
clear error; resuming (by hand, and by `torchrun --max-restarts 1` after a real SIGKILL of a
worker) continues from the last checkpoint and writes the uninterrupted run's metrics and
telemetry byte for byte."""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from dist_launch import agent_store_env, forked_ranks, hosted_store

pytestmark = pytest.mark.slow  # every test here runs 2-rank training processes

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")  # real text, quick to scan
STEPS = 16
# One thread per rank: the same float sums in every process, so runs compare bit for bit. Eager
# casts and optimizer steps (no torch.compile): each of these short-lived processes would spend
# seconds compiling them; the compiled paths are tested in process (tests/test_train.py).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
TIMEOUT_S = 180


HEAD_PARAMS = 256 * 32  # the tiny preset's output head: vocabulary x width


def run_options(out: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "--model",
        "tiny",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--steps",
        str(STEPS),
        "--eval-every",
        "8",
        "--eval-batches",
        "2",
        "--save-every",
        "4",
        "--keep-checkpoints",
        "2",
        "--telemetry-every",
        "3",
        "--data",
        EMAIL,
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def torchrun(*args: str) -> list[str]:
    """torchrun itself on 2 ranks: the reference runs and the restart test launch ranks the way users
    do; the other multi-rank tests fork theirs (tests/rank_launcher.py)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def check(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("dist_train")


@pytest.fixture(scope="module")
def uninterrupted(work):
    """`fp8lm compare --levels O2,O3` on 2 ranks, uninterrupted: the reference runs."""
    out = work / "whole"
    args = ["-m", "fp8lm.cli", "compare", "--levels", "O2,O3", *run_options(out, work / "cache")]
    log = check(subprocess.run(torchrun(*args), env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S))
    return out, log


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_two_rank_o2_and_o3_summaries_report_fp8_communication(uninterrupted):
    out, log = uninterrupted
    assert "comparison:" in log and log.count("level ") == 1  # rank 0 alone prints the table
    for level in ("O2", "O3"):
        s = read(out / level / "summary.json")
        assert s["world_size"] == 2 and s["opt_level"] == level and s["steps"] == STEPS
        n = s["num_params"]
        assert s["ddp_fp32_bytes_per_step"] == 2 * (1 / 2) * 4 * n  # all-reduce: 2 (N-1)/N x size
        assert s["ddp_bf16_bytes_per_step"] == 2 * (1 / 2) * 2 * n
        records = [json.loads(line) for line in (out / level / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert s["comm_bytes_per_step"] == sum(r["comm_bytes"] for r in records) / STEPS
        # FP8 payloads: about 1 byte per parameter and step at 2 ranks, 2 per output-head
        # parameter (its gradient in BF16; O3 reduces it to its owner alone, and all-gathers its
        # few FP32 vectors in FP32, a larger share of this tiny model than of real ones)
        head = HEAD_PARAMS if level == "O2" else 0
        assert n + head <= s["comm_bytes_per_step"] <= (1.06 if level == "O2" else 1.35) * (n + HEAD_PARAMS)
        assert (out / level / "telemetry.jsonl").stat().st_size > 0
    assert read(out / "compare.json")["levels"].keys() == {"O2", "O3"}
    o3 = sorted((out / "O3" / "checkpoints").iterdir())
    assert [p.name for p in o3] == ["step_00000012.dcp", "step_00000012.pt", "step_00000016.dcp", "step_00000016.pt"]


def launch_ranks(args: list[str]) -> tuple[list[subprocess.Popen], object]:
    """Two ranks with torchrun's environment but no torchrun agent (which would itself stop the
    survivor of a killed rank): what the survivor does on its own is under test. This process
    serves their rendezvous store, as the agent would (`hosted_store` says why): the caller keeps
    the store returned with the processes until they end."""
    store = hosted_store(2)
    procs = []
    for rank in range(2):
        env = {
            **ENV,
            **agent_store_env(store.port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "fp8lm.cli", *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs, store


def wait_for(path: Path, procs) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert all(p.poll() is None for p in procs), "a rank ended before the checkpoint was written"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_killed_rank_stops_the_other_with_a_clear_error_then_resume_matches(uninterrupted, work):
    out = work / "killed"
    procs, _store = launch_ranks(["train", "--opt-level", "O2", *run_options(out, work / "cache")])
    wait_for(out / "checkpoints" / "step_00000004.pt", procs)
    procs[1].send_signal(signal.SIGKILL)
    try:
        log = procs[0].communicate(timeout=60)[0]  # the survivor stops on its own, without hanging
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 still ran 60 s after rank 1 was killed: it hangs instead of stopping")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 1, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("fp8lm train: error: rank 0: stopped: ") and "another rank" in last, last
    assert not (out / "summary.json").exists()

    procs, _store = launch_ranks(["train", "--opt-level", "O2", *run_options(out, work / "cache", "--resume")])
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    whole = uninterrupted[0] / "O2"
    for name in ("metrics.jsonl", "telemetry.jsonl"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert read(out / "summary.json")["val_loss"] == read(whole / "summary.json")["val_loss"]


def worker_pid(agent: subprocess.Popen, rank: int) -> int | None:
    """The pid of the torchrun worker of ``rank`` (a child of the agent process), if started."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    for pid in children.read_text().split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # already gone
            continue
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc")
def test_max_restarts_with_resume_continues_from_the_last_checkpoint(uninterrupted, work):
    out = work / "restarted"
    args = [
        "--max-restarts",
        "1",
        "-m",
        "fp8lm.cli",
        "train",
        "--opt-level",
        "O3",
        *run_options(out, work / "cache", "--resume"),
    ]  # the same command line for both attempts
    agent = subprocess.Popen(torchrun(*args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(out / "checkpoints" / "step_00000004.pt", [agent])
        pid = worker_pid(agent, 1)
        assert pid is not None, "no worker of rank 1 under torchrun"
        os.kill(pid, signal.SIGKILL)
        log = agent.communicate(timeout=TIMEOUT_S)[0]
    finally:
        agent.kill()
        agent.wait()
    assert agent.returncode == 0, log[-4000:]
    assert "failed (exitcode" in log  # torchrun saw the first attempt fail, and restarted it
    assert not (out / "checkpoints" / "step_00000004.pt").exists()  # the resumed run saved on
    whole = uninterrupted[0] / "O3"
    for name in ("metrics.jsonl", "telemetry.jsonl"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert read(out / "summary.json")["val_loss"] == read(whole / "summary.json")["val_loss"]


def test_resuming_at_another_rank_count_reshards_and_continues(uninterrupted, work, capsys):
    import shutil

    from fp8lm.cli import main

    run = work / "one_process"
    shutil.copytree(uninterrupted[0] / "O2", run)
    before = (run / "metrics.jsonl").read_bytes()
    args = run_options(run, work / "cache", "--resume", "--steps", str(STEPS + 4))
    assert main(["train", "--opt-level", "O2", *args]) == 0
    out = capsys.readouterr().out
    assert f"resuming step {STEPS} resharded: dp_replicate 2 on 2 rank(s) -> one process on 1 rank(s)" in out
    assert "new batch streams" in out  # one replica instead of two
    after = (run / "metrics.jsonl").read_bytes()
    assert after.startswith(before) and len(after.splitlines()) == STEPS + 4


def test_shared_grad_sync_scaling_logs_mu_and_must_be_resumed_alike(work):
    """--grad-sync-scaling shared: FP8DataParallel's shared per-bucket scale with the automatic
    factor mu, logged every step; a resume with the other scaling is one clear error."""
    out = work / "shared"
    args = [
        "-m",
        "fp8lm.cli",
        "train",
        "--opt-level",
        "O2",
        "--grad-sync-scaling",
        "shared",
        *run_options(out, work / "cache"),
    ]
    check(subprocess.run(forked_ranks(2, *args), env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train_loss" in r]
    assert len(steps) == STEPS and all(r["grad_sync_mu"] and all(mu > 0 for mu in r["grad_sync_mu"]) for r in steps)
    assert all(r["train_loss"] == r["train_loss"] for r in steps)  # finite: no NaN
    args = [
        "-m",
        "fp8lm.cli",
        "train",
        "--opt-level",
        "O2",
        *run_options(out, work / "cache", "--resume"),
        "--steps",
        str(STEPS + 4),
        "--grad-sync-scaling",
        "local",
    ]
    proc = subprocess.run(forked_ranks(2, *args), env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0 and "--grad-sync-scaling shared" in proc.stderr, proc.stderr
    # without the option, --resume continues with the run's own scaling
    check(subprocess.run(forked_ranks(2, *args[:-2]), env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r][-1] == STEPS + 4 and records[-1]["grad_sync_mu"]
