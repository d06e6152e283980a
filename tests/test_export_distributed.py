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


def test_the_bf16_steps_of_an_fsdp_run_evaluate_as_one_process(tmp_path):
    """Precision annealing under --fsdp: in the last steps the layers multiply the weights as
    stored (FP16 at O2), not their FP8 operand that FSDP2 gathered before, so the final
    validation loss is one process's model of the checkpoint (`run_model`: the layers in high
    precision, as the run's last step computed them), whatever the recipe's weight format."""
    from fp8lm.train.export import read_run_checkpoint, run_autocast, run_model

    run = tmp_path / "run"
    train(run, tmp_path / "cache", "--fsdp", "--recipe", "nvfp4", "--final-bf16-fraction", "0.25")
    val_loss = json.loads((run / "summary.json").read_text())["val_loss"]
    state = read_run_checkpoint(run)
    model = run_model(state)
    batches = eval_batches(pack(*path_documents(EMAIL), tmp_path / "cache", 0.05).val, 4, 8, 32)
    with torch.no_grad(), run_autocast(state):
        losses = [model(x, y)[1].item() for x, y in batches]
    # the same batches through the same values: 3.557790 both (before, the run measured 3.558316
    # with the 4-bit weights it gathered for nvfp4's GEMMs, 8e-5 away)
    assert abs(sum(losses) / len(losses) - val_loss) < 1e-6 * val_loss, (losses, val_loss)
