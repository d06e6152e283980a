"""`fp8lm compare --fsdp` and `fp8lm train --fsdp --resume` on 2 gloo ranks: bf16 (torch's FSDP2
with a BF16 MixedPrecisionPolicy) and O2 (FP8 all-gather and reduce-scatter, FP8AdamW on the
shards) write summaries with the FSDP collectives' bytes; a run resumed from a Distributed
Checkpoint writes the uninterrupted run's metrics and telemetry byte for byte, at O1 too (FP32
weights, E4M3 all-gathers); what --fsdp cannot do is refused in one line."""

import json
import shutil
import subprocess

import pytest

from cli_helpers import run_main
from dist_launch import forked_ranks
from fp8lm.train.config import RunError, TrainConfig
from test_train_distributed import ENV, STEPS, TIMEOUT_S, check, run_options


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp_train")


@pytest.fixture(scope="module")
def uninterrupted(work):
    out = work / "whole"
    args = ["-m", "fp8lm.cli", "compare", "--fsdp", "--levels", "bf16,O2", *run_options(out, work / "cache")]
    log = check(subprocess.run(forked_ranks(2, *args), env=ENV, capture_output=True, text=True, timeout=2 * TIMEOUT_S))
    return out, log


def read(path):
    return json.loads(path.read_text())


@pytest.mark.slow
def test_fsdp_summaries_count_the_fsdp_collectives(uninterrupted):
    out, _ = uninterrupted
    bf16, o2 = read(out / "bf16" / "summary.json"), read(out / "O2" / "summary.json")
    for s in (bf16, o2):
        assert s["world_size"] == 2 and s["config"]["fsdp"]
        records = [json.loads(line) for line in (out / s["opt_level"] / "metrics.jsonl").read_text().splitlines()]
        assert s["comm_bytes_per_step"] == sum(r["comm_bytes"] for r in records) / STEPS
    n = bf16["num_params"]
    # BF16, half of it sent at 2 ranks: every weight gathered for the forward (2 bytes), the blocks'
    # again for the backward (the root keeps its own), a BF16 reduce-scatter; plus FSDP2's padding.
    assert 2 * n < bf16["comm_bytes_per_step"] <= 3.1 * n
    # O2: E4M3 weights of the FP8 GEMMs (56 % of this tiny model), FP16 for the embeddings (23 %)
    # and the output head (19 %; its GEMMs are BF16 by default), an FP8 reduce-scatter: about 0.59
    # of BF16's bytes from that composition (0.60 measured, with FSDP2's padding and the scales).
    assert o2["comm_bytes_per_step"] < 0.65 * bf16["comm_bytes_per_step"]
    # Each rank holds half of the FP16 weights, E4M3 first and FP16 second moments (5 bytes), padded
    # to whole rows, and half of the gradients in the policy's formats: E4M3 (1 byte) but the output
    # head's BF16 (2 bytes, 19 %) and the vectors' FP32 (4 bytes, 2 %): 1.25 bytes per parameter.
    mem = o2["memory"]
    assert n / 2 < mem["gradients"] <= 1.3 * n / 2
    assert 5 * n / 2 <= mem["weights"] + mem["exp_avg"] + mem["exp_avg_sq"] <= 1.03 * 5 * n / 2


@pytest.mark.slow
def test_fsdp_resume_from_a_distributed_checkpoint_matches_the_uninterrupted_run(uninterrupted, work):
    whole = uninterrupted[0] / "O2"
    out = work / "resumed"
    shutil.copytree(whole, out)
    (out / "summary.json").unlink()
    last = out / "checkpoints" / f"step_{STEPS:08d}"
    last.with_suffix(".pt").unlink()
    shutil.rmtree(last.with_suffix(".dcp"))
    args = ["-m", "fp8lm.cli", "train", "--opt-level", "O2", "--fsdp", *run_options(out, work / "cache", "--resume")]
    check(subprocess.run(forked_ranks(2, *args), env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S))
    for name in ("metrics.jsonl", "telemetry.jsonl"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert read(out / "summary.json")["val_loss"] == read(whole / "summary.json")["val_loss"]


@pytest.mark.slow
def test_o1_fsdp_gathers_e4m3_and_resumes_byte_for_byte(uninterrupted, work):
    """O1 under --fsdp: FP32 weights, torch's AdamW on the FP32 shards, the FP8 GEMMs' weights
    all-gathered in E4M3; a run resumed from its Distributed Checkpoint writes the uninterrupted
    run's metrics and telemetry byte for byte."""
    whole, out = work / "o1", work / "o1_resumed"
    args = ["-m", "fp8lm.cli", "train", "--opt-level", "O1", "--fsdp"]
    check(
        subprocess.run(
            forked_ranks(2, *args, *run_options(whole, work / "cache")),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    )
    shutil.copytree(whole, out)
    (out / "summary.json").unlink()
    last = out / "checkpoints" / f"step_{STEPS:08d}"
    last.with_suffix(".pt").unlink()
    shutil.rmtree(last.with_suffix(".dcp"))
    resume = forked_ranks(2, *args, *run_options(out, work / "cache", "--resume"))
    check(subprocess.run(resume, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S))
    for name in ("metrics.jsonl", "telemetry.jsonl"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    o1, o2 = read(whole / "summary.json"), read(uninterrupted[0] / "O2" / "summary.json")
    # the same E4M3 weights and reduce-scatter as O2; the embeddings and head in FP32 (O2: FP16)
    # add 2 bytes per element of their gathers (42 % of this tiny model's parameters, gathered once
    # per step): 1.21x O2's bytes measured
    assert o2["comm_bytes_per_step"] < o1["comm_bytes_per_step"] < 1.5 * o2["comm_bytes_per_step"]
    assert read(out / "summary.json")["val_loss"] == o1["val_loss"]


def test_fsdp_with_o3_or_grad_sync_scaling_is_refused():
    with pytest.raises(RunError, match="--fsdp with O3: .* use --opt-level O2 --fsdp"):
        TrainConfig(opt_level="O3", fsdp=True).validate()
    with pytest.raises(RunError, match="--grad-sync-scaling .* --fsdp replaces"):
        TrainConfig(opt_level="O2", fsdp=True, grad_sync_scaling="shared").validate()


def test_fsdp_without_torchrun_is_one_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc, _, err = run_main(["train", "--fsdp", "--model", "tiny", "--out", str(tmp_path / "run")], capsys)
    assert rc == 2
    assert err.strip().splitlines()[-1] == (
        "fp8lm train: error: --fsdp shards over torchrun's ranks: launch with torchrun --nproc_per_node N, "
        "or drop --fsdp"
    )
