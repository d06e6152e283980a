"""`fp8lm compare --tp 2` and `--pp 2` on 2 gloo ranks and `--tp 2 --fsdp` on 4: bf16 (torch's
styles, BF16 activations on the wire) and O1 (FP8 on every wire) against the same comparison in
one process; the bytes each summary reports are the counted ones, by kind; and what --tp / --pp
cannot do is refused in one line."""

import json
import subprocess

import pytest

from cli_helpers import run_main
from dist_launch import forked_ranks
from fp8lm.cli import main
from fp8lm.train.config import RunError, TrainConfig
from fp8lm.train.ranks import join
from test_train_distributed import EMAIL, ENV, TIMEOUT_S, check

STEPS = 4
BATCH, SEQ = 8, 32
MICRO_BATCHES = 4  # --pp-microbatches' default


def options(out, cache, *extra: str, levels: str = "bf16,O1") -> list[str]:
    return [
        "--levels",
        levels,
        "--model",
        "tiny",
        "--batch-size",
        str(BATCH),
        "--seq-len",
        str(SEQ),
        "--steps",
        str(STEPS),
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
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


def torchrun(ranks: int, *args: str) -> list[str]:
    """``ranks`` ranks of ``args`` with torchrun's environment (forked from one process: see
    tests/rank_launcher.py); the tests of torchrun itself are in tests/test_train_distributed.py."""
    return forked_ranks(ranks, *args)


def summaries(out) -> dict:
    return {path.parent.name: json.loads(path.read_text()) for path in sorted(out.glob("*/summary.json"))}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("level3_train")


@pytest.fixture(scope="module")
def single(work):
    out = work / "single"
    assert main(["compare", *options(out, work / "cache")]) == 0
    return summaries(out)


def distributed(work, name: str, ranks: int, *flags: str, levels: str = "bf16,O1") -> dict:
    out = work / name
    args = ["-m", "fp8lm.cli", "compare", *options(out, work / "cache", *flags, levels=levels)]
    check(subprocess.run(torchrun(ranks, *args), env=ENV, capture_output=True, text=True, timeout=3 * TIMEOUT_S))
    return summaries(out)


def check_counted_bytes(summary: dict, out_level) -> None:
    """The summary's bytes are the mean of the steps' counted ones, and the kinds add up to them."""
    records = [json.loads(line) for line in (out_level / "metrics.jsonl").read_text().splitlines()]
    assert summary["comm_bytes_per_step"] == sum(r["comm_bytes"] for r in records) / STEPS
    assert summary["comm_bytes_per_step"] == pytest.approx(sum(summary["comm_bytes_by_kind_per_step"].values()))
    assert summary["comm_handed_bytes_per_step"] > 0


def check_val_loss_matches_one_process(runs: dict, single: dict, tolerance: float) -> None:
    for level in ("bf16", "O1"):  # the levels of the one-process comparison
        gap = abs(runs[level]["val_loss"] / single[level]["val_loss"] - 1)
        assert gap < tolerance, (level, runs[level]["val_loss"], single[level]["val_loss"])


@pytest.mark.slow
def test_tp2_losses_match_one_process_and_fp8_halves_the_bytes(work, single):
    runs = distributed(work, "tp", 2, "--tp", "2")
    # dp 1: the same batches as one process; only the wire formats differ
    check_val_loss_matches_one_process(runs, single, 0.002)
    for level, s in runs.items():
        assert s["world_size"] == 2 and s["num_params"] == single[level]["num_params"]
        check_counted_bytes(s, work / "tp" / level)
    bf16, o1 = (runs[level]["comm_bytes_by_kind_per_step"] for level in ("bf16", "O1"))
    # bf16: torch's all-gathers and reduce-scatters (BF16) and loss_parallel's reductions; O1: FP8
    # all-gathers, FP8 reductions (all-to-all of per-chunk payloads) and the agreed amaxes
    assert set(bf16) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert set(o1) == {"all_gather", "all_to_all", "all_reduce"}
    assert runs["O1"]["comm_bytes_per_step"] <= 0.55 * runs["bf16"]["comm_bytes_per_step"]


@pytest.mark.slow
def test_pp2_sends_one_carrier_per_micro_batch(work, single):
    runs = distributed(work, "pp", 2, "--pp", "2")
    check_val_loss_matches_one_process(runs, single, 0.002)
    activation = BATCH // MICRO_BATCHES * SEQ * 32  # elements of one micro-batch's boundary (n_embd 32)
    for level, s in runs.items():
        check_counted_bytes(s, work / "pp" / level)
    # rank 0 (stage 0) sends the activations: BF16, or E4M3 with a 4-byte scale, and receives their
    # gradients (counted as calls, 0 bytes); besides, its half of the loss broadcast and of the
    # global norm's all-reduce (4 bytes each)
    wire = {"bf16": 2 * activation, "O1": activation + 4}
    for level, s in runs.items():
        assert s["comm_bytes_by_kind_per_step"] == {
            "send": MICRO_BATCHES * wire[level],
            "recv": 0.0,
            "broadcast": 2.0,
            "all_reduce": 4.0,
        }


@pytest.mark.slow
def test_tp2_with_fsdp_on_4_ranks_is_2d(work, single):
    runs = distributed(work, "tp_fsdp", 4, "--tp", "2", "--fsdp", levels="bf16,O1,O2")
    for level, s in runs.items():
        assert s["world_size"] == 4 and s["config"]["fsdp"] and s["config"]["tp"] == 2
        check_counted_bytes(s, work / "tp_fsdp" / level)
    # bf16: FSDP2's BF16 all-gathers and reduce-scatters over dp, torch's TP collectives over tp;
    # O1 and O2: FP8 gradient reductions (all-to-all of per-chunk payloads), the FP8 GEMMs' weights
    # all-gathered in E4M3 (O2's scaled FP16 and O1's FP32 alike)
    assert set(runs["bf16"]["comm_bytes_by_kind_per_step"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    for level in ("O1", "O2"):
        assert set(runs[level]["comm_bytes_by_kind_per_step"]) == {"all_gather", "all_to_all", "all_reduce"}
    # The tiny model's embeddings, output head and norms (43 % of it) stay 2 bytes on the wire at
    # O2: 0.57x measured here, against 0.5x for the FP8 GEMMs' weights and gradients alone. O1
    # gathers them in FP32 (4 bytes): 0.64x here (its FP32 weights gathered in FP32: 0.90x).
    bf16 = runs["bf16"]["comm_bytes_per_step"]
    assert runs["O2"]["comm_bytes_per_step"] < 0.65 * bf16
    assert runs["O2"]["comm_bytes_per_step"] < runs["O1"]["comm_bytes_per_step"] < 0.7 * bf16
    # dp 2: other batches than one process's, from the same weights
    check_val_loss_matches_one_process(runs, single, 0.01)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pp": 2, "grad_accum": 2}, "--pp splits each step into --pp-microbatches itself: drop --grad-accum"),
        ({"tp": 2, "opt_level": "O1", "grad_sync_scaling": "shared"}, "--grad-sync-scaling .* --tp 2 replaces"),
        ({"tp": 0}, "--tp must be >= 1, got 0"),
        ({"pp": 2, "pp_microbatches": 0}, "--pp-microbatches must be >= 1, got 0"),
        ({"pp": 4}, "--pp 4 needs a layer count divisible by it, got 2"),
        ({"tp": 4}, r"--tp 4 shards --n-head \(2\), which it does not divide"),
        ({"tp": 2, "seq_len": 33}, r"--tp 2 shards --seq-len \(33\)"),
    ],
)
def test_what_tp_and_pp_cannot_do_is_refused(fields, message):
    with pytest.raises(RunError, match=message):
        TrainConfig(model="tiny", **fields).validate()


def test_tp_and_pp_within_their_limits_are_accepted():
    for fields in (
        {"tp": 2},
        {"pp": 2},
        {"tp": 2, "fsdp": True, "opt_level": "O2"},
        {"pp": 2, "opt_level": "O1"},
        {"pp": 2, "fsdp": True, "opt_level": "O2"},
        {"tp": 2, "opt_level": "O3"},
        {"tp": 2, "pp": 2, "opt_level": "O3"},
        {"tp": 2, "save_every": 2, "opt_level": "O2"},
        {"pp": 2, "resume": True},
        {"tp": 2, "pp": 2, "fsdp": True, "opt_level": "O2"},
        {"pp": 2, "opt_level": "O3"},
        {"tp": 2, "opt_level": "O1", "fallback": True},
    ):
        TrainConfig(model="tiny", **fields).validate()


def test_tp_without_torchrun_is_one_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc, _, err = run_main(["train", "--model", "tiny", "--tp", "2", "--out", str(tmp_path / "r")], capsys)
    assert rc == 2
    assert err.strip().splitlines() == [
        "fp8lm train: error: --tp 2 --pp 1 split the model over torchrun's ranks: launch with torchrun "
        "--nproc-per-node N (a multiple of 2), or drop --tp/--pp"
    ]


def test_a_world_size_that_tp_x_pp_does_not_divide_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setattr("fp8lm.train.ranks.setup", lambda timeout_s: (0, 6))
    with pytest.raises(RunError, match=r"6 ranks cannot be split into model replicas of --tp 2 x --pp 2 = 4 ranks"):
        join(2, 2)
    ranks = join(2, 1)
    assert (ranks.dp, ranks.dp_rank, ranks.tp) == (3, 0, 2)


def test_compare_takes_the_parallel_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["compare", "--model", "tiny", "--pp", "2", "--pp-microbatches", "2", "--out", str(tmp_path / "c")]
    rc, _, err = run_main(argv, capsys)
    assert rc == 2
    assert "--tp 1 --pp 2 split the model over torchrun's ranks" in err
