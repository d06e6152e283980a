"""The tokens a run trains on (``--tokenizer``, ``--vocab-size``): a `RunTokenizer` and the
token ids of the packed corpus (`tokenize`).

- ``bytes`` (the default): the UTF-8 bytes are the tokens, vocabulary 256;
- ``bpe``: a byte-level BPE (GPT-2's pre-tokenization, all 256 bytes in its alphabet, no special
  tokens) trained with Hugging Face ``tokenizers`` on the run's training split only, ``--vocab-size``
  ids (default `DEFAULT_BPE_VOCAB`); the same split and size give the same ``tokenizer.json``, byte
  for byte (the trainer breaks ties by pair, and the split is fed in fixed chunks);
- a path: an existing ``tokenizer.json`` (any ``tokenizers`` model), read as data only.

The model's vocabulary is the tokenizer's padded to a multiple of `VOCAB_MULTIPLE`, so that the
output head's dimensions suit FP8 GEMMs (`model_vocab_size`); the padded ids never occur.

The ids of each split are cached next to the packed bytes (`fp8lm.train.data.pack`), keyed by the
pack (the documents and the split), the tokenizer and its size, and stored memory-mapped: uint16
when the vocabulary fits, else int32. Text that is not UTF-8 is read with its invalid bytes
replaced (U+FFFD) before a BPE or file tokenizer sees it.

``val_bits_per_byte`` (`RunTokenizer.token_bytes`) divides the validation loss by the bytes the
validation targets stand for, so runs with different tokenizers compare.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from .config import RunError
from .data import TokenSplits, memmap_tokens

__all__ = [
    "TOKENIZER_KINDS",
    "DEFAULT_BPE_VOCAB",
    "VOCAB_MULTIPLE",
    "HF_EXTRA",
    "RunTokenizer",
    "require_tokenizers",
    "padded_vocab",
    "check_tokenizer_options",
    "model_vocab_size",
    "byte_tokenizer",
    "bytes_tokenizer",
    "load_tokenizer_file",
    "tokenizer_from_json",
    "recorded_tokenizer",
    "train_bpe",
    "tokenize",
    "token_dtype",
    "bits_per_byte",
]

TOKENIZER_KINDS = ("bytes", "bpe")  # besides the path of a tokenizer.json
DEFAULT_BPE_VOCAB = 8192
VOCAB_MULTIPLE = 16  # FP8 GEMMs need dimensions that are multiples of 16
HF_EXTRA = "pip install 'fp8lm[hf]'"
_BYTES = 256
_MAX_VOCAB = 2**31 - 1  # ids stored as int32
_TOKENIZE_VERSION = 1
_CHUNK = 1 << 20  # bytes of a split handed to the tokenizer at a time, cut after a newline
_BATCH = 16  # chunks encoded together (the tokenizer's threads work on them in parallel)


def require_tokenizers(what: str) -> None:
    """One `RunError` line when Hugging Face ``tokenizers`` is not installed."""
    if importlib.util.find_spec("tokenizers") is None:
        raise RunError(f"{what} needs Hugging Face tokenizers: {HF_EXTRA} (or pip install tokenizers)")


def padded_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return multiple * math.ceil(n / multiple)


def token_dtype(vocab: int) -> np.dtype:
    """How ids below ``vocab`` are stored: uint16 when they fit, else int32."""
    return np.dtype(np.uint16) if vocab <= 2**16 else np.dtype(np.int32)


@dataclass(frozen=True)
class RunTokenizer:
    """A run's tokenizer: ``kind`` (``bytes``, ``bpe`` or ``file``), the ``tokenizer.json`` text
    (None for bytes) and the ids it has (``vocab``, special tokens included)."""

    kind: str
    json: str | None
    vocab: int

    @property
    def model_vocab(self) -> int:
        """The model's vocabulary: ``vocab`` padded to a multiple of `VOCAB_MULTIPLE`."""
        return padded_vocab(self.vocab)

    @cached_property
    def hf(self):
        """The ``tokenizers.Tokenizer`` (for bytes: `byte_tokenizer`, without its json)."""
        if self.json is None:
            return byte_tokenizer()
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.json)

    def encode(self, data: bytes) -> list[int]:
        """The ids of ``data`` (bytes; not UTF-8 is read with U+FFFD for invalid bytes but for bytes)."""
        if self.json is None:
            return list(data)
        return self.hf.encode(data.decode("utf-8", "replace"), add_special_tokens=False).ids

    def encoder(self):
        """`encode` remembering what it encoded (the preference pairs are drawn many times)."""
        return lru_cache(maxsize=None)(self.encode)

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i < self.vocab]  # the padded ids stand for nothing
        if self.json is None:
            return bytes(ids).decode("utf-8", "replace")
        return self.hf.decode(ids, skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes each id of the model's vocabulary stands for (float64, 0 for the padded
        ids): a byte-level token's are its bytes; another's, those of its decoded text."""
        out = np.zeros(self.model_vocab, dtype=np.float64)
        if self.json is None:
            out[:_BYTES] = 1.0
            return out
        alphabet = set(_bytes_to_unicode().values())
        tok = self.hf
        for i in range(self.vocab):
            piece = tok.id_to_token(i)
            if piece is None:
                continue
            if all(c in alphabet for c in piece):
                out[i] = len(piece)
            else:
                out[i] = len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
        return out

    def record(self) -> dict:
        """What a checkpoint records of it (`recorded_tokenizer` reads it back)."""
        return {"kind": self.kind, "json": self.json}

    def describe(self) -> str:
        if self.kind == "bytes":
            return "bytes (vocabulary 256)"
        padded = f", model vocabulary {self.model_vocab:,}" if self.model_vocab != self.vocab else ""
        name = "byte-level BPE trained on the training split" if self.kind == "bpe" else "tokenizer.json"
        return f"{name}, {self.vocab:,} ids{padded}"


def bits_per_byte(mean_loss: float, tokens: int, nbytes: float) -> float:
    """A mean loss in nats per token over ``tokens`` tokens standing for ``nbytes`` bytes, in bits
    per byte."""
    return mean_loss * tokens / (math.log(2) * nbytes)


# -- the three kinds --------------------------------------------------------------------------


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` whose ids 0..255 are the UTF-8 bytes of the text, as fp8lm's
    byte-level data makes them (`fp8lm.train.data`): a byte-level BPE with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of each byte (the byte-level pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def bytes_tokenizer() -> RunTokenizer:
    return RunTokenizer("bytes", None, _BYTES)


def recorded_tokenizer(record) -> RunTokenizer:
    """The tokenizer a checkpoint records (`RunTokenizer.record`; bytes for checkpoints without one)."""
    if not isinstance(record, dict) or record.get("json") is None:
        return bytes_tokenizer()
    return tokenizer_from_json(str(record["json"]), str(record.get("kind", "file")))


def tokenizer_from_json(text: str | None, kind: str = "file") -> RunTokenizer:
    """The tokenizer of a ``tokenizer.json`` text (None: bytes), as a checkpoint records it."""
    if text is None:
        return bytes_tokenizer()
    require_tokenizers("this run's tokenizer")
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises its own exception types for bad JSON
        raise RunError(f"the recorded tokenizer cannot be read: {_first_line(e)}") from None
    return RunTokenizer(kind, text, vocab)


def load_tokenizer_file(path: str | os.PathLike) -> RunTokenizer:
    """The tokenizer of a ``tokenizer.json`` file; one `RunError` line when it is missing or not one."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "does not exist"
        raise RunError(
            f"--tokenizer {str(p)!r} {what}: pass bytes, bpe or the path of a tokenizer.json file "
            "(Hugging Face tokenizers)"
        )
    require_tokenizers(f"--tokenizer {str(p)!r}")
    from tokenizers import Tokenizer

    try:
        text = p.read_text(encoding="utf-8")
        tok = Tokenizer.from_str(text)
    except Exception as e:  # not UTF-8, unreadable, or JSON tokenizers refuses (it raises plain Exception)
        raise RunError(
            f"--tokenizer {str(p)!r} is not a tokenizer.json that Hugging Face tokenizers reads "
            f"({_first_line(e)}); pass another file, bytes or bpe"
        ) from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if not 1 <= vocab <= _MAX_VOCAB:
        raise RunError(f"--tokenizer {str(p)!r} has {vocab} ids; a run needs 1 to {_MAX_VOCAB:,}")
    return RunTokenizer("file", text, vocab)


def train_bpe(train: np.ndarray, vocab_size: int) -> RunTokenizer:
    """A byte-level BPE of ``vocab_size`` ids (fewer when the text has fewer pairs to merge)
    trained on the bytes ``train``; deterministic (the same bytes and size, the same json)."""
    require_tokenizers("--tokenizer bpe")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_texts(train), trainer)
    text = tok.to_str()
    return RunTokenizer("bpe", text, tok.get_vocab_size(with_added_tokens=True))


# -- options ----------------------------------------------------------------------------------


def check_tokenizer_options(tokenizer: str, vocab_size: int | None) -> None:
    """Refuse (one `RunError` line) a ``--tokenizer``/``--vocab-size`` pair that cannot work."""
    if tokenizer == "bytes":
        if vocab_size is not None:
            raise RunError(
                f"--vocab-size {vocab_size} sets the size of a BPE vocabulary; --tokenizer bytes has 256: "
                "drop --vocab-size or pass --tokenizer bpe"
            )
        return
    if tokenizer == "bpe":
        require_tokenizers("--tokenizer bpe")
        if vocab_size is not None and not _BYTES <= vocab_size <= _MAX_VOCAB:
            raise RunError(
                f"--vocab-size must be at least 256 (the byte alphabet every BPE starts from) and at most "
                f"{_MAX_VOCAB:,}, got {vocab_size}"
            )
        return
    if vocab_size is not None:
        raise RunError(
            f"--vocab-size {vocab_size}: the size of --tokenizer {tokenizer!r} is its own; drop --vocab-size"
        )
    load_tokenizer_file(tokenizer)


def model_vocab_size(tokenizer: str, vocab_size: int | None) -> int:
    """The model's vocabulary for these options (checked by `check_tokenizer_options`)."""
    if tokenizer == "bytes":
        return _BYTES
    if tokenizer == "bpe":
        return padded_vocab(vocab_size or DEFAULT_BPE_VOCAB)
    return load_tokenizer_file(tokenizer).model_vocab


# -- the corpus as ids ------------------------------------------------------------------------


def tokenize(
    splits: TokenSplits, tokenizer: str, vocab_size: int | None, cache_dir: str | os.PathLike
) -> tuple[TokenSplits, RunTokenizer]:
    """The splits (byte tokens, `fp8lm.train.data.pack`) as ids of the tokenizer the options name,
    and that tokenizer. ``bytes`` returns them as they are; otherwise the tokenizer (trained on
    the training split for ``bpe``) and the ids are cached under ``cache_dir``, written under
    temporary names and renamed, the metadata last."""
    if tokenizer == "bytes":
        return splits, bytes_tokenizer()
    given = None if tokenizer == "bpe" else load_tokenizer_file(tokenizer)
    size = vocab_size or DEFAULT_BPE_VOCAB
    identity = f"bpe:{size}" if given is None else "file:" + hashlib.sha256(given.json.encode()).hexdigest()
    key = hashlib.sha256(f"{_TOKENIZE_VERSION}|{splits.key}|{identity}".encode()).hexdigest()[:16]
    cache = Path(cache_dir)
    meta_path, json_path = cache / f"ids-{key}.json", cache / f"ids-{key}.tokenizer.json"
    train_path, val_path = cache / f"ids-{key}.train.bin", cache / f"ids-{key}.val.bin"
    if not meta_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tok = given or train_bpe(splits.train, size)
        dtype = token_dtype(tok.model_vocab)
        n_train = _encode_to(tok, splits.train, train_path, dtype)
        n_val = _encode_to(tok, splits.val, val_path, dtype)
        _atomic_text(json_path, tok.json or "")
        meta = {"kind": tok.kind, "vocab": tok.vocab, "dtype": dtype.name, "train": n_train, "val": n_val}
        _atomic_text(meta_path, json.dumps(meta))  # last: its presence marks a complete cache
    meta = json.loads(meta_path.read_text())
    tok = RunTokenizer(meta["kind"], json_path.read_text(encoding="utf-8"), int(meta["vocab"]))
    dtype = np.dtype(meta["dtype"])
    info = {
        **splits.info,
        "tokenizer": tok.kind,
        "tokenizer_vocab": tok.vocab,
        "vocab_size": tok.model_vocab,
        "train_bytes": splits.info["train_tokens"],
        "val_bytes": splits.info["val_tokens"],
        "train_tokens": int(meta["train"]),
        "val_tokens": int(meta["val"]),
    }
    ids = TokenSplits(memmap_tokens(train_path, dtype), memmap_tokens(val_path, dtype), info, key)
    return ids, tok


def _encode_to(tok: RunTokenizer, data: np.ndarray, path: Path, dtype: np.dtype) -> int:
    """Write the ids of the bytes ``data`` to ``path`` (via a temporary); returns their count."""
    tmp = path.with_suffix(".tmp")
    n = 0
    with open(tmp, "wb") as f:
        batch: list[str] = []
        for text in _texts(data):
            batch.append(text)
            if len(batch) == _BATCH:
                n += _write_ids(f, tok, batch, dtype)
                batch = []
        n += _write_ids(f, tok, batch, dtype)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n


def _write_ids(f, tok: RunTokenizer, texts: list[str], dtype: np.dtype) -> int:
    if not texts:
        return 0
    n = 0
    for enc in tok.hf.encode_batch(texts, add_special_tokens=False):
        ids = np.asarray(enc.ids, dtype=np.int64)
        f.write(ids.astype(dtype).tobytes())
        n += len(ids)
    return n


def _texts(data: np.ndarray) -> Iterator[str]:
    """The bytes ``data`` as text in chunks of about `_CHUNK` bytes, each cut after a newline (else
    at a UTF-8 character boundary), invalid UTF-8 replaced: the same bytes, the same chunks."""
    start, n = 0, len(data)
    while start < n:
        end = min(start + _CHUNK, n)
        block = bytes(data[start:end])
        if end < n:
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # no newline: cut before the last character, which may continue in the next chunk
                cut = len(block)
                while cut > 0 and block[cut - 1] & 0xC0 == 0x80:  # continuation bytes
                    cut -= 1
                if cut > 0 and block[cut - 1] >= 0xC0:  # the lead byte they continue
                    cut -= 1
                cut = cut or len(block)
            block = block[:cut]
        yield block.decode("utf-8", "replace")
        start += len(block)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
