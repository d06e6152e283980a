"""--tokenizer bytes|bpe|PATH and --vocab-size (`fp8lm.train.tokenizer`): a deterministic BPE
trained on the training split, cached with the packed tokens, a padded vocabulary, tokenizer files,
refusals in one line, and runs (train, resume, compare, dpo) on BPE tokens."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

from cli_helpers import run_main  # noqa: E402
from fp8lm.train import dpo as dpo_module  # noqa: E402
from fp8lm.train import tokenizer as tk  # noqa: E402
from fp8lm.train.compare import compare  # noqa: E402
from fp8lm.train.config import DPOConfig, RunError, TrainConfig  # noqa: E402
from fp8lm.train.data import eval_batches, pack, path_documents  # noqa: E402
from fp8lm.train.dpo import dpo  # noqa: E402
from fp8lm.train.loop import train  # noqa: E402
from fp8lm.train.preference import encode_pairs  # noqa: E402

TEXT = ("def add(x, y):\n    return x + y\n\n# naïve café — 数据\nclass Point:\n    x: int = 0\n" * 200).encode()


@pytest.fixture(scope="module")
def email_splits(email_corpus, tmp_path_factory):
    cache = tmp_path_factory.mktemp("bytes")
    return pack(*path_documents(email_corpus), cache), cache


def _run(tmp_path, tiny_run, cache, **kw):
    return TrainConfig(**{**tiny_run, "out": str(tmp_path / "run"), "cache_dir": str(cache), **kw})


def test_bpe_is_deterministic_across_processes_and_threads():
    data = np.frombuffer(TEXT, dtype=np.uint8)
    first = tk.train_bpe(data, 300)
    assert tk.train_bpe(data, 300).json == first.json
    script = (
        "import sys, numpy as np\nfrom fp8lm.train.tokenizer import train_bpe\n"
        "sys.stdout.write(train_bpe(np.frombuffer(sys.stdin.buffer.read(), dtype=np.uint8), 300).json)"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "7", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], input=TEXT, capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == first.json
    assert 256 < first.vocab <= 300
    ids = first.encode(TEXT[:500])
    assert len(ids) < 500 and first.decode(ids) == TEXT[:500].decode()  # merges, and lossless


def test_vocabulary_is_padded_to_a_multiple_of_16_and_ids_stored_narrow():
    assert tk.padded_vocab(1000) == 1008 and tk.padded_vocab(256) == 256 and tk.padded_vocab(8192) == 8192
    assert tk.model_vocab_size("bytes", None) == 256
    assert tk.model_vocab_size("bpe", None) == tk.DEFAULT_BPE_VOCAB
    assert tk.model_vocab_size("bpe", 1000) == 1008
    assert TrainConfig(model="tiny", tokenizer="bpe", vocab_size=300).model_config().vocab_size == 304
    assert tk.token_dtype(65536) == np.uint16 and tk.token_dtype(65537) == np.int32


def test_chunks_rejoin_to_the_text_and_cut_between_characters(monkeypatch):
    monkeypatch.setattr(tk, "_CHUNK", 7)
    text = "é数据\nxy数据é\n" * 5 + "数" * 9
    chunks = list(tk._texts(np.frombuffer(text.encode(), dtype=np.uint8)))
    assert "".join(chunks) == text and "\ufffd" not in "".join(chunks) and len(chunks) > 5


def test_token_bytes_count_the_text_the_ids_stand_for():
    tok = tk.train_bpe(np.frombuffer(TEXT, dtype=np.uint8), 300)
    table = tok.token_bytes()
    assert len(table) == tok.model_vocab and table[tok.vocab :].sum() == 0
    ids = tok.encode(TEXT[:1000])
    assert table[ids].sum() == 1000
    assert tk.bytes_tokenizer().token_bytes()[list(TEXT[:10])].sum() == 10


def test_cache_is_reused_keyed_by_data_and_size(email_splits, monkeypatch):
    splits, cache = email_splits
    ids, tok = tk.tokenize(splits, "bpe", 512, cache)
    assert ids.train.dtype == np.uint16 and tok.vocab <= 512 and ids.info["vocab_size"] == 512
    assert ids.info["train_bytes"] == len(splits.train) and ids.info["train_tokens"] == len(ids.train) < len(
        splits.train
    )
    # the ids are the tokenizer's of the training bytes (chunked as the cache chunks them)
    first = tk._texts(splits.train).__next__()
    assert list(ids.train[:100]) == tok.hf.encode(first, add_special_tokens=False).ids[:100]

    def no_training(*args):
        raise AssertionError("trained again")

    monkeypatch.setattr(tk, "train_bpe", no_training)
    again, tok_again = tk.tokenize(splits, "bpe", 512, cache)
    assert tok_again == tok and np.array_equal(again.train, ids.train) and again.key == ids.key
    with pytest.raises(AssertionError, match="trained again"):  # another size: another tokenizer
        tk.tokenize(splits, "bpe", 528, cache)


def test_a_tokenizer_file_is_loaded_and_gives_the_same_ids(email_splits, tmp_path):
    splits, cache = email_splits
    ids, tok = tk.tokenize(splits, "bpe", 512, cache)
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.json)
    from_file, loaded = tk.tokenize(splits, str(path), None, tmp_path / "cache")
    assert loaded.kind == "file" and loaded.json == tok.json and loaded.model_vocab == 512
    assert np.array_equal(from_file.train, ids.train) and np.array_equal(from_file.val, ids.val)
    assert tk.model_vocab_size(str(path), None) == 512


def test_refusals_are_one_line(tmp_path, monkeypatch):
    def refused(tokenizer, vocab_size=None):
        with pytest.raises(RunError) as info:
            tk.check_tokenizer_options(tokenizer, vocab_size)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "does not exist" in refused(str(tmp_path / "missing.json"))
    assert "is a folder" in refused(str(tmp_path))
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    assert "is not a tokenizer.json" in refused(str(tmp_path / "bad.json"))
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    assert "is not a tokenizer.json" in refused(str(tmp_path / "binary.json"))
    assert "drop --vocab-size or pass --tokenizer bpe" in refused("bytes", 512)
    assert "at least 256" in refused("bpe", 100)
    monkeypatch.setattr(tk.importlib.util, "find_spec", lambda name: None)
    assert "pip install 'fp8lm[hf]'" in refused("bpe", 512)


def test_a_bpe_run_trains_records_its_tokenizer_and_resumes_bit_for_bit(tmp_path, tiny_run):
    token_cache = tmp_path / "cache"
    kw = dict(tokenizer="bpe", vocab_size=512, steps=6, save_every=3, keep_checkpoints=3, opt_level="O2")
    whole = train(_run(tmp_path, tiny_run, token_cache, **kw))
    out = tmp_path / "run"
    assert whole["model_config"]["vocab_size"] == 512 and whole["data"]["tokenizer"] == "bpe"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "val_loss" in r]
    assert all(math.isfinite(r["val_bits_per_byte"]) for r in evaluated)
    saved = torch.load(out / "checkpoints" / "step_00000006.pt", weights_only=True)
    # bits per byte: the loss in bits per token over the bytes the validation targets decode to
    tok = tk.recorded_tokenizer(saved["tokenizer"])
    val = np.memmap(next(token_cache.glob("ids-*.val.bin")), dtype=np.uint16, mode="r")
    windows = eval_batches(val, 2, 4, 32)
    text_bytes = sum(len(tok.decode(row.tolist()).encode()) for _, y in windows for row in y)
    bits = evaluated[-1]["val_loss"] / math.log(2) * 2 * 4 * 32 / text_bytes
    assert evaluated[-1]["val_bits_per_byte"] == pytest.approx(bits, rel=1e-3) and text_bytes > 2 * 4 * 32
    assert saved["tokenizer"]["kind"] == "bpe" and saved["tokenizer"]["json"] == (out / "tokenizer.json").read_text()
    resumed_out = tmp_path / "resumed"
    shutil.copytree(out, resumed_out)
    (resumed_out / "summary.json").unlink()
    (resumed_out / "checkpoints" / "step_00000006.pt").unlink()
    train(_run(tmp_path, tiny_run, token_cache, **kw, out=str(resumed_out), resume=True))
    assert (resumed_out / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()


def test_bytes_runs_report_bits_per_byte_as_the_loss_in_bits(tmp_path, tiny_run, token_cache):
    summary = train(_run(tmp_path, tiny_run, token_cache, steps=2))
    assert summary["val_bits_per_byte"] == pytest.approx(summary["val_loss"] / math.log(2), rel=1e-12)
    assert not (tmp_path / "run" / "tokenizer.json").exists()


def test_resume_refuses_another_tokenizer_in_one_line(
    tmp_path, tiny_cli_args, tiny_run, email_corpus, token_cache, capsys
):
    base = ["train", *tiny_cli_args, "--steps", "2", "--data", email_corpus, "--out", str(tmp_path / "run")]
    base += ["--cache-dir", token_cache, "--tokenizer", "bpe", "--vocab-size", "512"]
    assert run_main(base, capsys)[0] == 0
    rc, _, err = run_main([*base[:-1], "528", "--resume", "--steps", "3"], capsys)
    assert rc == 2 and "--vocab-size 512, this command has --vocab-size 528" in err and err.count("\n") == 1
    rc, _, err = run_main([*base[:-4], "--resume", "--steps", "3", "--tokenizer", "bytes"], capsys)
    assert rc == 2 and "--tokenizer bpe, this command has --tokenizer bytes" in err
    # starting from its weights with another tokenizer: the same ids would stand for other text
    ft = dict(steps=1, tokenizer="bpe", vocab_size=500, init_from=str(tmp_path / "run"), out=str(tmp_path / "ft"))
    with pytest.raises(RunError, match="--init-from: the checkpoint's tokenizer .* is not this run's"):
        train(_run(tmp_path, tiny_run, token_cache, **ft))


def test_compare_runs_on_bpe_tokens(tmp_path, tiny_run, token_cache):
    cfg = _run(tmp_path, tiny_run, token_cache, tokenizer="bpe", vocab_size=512, steps=2, out=str(tmp_path / "cmp"))
    result = compare(cfg, ["bf16", "O2"])
    assert set(result["levels"]) == {"bf16", "O2"} and result["model_config"]["vocab_size"] == 512
    assert all(math.isfinite(row["val_bits_per_byte"]) for row in result["levels"].values())
    assert (tmp_path / "cmp" / "bf16" / "tokenizer.json").read_text() == (
        tmp_path / "cmp" / "O2" / "tokenizer.json"
    ).read_text()


@pytest.mark.slow  # a pretraining step, two DPO steps and a reopened run
def test_dpo_encodes_the_pairs_with_the_run_tokenizer(tmp_path, tiny_run, token_cache, monkeypatch):
    train(_run(tmp_path, tiny_run, token_cache, tokenizer="bpe", vocab_size=512, steps=1))
    monkeypatch.setattr(dpo_module, "BUILTIN_HELD_OUT_PAIRS", 16)  # a quick held-out evaluation
    options = dict(init_from=str(tmp_path / "run"), steps=2, batch_size=4, progress=False, cache_dir=token_cache)
    summary = dpo(DPOConfig(**options, out=str(tmp_path / "dpo")))
    assert math.isfinite(summary["dpo_loss"]) and summary["model_config"]["vocab_size"] == 512
    reference = torch.load(tmp_path / "dpo" / "checkpoints" / "reference.pt", weights_only=True)
    tok = tk.recorded_tokenizer(reference["tokenizer"])
    assert tok.json == (tmp_path / "run" / "tokenizer.json").read_text()
    run = dpo_module.finished_run(tmp_path / "dpo")
    pair = run.held_out[0]
    batch = encode_pairs([pair], 32, run.encode)
    prompt, chosen = tok.encode(pair.prompt), tok.encode(pair.chosen)  # 16 and 8 bytes: fewer tokens
    assert len(prompt) < 16 and batch.inputs[0, : len(prompt)].tolist() == prompt
    assert batch.targets[0][batch.mask[0]].tolist() == chosen


@pytest.mark.slow  # three runs
def test_resume_of_a_tokenizer_file_run_checks_the_file_against_the_checkpoint(
    tmp_path, tiny_cli_args, email_corpus, capsys
):
    tok = tk.train_bpe(np.frombuffer(TEXT, dtype=np.uint8), 300)
    path = tmp_path / "tok.json"
    path.write_text(tok.json)
    base = ["train", *tiny_cli_args, "--data", email_corpus, "--out", str(tmp_path / "run")]
    assert run_main([*base, "--steps", "2", "--tokenizer", str(path)], capsys)[0] == 0
    assert run_main([*base, "--steps", "3", "--resume"], capsys)[0] == 0  # the run's --tokenizer file, read
    path.write_text(tk.train_bpe(np.frombuffer(TEXT[::-1], dtype=np.uint8), 300).json)  # another tokenizer
    rc, _, err = run_main([*base, "--steps", "4", "--resume"], capsys)
    assert rc == 2 and "--resume: the checkpoint's tokenizer (tokenizer.json" in err and err.count("\n") == 1
