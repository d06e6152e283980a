"""Failures that must end in one line on stderr, exit 2, nothing half-written: bad output folders,
an empty or corrupt checkpoint, a full disk during a save, a second run on the same --out; and
what such failures leave behind (temporaries of killed saves) is cleaned up."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import run_main
from fp8lm.train import checkpoint as checkpoint_module
from fp8lm.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from fp8lm.train.config import RunError, TrainConfig
from fp8lm.train.data import pack, path_documents
from fp8lm.train.loop import train
from fp8lm.train.resume import lock_output


@pytest.fixture
def argv(tiny_cli_args, email_corpus, token_cache):
    def make(out, *extra, cache=token_cache):
        return ["train", *tiny_cli_args, "--data", email_corpus, "--cache-dir", str(cache), "--out", str(out), *extra]

    return make


def one_line(rc, out, err):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_output_folders_that_cannot_be_are_refused_in_one_line(tmp_path, argv, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = {
        "--out " + repr(str(a_file)) + " is not a folder": argv(a_file, "--steps", "1"),
        "--cache-dir '/dev/null' is not a folder": argv(tmp_path / "o1", "--steps", "1", cache="/dev/null"),
        "is a file, not a folder": argv(a_file / "run", "--steps", "1"),
        "File name too long; pass a shorter or another path": argv(tmp_path / ("x" * 300), "--steps", "1"),
    }
    for expected, args in cases.items():
        line = one_line(*run_main(args, capsys))
        assert expected in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_is_refused_in_one_line(tmp_path, argv, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    line = one_line(*run_main(argv(parent / "run", "--steps", "1"), capsys))
    assert "cannot write in" in line and "pass a folder you can write to" in line


def test_empty_and_corrupt_newest_checkpoints_name_the_valid_older_one(tmp_path, argv, capsys):
    out = tmp_path / "run"
    assert run_main(argv(out, "--steps", "2", "--save-every", "1"), capsys)[0] == 0
    files = {p: p.read_bytes() for p in out.iterdir() if p.is_file()}
    newest = out / "checkpoints" / "step_00000002.pt"
    newest.write_bytes(b"")
    line = one_line(*run_main(argv(out, "--steps", "3", "--resume"), capsys))
    assert "cannot read checkpoint" in line and "step_00000002.pt" in line
    assert "the newest valid checkpoint, 'step_00000001.pt', move 'step_00000002.pt' out of the folder" in line
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*: .*Error: "):
        load_checkpoint(newest)  # a file given by name: no older one to name
    newest.write_bytes(b"PK\x03\x04" + os.urandom(64))
    line = one_line(*run_main(argv(out, "--steps", "3", "--resume"), capsys))
    assert "'step_00000001.pt', move 'step_00000002.pt'" in line
    assert {p: p.read_bytes() for p in out.iterdir() if p.is_file()} == files


def test_a_full_disk_during_a_save_leaves_no_partial_file_and_resume_continues(tmp_path, argv, capsys, monkeypatch):
    out = tmp_path / "run"
    real_save = torch.save
    saves = []

    def save_until_the_disk_is_full(obj, f):
        saves.append(1)
        if len(saves) < 2:
            return real_save(obj, f)
        f.write(b"\0" * 1000)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_module.torch, "save", save_until_the_disk_is_full)
    line = one_line(*run_main(argv(out, "--steps", "3", "--save-every", "1"), capsys))
    assert line == (
        "fp8lm train: error: No space left on device; free some space (or pass another --out), "
        "then rerun with --resume to continue from the last checkpoint"
    )
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000001.pt"]
    assert not list(out.rglob(".*tmp*")) and not (out / "summary.json").exists()
    monkeypatch.setattr(checkpoint_module.torch, "save", real_save)
    assert run_main(argv(out, "--steps", "3", "--save-every", "1", "--resume"), capsys)[0] == 0
    assert (out / "summary.json").exists()


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(tmp_path, tiny_run, token_cache):
    out = tmp_path / "run"
    held = lock_output(out)  # as a running fp8lm train holds it
    try:
        with pytest.raises(RunError, match=f"is in use by another run \\(pid {os.getpid()}\\); wait for it to end"):
            train(TrainConfig(**{**tiny_run, "steps": 1, "out": str(out), "cache_dir": token_cache}))
    finally:
        held.close()
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    train(TrainConfig(**{**tiny_run, "steps": 1, "out": str(out), "cache_dir": token_cache}))  # free again


def test_temporaries_of_killed_saves_are_removed_and_never_checkpoints(tmp_path, tiny_run, token_cache):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getpid()
    cfg = dict(**tiny_run, steps=1, out=str(tmp_path / "run"), cache_dir=token_cache)
    train(TrainConfig(**cfg))
    folder = tmp_path / "run" / "checkpoints"
    stale = [folder / f".step_00000002.pt.tmp{dead_pid}", tmp_path / "run" / f".summary.json.tmp{dead_pid}"]
    live = folder / f".step_00000003.pt.tmp{live_pid}"
    for p in (*stale, live):
        p.write_bytes(b"partial")
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000001.pt"]
    train(TrainConfig(**{**cfg, "steps": 2, "resume": True}))
    assert not any(p.exists() for p in stale) and live.exists()


def test_a_file_name_that_is_not_utf8_is_read(tmp_path, token_cache):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "plain.txt").write_text("hello world " * 50)
    name = os.fsdecode(b"caf\xe9.txt")
    (folder / name).write_text("bonjour le monde " * 50)
    source, docs = path_documents(folder)
    assert sorted(d.name for d in docs) == sorted(["plain.txt", name])
    splits = pack(source, docs, Path(token_cache) / "latin1", 0.05)
    assert splits.info["documents"] == 2 and len(splits.train) + len(splits.val) == 600 + 850
