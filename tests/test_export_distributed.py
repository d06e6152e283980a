"""`fp8lm export` of 2-rank checkpoints (gloo): a --fsdp run (full weights in the file), a --tp 2
and a --pp 2 run (weights only in their DCP shard folders, resharded to whole tensors). The exported model's
loss on the run's validation batches is the one the run measured with its sharded model."""

import json
import os
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_launch import forked_ranks
from fp8lm.cli import main
from fp8lm.train.data import eval_batches, pack, path_documents

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

pytestmark = pytest.mark.slow  # 2-rank training processes

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
OPTIONS = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--steps", "24", "--lr", "1e-2"]
OPTIONS += ["--eval-every", "24", "--eval-batches", "4", "--data", EMAIL, "--no-progress", "--opt-level", "O2"]


def train(out: Path, cache: Path, *layout: str) -> None:
    cmd = forked_ranks(2)
    cmd += ["-m", "fp8lm.cli", "train", *OPTIONS, "--cache-dir", str(cache), "--out", str(out), *layout]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def export(run: Path, out: Path, fmt: str) -> None:
    """``fp8lm export`` in this process: one process reads every rank's shards."""
    assert main(["export", str(run), "--out", str(out), "--format", fmt]) == 0


@pytest.mark.parametrize("layout", [("--fsdp",), ("--tp", "2"), ("--pp", "2")], ids=["fsdp", "tp2", "pp2"])
def test_a_two_rank_checkpoint_exports_the_model_it_trained(tmp_path, layout):
    run = tmp_path / "run"
    train(run, tmp_path / "cache", *layout)
    checkpoint = torch.load(next((run / "checkpoints").glob("*.pt")), weights_only=True)
    assert (checkpoint["model"] is None) == (layout[0] != "--fsdp")  # TP, PP: the weights are in the shards alone
    val_loss = json.loads((run / "summary.json").read_text())["val_loss"]
    batches = eval_batches(pack(*path_documents(EMAIL), tmp_path / "cache", 0.05).val, 4, 8, 32)
    for fmt in ("hf", "hf-fp8"):
        export(run, tmp_path / fmt, fmt)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / fmt, dtype=torch.float32).eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item() for x, y in batches]
        assert abs(sum(losses) / len(losses) - val_loss) < 0.01 * val_loss, (fmt, losses, val_loss)
