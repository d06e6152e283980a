"""The JSON-lines logs a training run writes on rank 0: ``metrics.jsonl`` (one record per step)
and ``telemetry.jsonl`` (FP8 numerics of sampled steps), with TensorBoard scalars when installed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import atomic_write_bytes

__all__ = ["JsonLines", "RunLogs"]


class JsonLines:
    """A run's JSON-lines log; on resume the lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path, keep_until_step: int | None, tensorboard: bool = False) -> None:
        self.path = path
        self.records: list[dict] = []
        if keep_until_step is not None and path.exists():
            lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            self.records = [r for r in lines if r["step"] <= keep_until_step]
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.file = open(path, "a")
        self.writer = _tensorboard_writer(path.parent) if tensorboard else None

    def write(self, record: dict) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
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


def _tensorboard_writer(logdir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(logdir / "tensorboard"))
