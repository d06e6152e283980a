"""Inputs fp8lm cannot run are refused in one line before anything is allocated or written: CLI
numbers (``--beta inf``, a seed beyond 64 bits, ``--device meta``, sizes beyond memory), DPO's
``reference.pt`` when broken, hostile pairs files, a non-UTF-8 ``telemetry.jsonl``, and a
``--resume`` on changed data. Valid input that looked odd is accepted (a raw U+2028 in a pairs
file, the same data file by a relative path), and a corpus packs a block at a time."""

import hashlib
import json
import os
import random
from pathlib import Path

import pytest
import torch

from cli_helpers import run_main
from fp8lm.train import config as config_module
from fp8lm.train import data as data_module
from fp8lm.train.config import TrainConfig
from fp8lm.train.data import DataError, Document, pack
from fp8lm.train.model import GPT, preset
from fp8lm.train.preference import read_pairs


def one_line(rc, err):
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("fp8lm "), err
    return err


def _hashes(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny GPT checkpoint and 24 arithmetic preference pairs."""
    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    torch.save({"model": model.state_dict(), "model_config": model.config.to_dict()}, root / "init.pt")
    rng = random.Random(0)
    pairs = []
    for _ in range(24):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        pairs.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)})
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return root


def dpo_argv(inputs, out, *extra):
    return ["dpo", "--data", str(inputs / "pairs.jsonl"), "--out", str(out), "--batch-size", "4", "--no-progress"] + [
        *extra
    ]


# -- CLI numbers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beta", "inf"], "--beta must be > 0 and finite, got inf"),
        (["--beta", "nan"], "--beta must be > 0 and finite, got nan"),
        (["--beta", "-1"], "--beta must be > 0 and finite"),
        (["--seed", str(2**64 + 1)], "--seed must be a whole number in [0, 2**63 - 2**20)"),
        (["--device", "meta"], "--device meta cannot train"),
        (["--batch-size", str(10**9)], "needs at least"),
    ],
)
def test_dpo_numbers_it_cannot_run_are_refused(inputs, tmp_path, capsys, args, message):
    rc, _, err = run_main([*dpo_argv(inputs, tmp_path / "out", "--init-from", str(inputs / "init.pt")), *args], capsys)
    assert message in one_line(rc, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", str(2**63)], "--seed must be a whole number"),
        (["--seed", "-1"], "--seed must be a whole number"),
        (["--device", "meta"], "--device meta cannot train"),
        (["--batch-size", str(10**8)], "lower --batch-size (use --grad-accum"),
        (["--eval-batches", str(10**9)], "or --eval-batches"),
    ],
)
def test_train_numbers_it_cannot_run_are_refused(tmp_path, capsys, tiny_cli_args, email_corpus, args, message):
    argv = ["train", *tiny_cli_args, "--data", email_corpus, "--out", str(tmp_path / "out"), *args]
    assert message in one_line(*run_main(argv, capsys)[::2])
    assert not (tmp_path / "out").exists()


def test_memory_bound_is_below_what_a_run_needs_and_compared_with_what_is_free(monkeypatch):
    cfg = TrainConfig(model="tiny", batch_size=4, seq_len=32, eval_batches=2, device="cpu")
    host, step = cfg.memory_needed(cfg.model_config())
    # the bound per token of a step stays under the saved bytes measured for this model (3,917 at O2)
    assert (step - 4 * 32 * 32 * 2) / (4 * 32) < 3917
    monkeypatch.setattr(config_module, "available_memory", lambda device: host + step - 1)
    with pytest.raises(config_module.RunError, match="needs at least .* GiB in host memory"):
        cfg.validate()
    monkeypatch.setattr(config_module, "available_memory", lambda device: host + step)
    cfg.validate()


# -- DPO's reference.pt ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dpo_run(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "run"
    argv = dpo_argv(inputs, out, "--init-from", str(inputs / "init.pt"), "--steps", "2", "--opt-level", "bf16")
    assert run_main(argv, _NoCapture())[0] == 0
    return out


class _NoCapture:
    def readouterr(self):
        return "", ""


def _nan_weight(path):
    saved = torch.load(path, weights_only=True)
    saved["model"]["lm_head.weight"][0, 0] = float("nan")
    torch.save(saved, path)


def _reshaped(path):
    saved = torch.load(path, weights_only=True)
    saved["model"]["wpe.weight"] = saved["model"]["wpe.weight"][:10]
    torch.save(saved, path)


def _no_config(path):
    saved = torch.load(path, weights_only=True)
    del saved["config"]
    torch.save(saved, path)


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


REFERENCE_BREAKS = {
    "NaN weight": (_nan_weight, "holds inf or NaN in 'model.lm_head.weight'"),
    "zero bytes": (lambda p: p.write_bytes(b""), "cannot read checkpoint"),
    "random bytes": (lambda p: p.write_bytes(os.urandom(4096)), "cannot read checkpoint"),
    "shape changed": (_reshaped, "does not fit this model: 'wpe.weight' has shape (10, 32)"),
    "no options": (_no_config, "is not the reference of an fp8lm dpo run"),
    "FIFO": (_fifo, "is not a regular file"),
    "missing": (lambda p: p.unlink(), "does not exist"),
}


@pytest.mark.parametrize("case", list(REFERENCE_BREAKS))
def test_a_broken_reference_is_refused_on_resume(dpo_run, inputs, tmp_path, capsys, case):
    run = tmp_path / "run"
    os.system(f"cp -r {dpo_run} {run}")
    before = _hashes(run)
    reference = run / "checkpoints" / "reference.pt"
    breaks, message = REFERENCE_BREAKS[case]
    breaks(reference)
    before = {k: v for k, v in before.items() if k != "checkpoints/reference.pt"}
    rc, _, err = run_main([*dpo_argv(inputs, run, "--steps", "3", "--opt-level", "bf16"), "--resume"], capsys)
    assert message in one_line(rc, err) and "reference.pt" in err
    assert {k: v for k, v in _hashes(run).items() if k != "checkpoints/reference.pt"} == before


def test_an_intact_reference_resumes(dpo_run, inputs, tmp_path, capsys):
    run = tmp_path / "run"
    os.system(f"cp -r {dpo_run} {run}")
    rc, _, err = run_main([*dpo_argv(inputs, run, "--steps", "3", "--opt-level", "bf16"), "--resume"], capsys)
    assert rc == 0, err


# -- data files ------------------------------------------------------------------------------------

GOOD = json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"})


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "\\ud800", "chosen": "2", "rejected": "3"}', "lone surrogate"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"prompt": "1", "chosen": "2", "rejected": "3", "n": ' + "9" * 5000 + "}", "number too long"),
    ],
)
def test_hostile_pairs_lines_are_refused_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(f"{GOOD}\n{line}\n{GOOD}\n")
    with pytest.raises(DataError, match=f"{path}:2: .*{message}") as info:
        read_pairs(path)
    assert "\n" not in str(info.value)


def test_a_raw_line_separator_inside_a_string_is_text(tmp_path):
    path = tmp_path / "pairs.jsonl"
    record = {"prompt": "a\u2028b\u2029c\x85d", "chosen": "2", "rejected": "3"}
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n" + GOOD + "\n", encoding="utf-8")
    pairs = read_pairs(path)
    assert len(pairs) == 2 and pairs[0].prompt == record["prompt"].encode("utf-8")


def test_inspect_of_a_telemetry_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    (tmp_path / "telemetry.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe not text\n')
    assert "is not UTF-8 text" in one_line(*run_main(["inspect", str(tmp_path)], capsys)[::2])
    (tmp_path / "telemetry.jsonl").write_text('{"step": 1}\n')
    assert "telemetry.jsonl:1: not a telemetry record" in one_line(*run_main(["inspect", str(tmp_path)], capsys)[::2])


def _documents(tmp_path, sizes):
    docs = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"doc{i}.txt"
        path.write_bytes(bytes(random.Random(i).randrange(32, 127) for _ in range(size)))
        docs.append(data_module._file_document(path, tmp_path))
    return docs


@pytest.mark.parametrize("sizes", [[1000], [300, 5, 700, 1, 64, 900, 33, 250]])
def test_packing_a_block_at_a_time_writes_the_bytes_of_a_whole_read(tmp_path, monkeypatch, sizes):
    monkeypatch.setattr(data_module, "_CHUNK", 7)  # many blocks, split mid-document
    docs = _documents(tmp_path, sizes)
    splits = pack("test", docs, tmp_path / "cache", 0.3)
    if splits.info["split"] == "by-bytes":
        data = b"".join(d.read() for d in docs)
        n_val = max(1, int(len(data) * 0.3))
        expected = data[:-n_val], data[-n_val:]
    else:
        val = [data_module.is_validation(d.name, 0.3) for d in docs]
        expected = tuple(b"".join(d.read() for d, v in zip(docs, val) if v == side) for side in (False, True))
    assert (splits.train.tobytes(), splits.val.tobytes()) == expected


def test_a_document_that_is_not_a_file_packs_too(tmp_path):
    docs = [Document(f"row{i}", lambda i=i: bytes([65 + i]) * 50, "fp") for i in range(2)]
    splits = pack("rows", docs, tmp_path / "cache", 0.5)
    assert splits.train.tobytes() + splits.val.tobytes() in (b"A" * 50 + b"B" * 50, b"B" * 50 + b"A" * 50)


# -- --resume on the same data ---------------------------------------------------------------------


@pytest.fixture
def corpus_run(tmp_path, tiny_run):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(p.read_bytes() for p in sorted(Path(tiny_run["data"]).glob("*.py"))))
    return corpus


def _train_argv(tiny_cli_args, data, out, *extra):
    return ["train", *tiny_cli_args, "--data", str(data), "--out", str(out), "--steps", "2", *extra]


def test_resume_on_changed_data_is_refused(tmp_path, capsys, tiny_cli_args, corpus_run):
    out = tmp_path / "run"
    assert run_main(_train_argv(tiny_cli_args, corpus_run, out), capsys)[0] == 0
    before = _hashes(out)
    text = bytearray(corpus_run.read_bytes())
    text[len(text) // 2] ^= 1  # one bit, same size
    stat = corpus_run.stat()
    corpus_run.write_bytes(bytes(text))
    os.utime(corpus_run, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    err = one_line(*run_main(_train_argv(tiny_cli_args, corpus_run, out, "--steps", "3", "--resume"), capsys)[::2])
    assert "the files of --data" in err and "changed since the run" in err
    assert _hashes(out) == before


def test_resume_on_the_same_file_by_a_relative_path_continues(tmp_path, capsys, tiny_cli_args, corpus_run, monkeypatch):
    out = tmp_path / "run"
    assert run_main(_train_argv(tiny_cli_args, corpus_run, out), capsys)[0] == 0
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_main(_train_argv(tiny_cli_args, "corpus.txt", out, "--steps", "3", "--resume"), capsys)
    assert rc == 0, err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
