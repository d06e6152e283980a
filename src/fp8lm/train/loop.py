"""The training loop behind `fp8lm train`: one GPT run at one precision level (see `config`),
carried out by a `fp8lm.train.run.TrainingRun`."""

from __future__ import annotations

from .config import TrainConfig
from .resume import check_output
from .run import TrainingRun, lr_at

__all__ = ["train", "check_output", "lr_at"]


def train(cfg: TrainConfig) -> dict | None:
    """Train one GPT as ``cfg`` says; returns the summary (also written to ``<out>/summary.json``).

    Under ``torchrun`` every rank trains on its own batches of ``batch_size / world`` sequences
    (see `parallel`); rank 0 writes the files and gets the summary, the other ranks get None.
    Everything that can be wrong with the inputs is checked before anything is written, and
    ``summary.json`` is written last, atomically, so a failed run never looks complete.
    """
    return TrainingRun(cfg).fit()
