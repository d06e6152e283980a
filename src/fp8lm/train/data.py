"""Training text as byte-level tokens: corpus discovery, a deterministic train/validation split,
packing into memory-mapped uint8 files (built once, cached, reused) and batch sampling.

Corpora:
- the default: the ``.py`` sources of the running Python's standard library
  (``sysconfig.get_paths()['stdlib']``, about 30 MB, ``site-packages`` excluded);
- ``--data PATH``: a text file, or a folder of text files (hidden files and binary files skipped);
- ``--hf-dataset NAME``: the ``text`` column of a Hugging Face dataset (needs ``datasets``).

Split: a document (a file, or a dataset row) goes to validation when the CRC32 of its name falls
in the first ``val_fraction`` of the hash range, so the split is deterministic and stable when
files are added. With fewer documents than that gives each side (e.g. a single file), the last
``val_fraction`` of the concatenated bytes is the validation split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "Document",
    "stdlib_documents",
    "path_documents",
    "hf_documents",
    "run_documents",
    "TokenSplits",
    "pack",
    "BatchSampler",
    "eval_batches",
    "DataError",
    "data_fingerprint",
    "memmap_tokens",
]

_PACK_VERSION = 1
_HASH_RANGE = 1 << 32
_CHUNK = 1 << 24  # bytes read and written at a time while packing: the most of a corpus held in memory
# a file's content fingerprint hashes it whole up to this size, else this many evenly spaced blocks
_WHOLE_UP_TO, _SAMPLES, _SAMPLE = 1 << 22, 64, 1 << 16


class DataError(ValueError):
    """The data the user pointed at cannot be used (missing, empty, too small)."""


@dataclass(frozen=True)
class Document:
    """One unit of the split: ``name`` decides its side, ``read()`` gives its bytes (`chunks` gives
    them a block at a time, so a file is never held whole)."""

    name: str
    read: Callable[[], bytes]
    fingerprint: str  # changes when the content may have changed (size, mtime)
    path: Path | None = None  # the file, when the document is one

    def chunks(self) -> Iterator[bytes]:
        if self.path is None:
            yield self.read()
            return
        with open(self.path, "rb") as f:
            while block := f.read(_CHUNK):
                yield block


def _file_document(path: Path, root: Path) -> Document:
    st = path.stat()
    return Document(path.relative_to(root).as_posix(), path.read_bytes, f"{st.st_size}:{st.st_mtime_ns}", path)


def stdlib_documents() -> tuple[str, list[Document]]:
    """The ``.py`` files of the running Python's standard library, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())
    if not files:
        raise DataError(f"no .py files found in the standard library at {root}; pass --data PATH")
    return f"stdlib:{root}", [_file_document(p, root) for p in files]


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\x00" in f.read(4096)


def path_documents(path: str | os.PathLike) -> tuple[str, list[Document]]:
    """A text file, or every non-hidden, non-binary file under a folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data path {str(p)!r} does not exist; pass an existing text file or folder to --data")
    if p.is_file():
        if p.stat().st_size == 0:
            raise DataError(f"data file {str(p)!r} is empty; pass a file with text in it")
        return f"path:{p.resolve()}", [_file_document(p, p.parent)]
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file()
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
        and f.stat().st_size > 0
        and not _looks_binary(f)
    )
    if not files:
        raise DataError(
            f"data folder {str(p)!r} holds no non-empty text files; put text files in it or pass another --data"
        )
    return f"path:{p.resolve()}", [_file_document(f, p) for f in files]


def run_documents(data: str | os.PathLike | None = None, hf_dataset: str | None = None) -> tuple[str, list[Document]]:
    """The corpus a run reads: ``--hf-dataset``'s train split, else ``--data``, else the standard
    library's sources (the main job's)."""
    if hf_dataset:
        return hf_documents(hf_dataset)
    return path_documents(data) if data else stdlib_documents()


def hf_documents(name: str, split: str = "train", column: str = "text") -> tuple[str, list[Document]]:
    """The ``column`` of a Hugging Face dataset, one document per row."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "--hf-dataset needs the 'datasets' package: pip install datasets (or use --data PATH)"
        ) from None
    ds = datasets.load_dataset(name, split=split)
    if column not in ds.column_names:
        raise DataError(f"dataset {name!r} has no {column!r} column (it has {ds.column_names})")
    texts = ds[column]
    fp = getattr(ds, "_fingerprint", str(len(texts)))
    docs = [Document(f"{i}", lambda t=t: t.encode("utf-8"), fp) for i, t in enumerate(texts) if t]
    if not docs:
        raise DataError(f"dataset {name!r} has no non-empty {column!r} rows")
    return f"hf:{name}:{split}", docs


def is_validation(name: str, val_fraction: float) -> bool:
    return zlib.crc32(_name_bytes(name)) < val_fraction * _HASH_RANGE


def _name_bytes(name: str) -> bytes:
    """A document name as bytes; a file name that is not UTF-8 (its bytes kept as surrogates by
    ``os.fsdecode``) gives its original bytes."""
    return name.encode("utf-8", "surrogateescape")


@dataclass
class TokenSplits:
    train: np.ndarray  # memmaps: uint8 bytes (`pack`), or ids (`fp8lm.train.tokenizer.tokenize`)
    val: np.ndarray
    info: dict
    key: str = ""  # names the cached files: another corpus, split or tokenizer, another key


def _cache_key(source: str, docs: list[Document], val_fraction: float) -> str:
    h = hashlib.sha256(_name_bytes(f"{_PACK_VERSION}|{source}|{val_fraction!r}"))
    for d in docs:
        h.update(b"\n" + _name_bytes(d.name) + f"|{d.fingerprint}".encode())
    return h.hexdigest()[:16]


def _write_stream(path: Path, chunks: Iterable[bytes]) -> int:
    n = 0
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
            n += len(c)
        f.flush()
        os.fsync(f.fileno())
    return n


def is_packed(source: str, docs: list[Document], cache_dir: str | os.PathLike, val_fraction: float = 0.05) -> bool:
    """Whether `pack` finds these documents packed in ``cache_dir`` already (it then writes nothing)."""
    return (Path(cache_dir) / f"tokens-{_cache_key(source, docs, val_fraction)}.json").exists()


def pack(source: str, docs: list[Document], cache_dir: str | os.PathLike, val_fraction: float = 0.05) -> TokenSplits:
    """Byte tokens of ``docs`` split into train/validation, as memmaps under ``cache_dir``.

    Packed once: a later call with the same documents (names, sizes, mtimes) and split reuses the
    files. Files are written under temporary names and renamed, so an interrupted pack is redone.
    Streamed: documents are read and written ``_CHUNK`` bytes at a time, so a corpus larger than
    memory packs (peak memory is a block, not the corpus).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cache = Path(cache_dir)
    key = _cache_key(source, docs, val_fraction)
    meta_path = cache / f"tokens-{key}.json"
    train_path, val_path = cache / f"tokens-{key}.train.bin", cache / f"tokens-{key}.val.bin"
    if not meta_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        val_docs = [d for d in docs if is_validation(d.name, val_fraction)]
        train_docs = [d for d in docs if not is_validation(d.name, val_fraction)]
        tmp_train, tmp_val = train_path.with_suffix(".tmp"), val_path.with_suffix(".tmp")
        if val_docs and train_docs:
            split = "by-document"
            n_train = _write_stream(tmp_train, _chunks(train_docs))
            n_val = _write_stream(tmp_val, _chunks(val_docs))
        else:
            split = "by-bytes"
            n_train, n_val = _split_tail(_write_stream(tmp_train, _chunks(docs)), tmp_train, tmp_val, val_fraction)
        meta = {
            "source": source,
            "split": split,
            "val_fraction": val_fraction,
            "documents": len(docs),
            "val_documents": len(val_docs) if split == "by-document" else 0,
            "train_tokens": n_train,
            "val_tokens": n_val,
        }
        os.replace(tmp_train, train_path)
        os.replace(tmp_val, val_path)
        tmp_meta = meta_path.with_suffix(".tmp")
        tmp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_meta, meta_path)  # last: its presence marks a complete pack
    meta = json.loads(meta_path.read_text())
    return TokenSplits(memmap_tokens(train_path), memmap_tokens(val_path), meta, key)


def describe(info: dict) -> str:
    """One line about a packed corpus (`pack`'s ``info``, or `fp8lm.train.tokenizer.tokenize`'s):
    its source, files, bytes, tokens and how it was split into train and validation."""
    share = f"{info['val_fraction']:.0%}"
    if "tokenizer" in info:  # ids of a tokenizer: bytes and tokens differ
        nbytes = info["train_bytes"] + info["val_bytes"]
        tokens = info["train_tokens"] + info["val_tokens"]
        head = (
            f"data: {info['source']}: {info['documents']:,} file(s), {nbytes / 1e6:,.2f} MB, {tokens:,} tokens "
            f"of {info['tokenizer']} ({nbytes / max(tokens, 1):.2f} bytes per token, model vocabulary "
            f"{info['vocab_size']:,}); train {info['train_tokens']:,} / validation {info['val_tokens']:,} tokens, "
        )
    else:
        total = info["train_tokens"] + info["val_tokens"]
        head = (
            f"data: {info['source']}: {info['documents']:,} file(s), {total / 1e6:,.2f} MB, {total:,} tokens (bytes); "
            f"train {info['train_tokens']:,} / validation {info['val_tokens']:,} tokens, "
        )
    if info["split"] == "by-document":
        return head + f"split by file: {info['val_documents']:,} file(s) held out ({share} by name hash)"
    return head + (
        f"split by bytes: the last {share} of the joined text, no file held out ({info['documents']:,} file(s) "
        f"are too few for a {share} split by file; pass a folder of more files for held-out documents)"
    )


def _chunks(docs: list[Document]) -> Iterator[bytes]:
    for d in docs:
        yield from d.chunks()


def _split_tail(n: int, train: Path, val: Path, val_fraction: float) -> tuple[int, int]:
    """Move the last ``val_fraction`` of the ``n`` bytes written to ``train`` into ``val`` (at least
    one byte), a block at a time; returns the byte counts of both."""
    n_val = max(1, int(n * val_fraction))
    start = max(n - n_val, 0)
    with open(train, "r+b") as src:
        src.seek(start)
        _write_stream(val, iter(lambda: src.read(_CHUNK), b""))
        src.truncate(start)
        src.flush()
        os.fsync(src.fileno())
    return start, n_val


def data_fingerprint(docs: list[Document]) -> str:
    """A fingerprint of the documents' names and contents that is cheap for big files: each file's
    size and a hash of its bytes (whole up to 4 MiB, else 64 evenly spaced 64 KiB blocks and its
    end); documents that are not files contribute their own fingerprint. Another file, another
    size or other bytes where sampled give another fingerprint."""
    h = hashlib.sha256()
    for d in docs:
        content = _file_fingerprint(str(d.path), *_stat_key(d.path)) if d.path is not None else d.fingerprint
        h.update(_name_bytes(d.name) + b"\0" + content.encode() + b"\n")
    return h.hexdigest()[:32]


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns  # ctime: changed by any write, even one that resets mtime


@functools.lru_cache(maxsize=1 << 16)
def _file_fingerprint(path: str, size: int, mtime_ns: int, ctime_ns: int) -> str:
    """``size:hash`` of a file's sampled bytes (cached per size and times: a run computes it once)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _WHOLE_UP_TO:
            h.update(f.read())
        else:
            for i in range(_SAMPLES + 1):
                f.seek(min(i * (size // _SAMPLES), size - _SAMPLE))
                h.update(f.read(_SAMPLE))
    return f"{size}:{h.hexdigest()[:32]}"


def memmap_tokens(path: Path, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """The tokens of a packed file, read-only and memory-mapped (an empty array for an empty file)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"the {what} split has {len(tokens)} tokens but a sequence needs {seq_len + 1}; "
            "use more data or a shorter --seq-len"
        )


def _gather(tokens: np.ndarray, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets.numpy()[:, None] + np.arange(seq_len + 1)[None, :]
    window = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return window[:, :-1], window[:, 1:]


class BatchSampler:
    """Random windows of the training split. Its whole position is a generator state, so a
    checkpoint of ``state_dict()`` makes a resumed run draw exactly the same batches."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        _check_length(tokens, seq_len, "training")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        high = len(self.tokens) - self.seq_len
        offsets = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        self.batches_drawn += 1
        return _gather(self.tokens, offsets, self.seq_len)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])


def eval_batches(
    tokens: np.ndarray, num_batches: int, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: windows evenly spaced over the validation split (the same for
    every run with the same data and sizes, so validation losses compare directly)."""
    _check_length(tokens, seq_len, "validation")
    offsets = torch.linspace(0, len(tokens) - seq_len - 1, num_batches * batch_size).long()
    return [_gather(tokens, o, seq_len) for o in offsets.split(batch_size)]
