"""The JSON-lines logs a training run writes on rank 0: ``metrics.jsonl`` (one record per step)
and ``telemetry.jsonl`` (FP8 numerics of sampled steps), with TensorBoard scalars when installed.

Everything is strict JSON (`strict_json`): an inf or NaN is written as null and named, with its
value as text, in the record's ``"nonfinite"`` entry; `parse_strict` reads it back as it was."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import atomic_write_bytes

__all__ = ["JsonLines", "RunLogs", "strict_json", "parse_strict"]


class JsonLines:
    """A run's JSON-lines log; on resume the lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path, keep_until_step: int | None, tensorboard: bool = False) -> None:
        self.path = path
        self.records: list[dict] = []
        if keep_until_step is not None and path.exists():
            lines = (parse_strict(line) for line in path.read_text().splitlines() if line.strip())
            self.records = [r for r in lines if r["step"] <= keep_until_step]
        atomic_write_bytes(path, "".join(strict_json(r) + "\n" for r in self.records).encode())
        self.file = open(path, "a")
        self.writer = _tensorboard_writer(path.parent) if tensorboard else None

    def write(self, record: dict) -> None:
        self.records.append(record)
        self.file.write(strict_json(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, float):
                    self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


@dataclass
class RunLogs:
    """What rank 0 writes during training."""

    metrics: JsonLines
    telemetry: JsonLines | None

    @classmethod
    def open(cls, out: Path, keep_until_step: int | None, telemetry: bool) -> RunLogs:
        """The logs in folder ``out``, truncated to ``keep_until_step`` when resuming (None: fresh)."""
        return cls(
            JsonLines(out / "metrics.jsonl", keep_until_step, tensorboard=True),
            JsonLines(out / "telemetry.jsonl", keep_until_step) if telemetry else None,
        )

    def close(self) -> None:
        self.metrics.close()
        if self.telemetry is not None:
            self.telemetry.close()


def strict_json(record: dict, indent: int | None = None) -> str:
    """``record`` as strict JSON (no ``NaN``/``Infinity``, which JSON does not have): each
    non-finite float becomes null and is listed by its dotted key, with its value as text, under
    ``"nonfinite"``. Values that are not JSON are written as their repr."""
    nonfinite: dict[str, str] = {}
    clean = _finite(record, "", nonfinite)
    if nonfinite:
        clean["nonfinite"] = nonfinite
    return json.dumps(clean, indent=indent, allow_nan=False, default=repr)


def parse_strict(text: str) -> dict:
    """A record written by `strict_json`, its non-finite values restored."""
    record = json.loads(text)
    for key, value in record.pop("nonfinite", {}).items():
        *parents, last = key.split(".")
        holder = record
        for name in parents:
            holder = holder[int(name)] if isinstance(holder, list) else holder[name]
        holder[int(last) if isinstance(holder, list) else last] = float(value)
    return record


def _finite(value, key: str, nonfinite: dict[str, str]):
    if isinstance(value, float) and not math.isfinite(value):
        nonfinite[key] = repr(value)
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{key}.{k}" if key else str(k), nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{key}.{i}" if key else str(i), nonfinite) for i, v in enumerate(value)]
    return value


def _tensorboard_writer(logdir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(logdir / "tensorboard"))
