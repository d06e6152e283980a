"""Every way a checkpoint can be broken ends as one `CheckpointError` line, before anything is
loaded: sharded (DCP) folders with a zero-byte, truncated, random, missing or non-regular shard,
a bad ``.metadata``, a missing folder; hyper-parameters and counters out of range in ``.pt`` files
and in DCP optimizer state; and removing old shard folders never leaves a ``step_<n>.dcp`` behind."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import fp8lm
from cli_helpers import run_main
from fp8lm.distributed import FP8ZeroOptimizer, save_checkpoint, save_fsdp_checkpoint
from fp8lm.distributed import load_checkpoint as load_sharded
from fp8lm.train import checkpoint as train_checkpoint
from fp8lm.train.checkpoint import (
    CheckpointError,
    check_shard_folder,
    list_checkpoints,
    load_checkpoint,
    remove_stale_temporaries,
)

SHARDS = "step_00000001.dcp"


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def zero_run(tmp_path, group):
    """An FP8 ZeRO model and optimizer, and a training checkpoint naming its shard folder."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8lm.initialize(model, opt, "O3", optimizer_options={"kernel": "eager"})
    opt = FP8ZeroOptimizer(model, opt)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    folder = tmp_path / "checkpoints"
    save_checkpoint(folder / SHARDS, model, opt)
    train_checkpoint.save_checkpoint({"model": {}, "optimizer_shards": SHARDS}, folder, step=1, keep=2)
    return model, opt, folder


def _data_file(folder):
    return next((folder / SHARDS).glob("*.distcp"))


def _zero_bytes(path):
    path.write_bytes(b"")


def _truncated(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _folder(path):
    path.unlink()
    path.mkdir()


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


BREAKS = {
    "zero-byte shard": lambda f: _zero_bytes(_data_file(f)),
    "truncated shard": lambda f: _truncated(_data_file(f)),
    "missing shard": lambda f: _data_file(f).unlink(),
    "FIFO shard": lambda f: _fifo(_data_file(f)),
    "zero-byte metadata": lambda f: _zero_bytes(f / SHARDS / ".metadata"),
    "random metadata": lambda f: (f / SHARDS / ".metadata").write_bytes(os.urandom(300)),
    "FIFO metadata": lambda f: _fifo(f / SHARDS / ".metadata"),
    "folder in place of a shard": lambda f: _folder(_data_file(f)),
    "missing folder": lambda f: shutil.rmtree(f / SHARDS),
}


@pytest.fixture
def alarm():
    """A FIFO must be refused, not read: a read would block; fail instead of hanging."""
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("blocked reading a checkpoint"))
    signal.alarm(30)
    yield
    signal.alarm(0)


@pytest.mark.parametrize("case", list(BREAKS))
def test_broken_shard_folders_are_refused_in_one_line_before_reading(zero_run, case, alarm):
    _, _, folder = zero_run
    BREAKS[case](folder)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert "\n" not in str(info.value) and "step_00000001" in str(info.value)


def test_random_shard_bytes_end_as_one_checkpoint_error(zero_run):
    model, opt, folder = zero_run
    data = _data_file(folder)
    data.write_bytes(os.urandom(data.stat().st_size))  # passes the size checks; torch cannot read it
    # the checkpoint's checks read the folder's plain entries (steps, param groups) first
    with pytest.raises(CheckpointError, match="of shard folder .*step_00000001.dcp") as info:
        load_checkpoint(folder)
    assert "\n" not in str(info.value)
    before = [p.detach().float().clone() for p in model.parameters()]
    with pytest.raises((CheckpointError, CheckpointException)):  # the library alone: nothing changes
        load_sharded(folder / SHARDS, model, opt)
    assert all(torch.equal(a, p.detach().float()) for a, p in zip(before, model.parameters()))


def test_the_cli_reports_a_checkpoint_exception_in_one_line(monkeypatch, capsys, tmp_path):
    def fail(cfg):
        raise CheckpointException("Failed to load", {0: (ValueError("bad shard\nmore"), None)})

    monkeypatch.setattr("fp8lm.train.loop.train", fail)
    rc, _, err = run_main(["train", "--out", str(tmp_path / "run")], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("fp8lm train: error: sharded checkpoint failed on rank 0: ValueError: bad shard;")


# -- numbers read back ---------------------------------------------------------------------------


def _pt_with_group(tmp_path, **group):
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8, weight_decay=0.1)
    opt.param_groups[0].update(group)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "optimizer_shards": None, "step": 1}
    return train_checkpoint.save_checkpoint(state, tmp_path / "checkpoints", step=1, keep=2)


@pytest.mark.parametrize(
    "group, name",
    [
        ({"weight_decay": float("nan")}, "weight_decay"),
        ({"eps": float("inf")}, "eps"),
        ({"eps": 0.0}, "eps"),
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.5)}, "betas.1"),
        ({"betas": (float("nan"), 0.99)}, "betas.0"),
        ({"maximize": float("inf")}, "maximize"),
    ],
)
def test_out_of_range_hyperparameters_in_a_pt_checkpoint_are_refused(tmp_path, group, name):
    path = _pt_with_group(tmp_path, **group)
    with pytest.raises(CheckpointError, match=f"{path}.* holds optimizer.param_groups.0.{name} = .*older checkpoint"):
        load_checkpoint(path)


def test_in_range_hyperparameters_load(tmp_path):
    path = _pt_with_group(tmp_path)
    assert load_checkpoint(path)["optimizer"]["param_groups"][0]["eps"] == 1e-8


def test_a_negative_counter_is_refused(tmp_path):
    path = train_checkpoint.save_checkpoint(
        {"model": {}, "step": 1, "skipped_steps": -3}, tmp_path / "checkpoints", step=1, keep=2
    )
    with pytest.raises(CheckpointError, match="holds skipped_steps = -3, not a count >= 0"):
        load_checkpoint(path)


@pytest.mark.parametrize("changed", [{"eps": float("nan")}, {"weight_decay": float("inf")}, {"betas": (0.9, 2.0)}])
def test_out_of_range_hyperparameters_in_dcp_optimizer_state_are_refused(tmp_path, fsdp_model, changed):
    model, opt = fsdp_model
    opt.param_groups[0].update(changed)
    save_fsdp_checkpoint(tmp_path / SHARDS, model, opt)
    with pytest.raises(CheckpointError, match=f"{tmp_path / SHARDS}.* holds optim.param_groups.0.") as info:
        check_shard_folder(tmp_path / SHARDS)
    assert "\n" not in str(info.value)


def test_a_clean_dcp_optimizer_state_passes(tmp_path, fsdp_model):
    model, opt = fsdp_model
    save_fsdp_checkpoint(tmp_path / SHARDS, model, opt)
    check_shard_folder(tmp_path / SHARDS)


@pytest.fixture
def fsdp_model(group):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


# -- removing old shard folders ---------------------------------------------------------------------


def _save_with_shards(folder, step, keep):
    (folder / f"step_{step:08d}.dcp").mkdir(parents=True)
    (folder / f"step_{step:08d}.dcp" / "__0_0.distcp").write_bytes(b"x" * 100)
    train_checkpoint.save_checkpoint({"model": {}}, folder, step=step, keep=keep)


def test_a_kill_while_removing_an_old_shard_folder_leaves_no_step_folder(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    _save_with_shards(folder, 1, keep=1)

    def killed(path, ignore_errors=False):  # the process dies inside the removal
        next(path.iterdir()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(train_checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        _save_with_shards(folder, 2, keep=1)
    monkeypatch.undo()
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f".step_00000001.dcp.tmp{os.getpid()}", "step_00000002.dcp", "step_00000002.pt"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = folder / f".step_00000001.dcp.tmp{int(dead.stdout)}"  # as if the process were gone
    (folder / names[0]).rename(leftover)
    assert remove_stale_temporaries(folder) == [leftover]
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002.dcp", "step_00000002.pt"]
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000002.pt"]


def test_old_shard_folders_are_removed_with_their_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save_with_shards(folder, step, keep=2)
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_00000002.dcp",
        "step_00000002.pt",
        "step_00000003.dcp",
        "step_00000003.pt",
    ]


def test_a_folder_written_and_read_in_one_process_gives_no_dcp_warning(tmp_path):
    """DCP warns that it runs in one process even when told to; fp8lm does so on purpose (an
    export, `fp8lm generate`, a reshard, a one-process run), so no such warning reaches the user."""
    import warnings

    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        save_checkpoint(tmp_path / SHARDS, model, opt)
        load_sharded(tmp_path / SHARDS, model, opt)
    assert not [w for w in seen if "torch.distributed is disabled" in str(w.message)]
