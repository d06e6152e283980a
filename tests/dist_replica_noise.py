"""Worker for tests/test_train_layouts.py: under `--tp 2` on 4 ranks (2 replicas of 2 ranks), every
rank builds the same model, and after that the ranks of a replica draw the same numbers from
torch's generator (nvfp4's stochastic rounding noise, on the tensors they share) while the two
replicas draw their own.

Arguments: a scratch folder for the run."""

import sys
import sysconfig
from pathlib import Path

import torch

from dist_launch import worker_main


def checks(rank, world, scratch):
    from torch.distributed.tensor import DTensor

    from fp8lm.tensor import ScalingTensor
    from fp8lm.train.config import TrainConfig
    from fp8lm.train.run import TrainingRun

    cfg = TrainConfig(
        model="tiny",
        opt_level="O2",
        recipe="nvfp4",
        steps=2,
        batch_size=4,
        seq_len=32,
        eval_every=2,
        eval_batches=1,
        data=str(Path(sysconfig.get_paths()["stdlib"]) / "email"),
        out=str(Path(scratch) / "run"),
        cache_dir=str(Path(scratch) / "cache"),
        progress=False,
        tp=2,
        telemetry_every=0,
    )
    run = TrainingRun(cfg)
    weights = []
    for p in run.core.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        t = t.dequantize() if isinstance(t, ScalingTensor) else t
        weights.append(t.detach().float().reshape(-1))
    return {"dp_rank": run.ranks.dp_rank, "weights": torch.cat(weights), "noise": torch.rand(16)}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker_main(checks)
