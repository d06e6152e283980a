"""Preference pairs: reading JSON Lines, the built-in set, the split, batches, the sampler."""

import json

import numpy as np
import pytest
import torch

from fp8lm.train.data import DataError
from fp8lm.train.preference import PairSampler, PreferencePair, builtin_pairs, encode_pairs, read_pairs, split_pairs


def write(tmp_path, lines):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_read_pairs(tmp_path):
    good = {"prompt": "2+2=", "chosen": "4", "rejected": "5", "id": 7}
    path = write(tmp_path, [json.dumps(good), "", json.dumps({**good, "chosen": "vier é"})])
    pairs = read_pairs(path)
    assert pairs == [PreferencePair(b"2+2=", b"4", b"5"), PreferencePair(b"2+2=", "vier é".encode(), b"5")]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: a JSON list, not an object"),
        ('{"prompt": "a", "chosen": "b"}', "line 2: no 'rejected' key"),
        ('{"prompt": "a", "chosen": 3, "rejected": "c"}', "line 2: 'chosen' must be a non-empty string, got 3"),
        ('{"prompt": "", "chosen": "b", "rejected": "c"}', "line 2: 'prompt' must be a non-empty string"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path, ['{"prompt": "a", "chosen": "b", "rejected": "c"}', line])
    with pytest.raises(DataError) as e:
        read_pairs(path)
    assert f"{path}:2:" in str(e.value) and message.split(": ", 1)[1] in str(e.value)
    assert "\n" not in str(e.value)


def test_empty_or_missing_file(tmp_path):
    with pytest.raises(DataError, match="holds no pairs"):
        read_pairs(write(tmp_path, ["", "  "]))
    with pytest.raises(DataError, match="does not exist"):
        read_pairs(tmp_path / "nope.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe")
    with pytest.raises(DataError, match="not UTF-8"):
        read_pairs(tmp_path / "bin.jsonl")


def test_builtin_pairs_true_vs_corrupted_continuation():
    tokens = np.frombuffer(b"def add(a, b):\n    return a + b\n" * 50, dtype=np.uint8)
    pairs = builtin_pairs(tokens, 20, prompt_len=16, answer_len=8, seed=3)
    assert pairs == builtin_pairs(tokens, 20, prompt_len=16, answer_len=8, seed=3)
    assert pairs != builtin_pairs(tokens, 20, prompt_len=16, answer_len=8, seed=4)
    text = tokens.tobytes()
    for p in pairs:
        assert len(p.prompt) == 16 and len(p.chosen) == len(p.rejected) == 8
        assert p.prompt + p.chosen in text
        diff = [i for i in range(8) if p.chosen[i] != p.rejected[i]]
        assert len(diff) == 2 and all(32 <= p.rejected[i] < 127 for i in diff)
    with pytest.raises(DataError, match="too few"):
        builtin_pairs(tokens[:10], 1, prompt_len=16, answer_len=8, seed=0)


def test_split_pairs_deterministic_and_disjoint():
    pairs = [PreferencePair(bytes([i]), b"a", b"b") for i in range(1, 41)]
    train, held = split_pairs(pairs, 0.1)
    assert len(held) == 4 and len(train) == 36
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(pairs)
    assert split_pairs(pairs, 0.1) == (train, held)
    assert [len(s) for s in split_pairs(pairs[:2], 0.9)] == [1, 1]
    with pytest.raises(DataError, match="at least 2"):
        split_pairs(pairs[:1], 0.1)


def test_encode_pairs_masks_answers_and_padding():
    pairs = [PreferencePair(b"ab", b"cd", b"xyz"), PreferencePair(b"p", b"q", b"r")]
    batch = encode_pairs(pairs, block_size=16)
    assert batch.pairs == 2 and batch.inputs.shape == (4, 4)  # longest: "abxyz", 5 tokens
    rows = [bytes(batch.inputs[i].tolist()) for i in range(4)]
    assert rows == [b"abcd", b"pq\0\0", b"abxy", b"pr\0\0"]  # chosen rows, then rejected; "d", "z" only targets
    answers = [bytes(t for t, m in zip(batch.targets[i].tolist(), batch.mask[i].tolist()) if m) for i in range(4)]
    assert answers == [b"cd", b"q", b"xyz", b"r"]


def test_encode_pairs_cuts_prompt_start_then_answer_end():
    pairs = [PreferencePair(b"0123456789", b"abcd", b"ABCDEFGHIJKLMN")]
    batch = encode_pairs(pairs, block_size=7)
    assert batch.inputs.shape == (2, 7)
    chosen = bytes(batch.inputs[0].tolist()) + bytes([batch.targets[0, -1].item()])
    assert chosen == b"6789abcd"  # the prompt's end kept, all of the answer
    rejected_answer = bytes(t for t, m in zip(batch.targets[1].tolist(), batch.mask[1].tolist()) if m)
    assert batch.inputs[1, 0].item() == ord("9") and rejected_answer == b"ABCDEFG"  # one prompt byte stays


def test_sampler_resumes_exactly_and_counts_tokens():
    # answers of 1 to 10 bytes: batches of different widths
    pairs = [PreferencePair(bytes([i + 1]), b"a" * (1 + i % 10), b"b") for i in range(50)]
    a = PairSampler(pairs, 2, seed=5, block_size=16)
    first = a.next()
    state = a.state_dict()
    after = [a.next() for _ in range(3)]
    b = PairSampler(pairs, 2, seed=99, block_size=16)
    b.load_state_dict(state)
    again = [b.next() for _ in range(3)]
    assert all(torch.equal(x.inputs, y.inputs) and torch.equal(x.mask, y.mask) for x, y in zip(after, again))
    assert b.batches_drawn == 4 and all(batch.pairs == 2 for batch in after)
    widths = [batch.inputs.shape[1] for batch in (first, *after)]
    assert len(set(widths)) > 1  # the count follows each batch, not the first one's width
    assert a.tokens_drawn == b.tokens_drawn == 4 * sum(widths)  # 2 sequences per pair, padding included
    assert torch.is_tensor(state["generator"])
