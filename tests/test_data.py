import numpy as np
import pytest
import torch

from fp8lm.train.data import (
    BatchSampler,
    DataError,
    eval_batches,
    is_validation,
    pack,
    path_documents,
    stdlib_documents,
)


@pytest.fixture
def text_folder(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(200):
        (d / f"doc{i:03d}.txt").write_text(f"document {i}\n" * 20)
    (d / ".hidden.txt").write_text("never read")
    (d / "image.bin").write_bytes(b"\x89PNG\x00\x00binary")
    return d


def test_stdlib_corpus_is_the_python_sources_without_site_packages():
    source, docs = stdlib_documents()
    names = [d.name for d in docs]
    assert source.startswith("stdlib:")
    assert "os.py" in names and "json/__init__.py" in names
    assert all(n.endswith(".py") and "site-packages" not in n for n in names)
    assert len(docs) > 500


def test_folder_skips_hidden_and_binary_files(text_folder):
    _, docs = path_documents(text_folder)
    names = {d.name for d in docs}
    assert len(names) == 200 and ".hidden.txt" not in names and "image.bin" not in names


def test_split_is_by_document_deterministic_and_disjoint(text_folder, tmp_path):
    source, docs = path_documents(text_folder)
    a = pack(source, docs, tmp_path / "c1", val_fraction=0.1)
    b = pack(source, docs, tmp_path / "c2", val_fraction=0.1)
    assert a.info == b.info and a.info["split"] == "by-document"
    np.testing.assert_array_equal(a.train, b.train)
    val_docs = [d for d in docs if is_validation(d.name, 0.1)]
    assert 5 <= len(val_docs) <= 40  # about a tenth of 200
    expected_val = b"".join(d.read() for d in val_docs)
    assert bytes(a.val) == expected_val
    assert len(a.train) + len(a.val) == sum(len(d.read()) for d in docs)


def test_pack_is_cached_and_redone_when_a_file_changes(text_folder, tmp_path):
    source, docs = path_documents(text_folder)
    pack(source, docs, tmp_path / "c", val_fraction=0.1)
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    pack(source, docs, tmp_path / "c", val_fraction=0.1)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == files  # reused, nothing new
    (text_folder / "doc000.txt").write_text("changed content, longer than before\n" * 30)
    source, docs = path_documents(text_folder)
    pack(source, docs, tmp_path / "c", val_fraction=0.1)
    assert len(list((tmp_path / "c").glob("*.json"))) == 2


def test_single_file_is_split_by_bytes(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(bytes(range(256)) * 40)
    source, docs = path_documents(f)
    s = pack(source, docs, tmp_path / "c", val_fraction=0.25)
    assert s.info["split"] == "by-bytes"
    assert len(s.val) == 2560 and bytes(s.train) + bytes(s.val) == f.read_bytes()


def test_sampler_targets_are_inputs_shifted_and_state_resumes_exactly():
    tokens = np.arange(1000, dtype=np.uint8)
    a = BatchSampler(tokens, batch_size=4, seq_len=16, seed=3)
    x, y = a.next()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    state = a.state_dict()
    expected = [a.next() for _ in range(3)]
    b = BatchSampler(tokens, batch_size=4, seq_len=16, seed=99)
    b.load_state_dict(state)
    for (ex, ey), (gx, gy) in zip(expected, [b.next() for _ in range(3)]):
        assert torch.equal(ex, gx) and torch.equal(ey, gy)


def test_eval_batches_are_fixed_and_cover_the_split():
    tokens = np.frombuffer(bytes(range(256)) * 10, dtype=np.uint8)
    first = eval_batches(tokens, num_batches=3, batch_size=2, seq_len=8)
    again = eval_batches(tokens, num_batches=3, batch_size=2, seq_len=8)
    assert len(first) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert first[-1][1][-1, -1].item() == tokens[-1]  # the last window ends at the split's end


@pytest.mark.parametrize("what", ["missing", "empty_folder", "empty_file", "binary_only"])
def test_unusable_data_is_a_clear_error(tmp_path, what):
    p = tmp_path / "data"
    if what == "empty_folder":
        p.mkdir()
    elif what == "empty_file":
        p.write_text("")
    elif what == "binary_only":
        p.mkdir()
        (p / "x.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match=str(p)):
        path_documents(p)


def test_too_little_data_for_a_sequence_is_a_clear_error():
    with pytest.raises(DataError, match="training split has 10 tokens but a sequence needs 65"):
        BatchSampler(np.zeros(10, dtype=np.uint8), 2, 64, 0)
    with pytest.raises(DataError, match="validation split"):
        eval_batches(np.zeros(10, dtype=np.uint8), 1, 2, 64)
