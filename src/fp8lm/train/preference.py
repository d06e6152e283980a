"""Preference pairs for DPO: reading them, a built-in set, held-out split, batching and sampling.

A pair is a prompt with a chosen and a rejected answer, as bytes; `encode_pairs` turns them into
the model's token ids (the bytes themselves, or the run's tokenizer's ids).

- ``--data PAIRS.jsonl``: one JSON object per line with ``prompt``, ``chosen`` and ``rejected``
  strings (other keys are ignored, blank lines skipped), stored as UTF-8; lines end at ``\n``
  only, as JSON Lines says. A line that is not such an object, nests too deep, holds a number
  too long to convert or a lone surrogate is one `DataError` naming the file and line.
- Built-in (`builtin_pairs`): windows of the default corpus's tokens; the prompt is a window's
  first bytes, the chosen answer the true continuation, the rejected answer that continuation with
  a few bytes replaced by other printable characters: a preference a byte-level model can learn.
  Drawn with a fixed seed, so every run sees the same pairs; the held-out pairs come from the
  corpus's validation documents.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .data import DataError

__all__ = [
    "PreferencePair",
    "read_pairs",
    "builtin_pairs",
    "split_pairs",
    "PairBatch",
    "encode_pairs",
    "PairSampler",
]

_KEYS = ("prompt", "chosen", "rejected")
_PRINTABLE = np.arange(32, 127, dtype=np.uint8)


@dataclass(frozen=True)
class PreferencePair:
    prompt: bytes
    chosen: bytes
    rejected: bytes


def _parse_line(line: str, where: str) -> PreferencePair:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{where}: not valid JSON ({e.msg}); each line must be one object with "
            "'prompt', 'chosen' and 'rejected' strings"
        ) from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read; each line must be one flat object") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise DataError(
            f"{where}: holds a number too long to read; each line must be one object with 'prompt', 'chosen' and "
            "'rejected' strings"
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: a JSON {type(record).__name__}, not an object with 'prompt', 'chosen' and 'rejected'"
        )
    for key in _KEYS:
        if key not in record:
            raise DataError(f"{where}: no {key!r} key; each line needs 'prompt', 'chosen' and 'rejected' strings")
        if not isinstance(record[key], str) or not record[key]:
            raise DataError(f"{where}: {key!r} must be a non-empty string, got {json.dumps(record[key])[:40]}")
    try:
        return PreferencePair(*(record[key].encode("utf-8") for key in _KEYS))
    except UnicodeEncodeError as e:  # an escaped lone surrogate (\ud800): no UTF-8 bytes exist for it
        raise DataError(
            f"{where}: a string holds a lone surrogate ({e.object[e.start : e.end]!r}), which is not text; "
            "fix or drop the line"
        ) from None


def read_pairs(path: str | os.PathLike) -> list[PreferencePair]:
    """The pairs of a JSON Lines file; any bad line is one `DataError` naming the file and line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"preference file {str(p)!r} does not exist; pass a JSON Lines file to --data")
    try:
        # JSON Lines ends lines at "\n" only: U+2028 and other breaks str.splitlines knows may be
        # inside strings
        lines = p.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise DataError(
            f"preference file {str(p)!r} is not UTF-8 text (byte {e.start}); pass a JSON Lines file"
        ) from None
    pairs = [_parse_line(line, f"{p}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not pairs:
        raise DataError(f"preference file {str(p)!r} holds no pairs; put one JSON object per line in it")
    return pairs


def builtin_pairs(
    tokens: np.ndarray, count: int, prompt_len: int, answer_len: int, seed: int, corrupted: int = 2
) -> list[PreferencePair]:
    """``count`` pairs from random windows of ``tokens``: the window's first ``prompt_len`` bytes,
    its next ``answer_len`` bytes (chosen) and those with ``corrupted`` of them replaced by other
    printable characters (rejected). The same arguments give the same pairs."""
    window = prompt_len + answer_len
    if len(tokens) < window or not 0 < corrupted <= answer_len:
        raise DataError(
            f"the corpus split has {len(tokens)} tokens, too few for pairs of {window} bytes "
            f"({corrupted} corrupted); use more data or a shorter --seq-len"
        )
    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, len(tokens) - window + 1, size=count)
    pairs = []
    for offset in offsets:
        text = np.asarray(tokens[offset : offset + window], dtype=np.uint8)
        chosen = text[prompt_len:]
        rejected = chosen.copy()
        for i in rng.choice(answer_len, size=corrupted, replace=False):
            choices = _PRINTABLE[_PRINTABLE != chosen[i]]
            rejected[i] = choices[rng.integers(len(choices))]
        pairs.append(PreferencePair(text[:prompt_len].tobytes(), chosen.tobytes(), rejected.tobytes()))
    return pairs


def split_pairs(pairs: list[PreferencePair], val_fraction: float) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(training, held-out): a fixed shuffle, the first ``val_fraction`` (at least one) held out."""
    if len(pairs) < 2:
        raise DataError(f"{len(pairs)} preference pair(s): need at least 2, one to train on and one held out")
    order = np.random.default_rng(0).permutation(len(pairs))
    n_val = min(max(1, round(len(pairs) * val_fraction)), len(pairs) - 1)
    return [pairs[i] for i in order[n_val:]], [pairs[i] for i in order[:n_val]]


@dataclass
class PairBatch:
    """Token tensors of pairs: rows ``[:n]`` the chosen sequences, ``[n:]`` the rejected ones.
    ``inputs[:, t]`` predicts ``targets[:, t]``; ``mask`` marks the answer's targets."""

    inputs: torch.Tensor  # (2n, time) int64
    targets: torch.Tensor  # (2n, time) int64
    mask: torch.Tensor  # (2n, time) bool

    @property
    def pairs(self) -> int:
        return self.inputs.shape[0] // 2

    def to(self, device: torch.device) -> PairBatch:
        return PairBatch(self.inputs.to(device), self.targets.to(device), self.mask.to(device))


def _sequence(prompt: Sequence[int], answer: Sequence[int], block_size: int) -> tuple[list[int], int]:
    """prompt + answer (token ids) cut to ``block_size + 1`` tokens: the prompt loses its start (one
    token stays), then the answer its end. Returns the ids and where the answer starts."""
    keep_prompt = max(1, min(len(prompt), block_size + 1 - len(answer)))
    seq = ([*prompt[len(prompt) - keep_prompt :]] + [*answer])[: block_size + 1]
    return seq, keep_prompt


def encode_pairs(
    pairs: list[PreferencePair], block_size: int, encode: Callable[[bytes], Sequence[int]] | None = None
) -> PairBatch:
    """Pairs as one right-padded batch for a model of ``block_size`` positions; ``encode`` turns
    a prompt or an answer into token ids (default: its bytes are the ids). The prompt and each
    answer are encoded on their own."""
    ids = encode or bytes
    rows = [_sequence(ids(p.prompt), ids(p.chosen), block_size) for p in pairs]
    rows += [_sequence(ids(p.prompt), ids(p.rejected), block_size) for p in pairs]
    time = max(len(seq) for seq, _ in rows) - 1
    tokens = torch.zeros(len(rows), time + 1, dtype=torch.int64)
    mask = torch.zeros(len(rows), time, dtype=torch.bool)
    for i, (seq, answer_start) in enumerate(rows):
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        mask[i, answer_start - 1 : len(seq) - 1] = True  # target t is token t + 1
    return PairBatch(tokens[:, :-1], tokens[:, 1:], mask)


class PairSampler:
    """Random batches of pairs (with replacement), encoded for a model of ``block_size`` positions.
    Its position is a generator state, so a checkpoint of ``state_dict()`` makes a resumed run draw
    exactly the same batches; ``tokens_drawn`` counts the positions of the batches drawn so far
    (padding included: what the model computes), also across a resume."""

    def __init__(
        self,
        pairs: list[PreferencePair],
        batch_size: int,
        seed: int,
        block_size: int,
        encode: Callable[[bytes], Sequence[int]] | None = None,
    ) -> None:
        if not pairs:
            raise DataError("no training pairs to sample from")
        self.pairs, self.batch_size, self.block_size, self.encode = pairs, batch_size, block_size, encode
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = self.tokens_drawn = 0

    def next(self) -> PairBatch:
        idx = torch.randint(0, len(self.pairs), (self.batch_size,), generator=self.generator)
        batch = encode_pairs([self.pairs[i] for i in idx.tolist()], self.block_size, self.encode)
        self.batches_drawn += 1
        self.tokens_drawn += batch.inputs.numel()
        return batch

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            "batches_drawn": self.batches_drawn,
            "tokens_drawn": self.tokens_drawn,
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn, self.tokens_drawn = int(state["batches_drawn"]), int(state["tokens_drawn"])
