"""Every distributed layout checkpoints and resumes: `fp8lm train` under `--tp 2`, `--pp 2`,
`--pp 2 --fsdp`, `--pp 2` at O3 (FP8 ZeRO per stage), `--tp 2 --pp 2` (4 ranks), 3-D (`--tp 2 --pp 2 --fsdp`, 8 ranks),
data parallel, FP8 ZeRO, and O3 under `--tp 2` and `--tp 2 --pp 2`, with its
last checkpoint deleted and resumed from the one before,
writes the uninterrupted run's metrics byte for byte; and a checkpoint of one layout resumes in
another (resharded)."""

import json
import shutil
import subprocess

import pytest
import torch

from test_train_distributed import EMAIL, ENV, TIMEOUT_S, check
from test_train_level3 import torchrun

pytestmark = pytest.mark.slow  # multi-rank training processes

STEPS, SAVE_EVERY = 6, 3
TP2_PP2 = ("--tp", "2", "--pp", "2", "--pp-microbatches", "2")
REPLICAS = (("--tp", "2"), ("--pp", "2", "--pp-microbatches", "2"))  # on 4 ranks: 2 replicas averaged after backward


def options(out, cache, *extra: str) -> list[str]:
    return [
        "train",
        "--opt-level",
        "O2",
        "--model",
        "tiny",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--steps",
        str(STEPS),
        "--eval-every",
        "3",
        "--eval-batches",
        "2",
        "--save-every",
        str(SAVE_EVERY),
        "--telemetry-every",
        "2",
        "--data",
        EMAIL,
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def train(ranks: int, out, cache, *flags: str) -> subprocess.CompletedProcess:
    args = torchrun(ranks, "-m", "fp8lm.cli", *options(out, cache, *flags))
    return subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=3 * TIMEOUT_S)


def drop_last_checkpoint(run) -> None:
    """The run as a kill right before its final checkpoint would leave it."""
    last = f"step_{STEPS:08d}"
    (run / "checkpoints" / f"{last}.pt").unlink()
    shutil.rmtree(run / "checkpoints" / f"{last}.dcp", ignore_errors=True)  # one process: no shards
    (run / "summary.json").unlink()


@pytest.mark.parametrize(
    ("ranks", "flags"),
    [
        (2, ("--tp", "2", "--fallback")),
        (2, ("--pp", "2", "--pp-microbatches", "2", "--fallback")),
        (4, ("--pp", "2", "--fsdp")),
        (4, TP2_PP2),
        (8, ("--tp", "2", "--pp", "2", "--fsdp", "--pp-microbatches", "2")),
        (4, ("--pp", "2", "--opt-level", "O3", "--pp-microbatches", "2")),
        (2, ()),
        (2, ("--opt-level", "O3")),
        (4, ("--tp", "2", "--opt-level", "O3")),
        (4, ("--tp", "2", "--pp", "2", "--opt-level", "O3", "--pp-microbatches", "2")),
        (2, ("--fsdp", "--final-bf16-fraction", "0.5")),  # resumed at the first of the BF16 steps
        (2, ("--pp", "2", "--pp-microbatches", "2", "--final-bf16-fraction", "0.5")),
        (2, ("--pp", "2", "--pp-microbatches", "2", "--moe-experts", "4")),  # every stage's load-balancing loss
        (4, ("--pp", "2", "--pp-microbatches", "2", "--moe-experts", "4", "--ep", "2")),
        (2, ("--tp", "2", "--moe-experts", "4")),  # each rank routes its slice of the sequence
        (4, ("--tp", "2", "--moe-experts", "4", "--ep", "2")),  # experts spread at each tp place
        (4, ("--pp", "2", "--pp-microbatches", "2", "--fsdp", "--moe-experts", "4", "--ep", "2")),
        (4, REPLICAS[0]),
        (4, REPLICAS[1]),
    ],
    ids=[
        "tp2",
        "pp2",
        "pp2_fsdp",
        "tp2_pp2",
        "3d",
        "pp2_o3",
        "dp",
        "zero",
        "tp2_o3",
        "tp2_pp2_o3",
        "fsdp_bf16_tail",
        "pp2_bf16_tail",
        "pp2_moe",
        "pp2_ep2",
        "tp2_moe",
        "tp2_ep2",
        "pp2_ep2_fsdp",
        "tp2_dp2",
        "pp2_dp2",
    ],
)
def test_a_resumed_run_continues_byte_for_byte(tmp_path, request, ranks, flags):
    if flags == TP2_PP2:  # the module's uninterrupted --tp 2 --pp 2 run (the reshard tests' too)
        whole = request.getfixturevalue("tp2_pp2")
        cache = whole.parent / "cache"
    else:
        cache = tmp_path / "cache"
        whole = tmp_path / "whole"
        proc = train(ranks, whole, cache, *flags)
        check(proc)
        # telemetry reads each rank's shards: no DTensor reduction over a 2-D mesh in one go
        assert "sequential all_reduce" not in proc.stderr, proc.stderr[-2000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["world_size"] == ranks and summary["skipped_steps"] == 0
    if ranks == 4 and flags in REPLICAS:  # the replicas' average keeps the weight gradients' E4M3 at rest
        memory = summary["memory"]
        assert memory["gradients"] < memory["weights"], memory  # FP32 averages: 2x the FP16 weights
    assert (whole / "checkpoints" / f"step_{SAVE_EVERY:08d}.dcp").is_dir()
    if "--fallback" in flags:  # rank 0 judges every FP8 layer, those of the other ranks too
        saved = torch.load(whole / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)
        layers = {json.loads(line)["layer"] for line in (whole / "telemetry.jsonl").read_text().splitlines()}
        assert set(saved["fallback"]["high_precision"]) == {
            name for name in layers if name.startswith(("blocks", "lm"))
        }
        assert {"blocks.0.attn.c_attn", "blocks.1.mlp.c_proj"} <= layers  # both stages' layers, under --pp
    if "--final-bf16-fraction" in flags:
        metrics = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
        assert [m.get("bf16_gemms", False) for m in metrics] == [False] * 3 + [True] * 3
        if "--fsdp" in flags:
            # FSDP2 gathers the switched layers' weights anew, as stored (FP16: a byte more per
            # element than E4M3), in the forward and again in the backward: each rank its half
            saved = torch.load(whole / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)
            fp8_weights = sum(v.numel() for k, v in saved["model"].items() if k.startswith("blocks") and v.dim() == 2)
            gathered = [m["comm_bytes_by_kind"]["all_gather"] for m in metrics]
            assert gathered[3] - gathered[2] == fp8_weights and gathered[:3] == gathered[2:3] * 3
        else:
            # the first stage sends each micro-batch's activation (4 x 32 x n_embd): an FP8 carrier
            # (a byte per element and its scale), then BF16 as the bf16 level sends it
            n_embd = summary["model_config"]["n_embd"]
            numel = 4 * 32 * n_embd
            sent = [m["comm_bytes_by_kind"]["send"] for m in metrics]
            assert sent == [2 * (numel + 4)] * 3 + [2 * 2 * numel] * 3
    records = [json.loads(line) for line in (whole / "telemetry.jsonl").read_text().splitlines()]
    # every FP8 layer's weight gradient is judged, from whichever rank holds it or its shards
    blocks = {r["layer"] for r in records if r["layer"].startswith("blocks")}
    assert blocks and blocks == {r["layer"] for r in records if r["kind"] == "weight_grad"} & blocks
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    drop_last_checkpoint(resumed)
    check(train(ranks, resumed, cache, *flags, "--resume"))
    assert (resumed / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    assert (resumed / "telemetry.jsonl").read_bytes() == (whole / "telemetry.jsonl").read_bytes()


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def resumed_copy(whole, name: str):
    run = whole.parent / name
    shutil.copytree(whole, run)
    drop_last_checkpoint(run)
    return run


def check_close(resumed, whole, tolerance: float) -> str:
    """The resumed run's first step and final validation loss against the uninterrupted run's."""
    ours, theirs = metrics(resumed), metrics(whole)
    first = SAVE_EVERY  # the first resumed step's record
    assert ours[first]["train_loss"] == pytest.approx(theirs[first]["train_loss"], rel=tolerance)
    assert ours[-1]["val_loss"] == pytest.approx(theirs[-1]["val_loss"], rel=tolerance)
    return ours[-1]["val_loss"]


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    """An uninterrupted `--tp 2 --pp 2` run on 4 ranks."""
    work = tmp_path_factory.mktemp("reshard")
    whole = work / "tp2_pp2"
    check(train(4, whole, work / "cache", *TP2_PP2))
    return whole


def test_tp2_pp2_checkpoint_resumes_in_one_process(tp2_pp2, capsys):
    from fp8lm.cli import main

    run = resumed_copy(tp2_pp2, "one_process")
    argv = options(run, tp2_pp2.parent / "cache", "--resume")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "resharded: pp 2 x tp 2 on 4 rank(s) -> one process on 1 rank(s); each replica continues its batches" in out
    # the same batches from the same state: only the layouts' float sums differ
    check_close(run, tp2_pp2, 0.002)


def test_tp2_pp2_checkpoint_resumes_under_fsdp_on_2_ranks(tp2_pp2):
    run = resumed_copy(tp2_pp2, "fsdp2")
    proc = train(2, run, tp2_pp2.parent / "cache", "--fsdp", "--resume")
    assert "-> dp_shard 2 on 2 rank(s); new batch streams" in check(proc)
    assert metrics(run)[-1]["val_loss"] == pytest.approx(metrics(tp2_pp2)[-1]["val_loss"], rel=0.01)


def test_one_process_checkpoint_resumes_under_tp2(tmp_path, capsys):
    from fp8lm.cli import main

    whole, cache = tmp_path / "whole", tmp_path / "cache"
    assert main(options(whole, cache)) == 0
    run = resumed_copy(whole, "tp2")
    assert "one process on 1 rank(s) -> tp 2 on 2 rank(s)" in check(train(2, run, cache, "--tp", "2", "--resume"))
    check_close(run, whole, 0.002)


def test_fp8_zero_checkpoint_resumes_in_one_process_and_under_pp2(tmp_path, capsys):
    """O3's checkpoint (FP8 ZeRO shards over 2 ranks, the format of every layout) resumes in one
    process and as pipeline stages sharded by FP8 ZeRO: the same batches, the same state."""
    from fp8lm.cli import main

    whole, cache = tmp_path / "zero", tmp_path / "cache"
    check(train(2, whole, cache, "--opt-level", "O3"))
    one = resumed_copy(whole, "one_process")
    assert main(options(one, cache, "--opt-level", "O3", "--resume")) == 0
    assert "resharded: dp_shard 2 on 2 rank(s) -> one process on 1 rank(s)" in capsys.readouterr().out
    check_close(one, whole, 0.002)
    pp2 = resumed_copy(whole, "pp2")
    proc = train(4, pp2, cache, "--opt-level", "O3", "--pp", "2", "--pp-microbatches", "2", "--resume")
    assert "-> pp 2 x dp_shard 2 on 4 rank(s)" in check(proc)
    check_close(pp2, whole, 0.01)
    # its weights start another run (--init-from, a DPO reference, an export): read from the shards
    from fp8lm.train.checkpoint import checkpoint_weights, load_checkpoint

    final = whole / "checkpoints" / f"step_{STEPS:08d}.pt"
    state = load_checkpoint(final)
    assert state["model"] is None and state["optimizer"] is None  # all of it in the DCP folder
    one_process = torch.load(one / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)["model"]
    assert checkpoint_weights(state).keys() == one_process.keys()
    init = tmp_path / "init"
    argv = options(init, cache, "--init-from", str(final), "--steps", "1", "--eval-every", "1", "--save-every", "0")
    assert main(argv) == 0
    assert metrics(init)[-1]["val_loss"] == pytest.approx(metrics(whole)[-1]["val_loss"], rel=0.05)


def test_tp2_o3_checkpoint_resumes_in_one_process(tmp_path, capsys):
    """O3 under --tp 2 (FP8 ZeRO over the tensor-parallel parts, one scale per FP8 weight) against
    one process, and its checkpoint resumed there: the same batches, the same state."""
    from fp8lm.cli import main

    whole, cache = tmp_path / "tp2_o3", tmp_path / "cache"
    check(train(2, whole, cache, "--tp", "2", "--opt-level", "O3"))
    alone = tmp_path / "alone"
    assert main(options(alone, cache, "--opt-level", "O3")) == 0
    assert metrics(whole)[-1]["val_loss"] == pytest.approx(metrics(alone)[-1]["val_loss"], rel=0.002)
    one = resumed_copy(whole, "one_process")
    assert main(options(one, cache, "--opt-level", "O3", "--resume")) == 0
    assert "resharded: tp 2 on 2 rank(s) -> one process on 1 rank(s)" in capsys.readouterr().out
    check_close(one, whole, 0.002)


def test_tp2_pp2_trains_at_the_baseline_levels_too(tmp_path):
    """fp32 and bf16 (torch's own styles and plain stage boundaries) in the 3-D code path."""
    out = tmp_path / "cmp"
    argv = ["compare", "--levels", "fp32,bf16", *options(out, tmp_path / "cache")[3:], "--tp", "2", "--pp", "2"]
    argv += ["--pp-microbatches", "2", "--steps", "3", "--save-every", "0", "--telemetry-every", "0"]
    args = torchrun(4, "-m", "fp8lm.cli", *argv)
    check(subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=3 * TIMEOUT_S))
    for level in ("fp32", "bf16"):
        summary = json.loads((out / level / "summary.json").read_text())
        assert summary["layout"] == "pipeline parallel" and summary["world_size"] == 4
        assert summary["skipped_steps"] == 0 and summary["val_loss"] < 5.6  # from ln(256) = 5.55, learning


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    from dist_launch import run_workers

    results = run_workers("dist_layout_skipping.py", 4, str(tmp_path), timeout=300)
    for r in results:  # one clip over the model's ranks: the NaN reaches every rank's decision
        assert r["skipped"] == [0, 0, 1, 1] and r["unchanged"] is True


def test_each_replica_draws_its_own_rounding_noise(tmp_path):
    """Replicas that rounded their own batches' output gradients with the same stochastic-rounding
    noise would not average it away as one process averages its rows': after building the same
    model, each replica draws its own stream, the ranks of one replica one stream."""
    from dist_launch import run_workers

    results = run_workers("dist_replica_noise.py", 4, str(tmp_path), timeout=300)
    assert [r["dp_rank"] for r in results] == [0, 0, 1, 1]
    assert torch.equal(results[0]["weights"], results[2]["weights"])  # tp rank 0 of each replica
    assert torch.equal(results[0]["noise"], results[1]["noise"]) and torch.equal(
        results[2]["noise"], results[3]["noise"]
    )
    assert not torch.equal(results[0]["noise"], results[2]["noise"])
