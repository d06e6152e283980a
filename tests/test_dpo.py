"""`fp8lm dpo`: the run, its files, a bit-for-bit resume, and refusals of bad input."""

import json
import os
import random
import shutil
import subprocess

import pytest
import torch

from cli_helpers import run_main
from dist_launch import forked_ranks
from fp8lm.train.dpo import SUMMARY_KEYS
from fp8lm.train.model import GPT, preset
from fp8lm.train.preference import PairSampler, read_pairs, split_pairs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny GPT checkpoint and 48 arithmetic preference pairs."""
    root = tmp_path_factory.mktemp("dpo")
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    torch.save({"model": model.state_dict(), "model_config": model.config.to_dict()}, root / "init.pt")
    rng = random.Random(0)
    lines = []
    for _ in range(48):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        lines.append(
            json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + rng.randint(1, 9))})
        )
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def dpo_args(inputs, out, *extra):
    return [
        "dpo",
        "--init-from",
        str(inputs / "init.pt"),
        "--data",
        str(inputs / "pairs.jsonl"),
        "--out",
        str(out),
        "--batch-size",
        "4",
        "--no-progress",
        *extra,
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "1+1=", "chosen": "2"}', "pairs.jsonl:3: no 'rejected' key"),
        ("not json", "pairs.jsonl:3: not valid JSON"),
    ],
)
def test_bad_pairs_file_is_one_line_exit_2_and_no_output(inputs, tmp_path, capsys, line, message):
    good = (inputs / "pairs.jsonl").read_text().splitlines()[:2]
    bad = tmp_path / "pairs.jsonl"
    bad.write_text("\n".join([*good, line, *good]) + "\n")
    argv = dpo_args(inputs, tmp_path / "out", "--steps", "2")
    argv[argv.index("--data") + 1] = str(bad)
    rc, out, err = run_main(argv, capsys)
    assert rc == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "summary.json").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_refusals(inputs, tmp_path, capsys):
    rc, _, err = run_main(["dpo", "--out", str(tmp_path / "o"), "--steps", "2"], capsys)
    assert rc == 2 and "pass --init-from CHECKPOINT" in err
    rc, _, err = run_main(dpo_args(inputs, tmp_path / "o", "--beta", "0"), capsys)
    assert rc == 2 and "--beta must be > 0" in err
    rc, _, err = run_main(["dpo", "--init-from", str(tmp_path / "none.pt"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "does not exist" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_run_files_and_bit_for_bit_resume(inputs, tmp_path, capsys):
    whole = tmp_path / "whole"
    rc, out, err = run_main(
        dpo_args(
            inputs, whole, "--steps", "6", "--save-every", "3", "--eval-every", "3", "--opt-level", "O2", "--lr", "1e-3"
        ),
        capsys,
    )
    assert rc == 0, err
    summary = json.loads((whole / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary) and summary["steps"] == 6
    assert summary["pairs"]["train"] + summary["pairs"]["held_out"] == 48
    assert 5.5 < summary["policy_bytes_per_param"] < 7  # FP16 weights, FP8 grads, FP8AdamW states
    assert 1.0 < summary["reference_bytes_per_param"] < 1.1  # E4M3, norms and biases in FP32
    assert 0 <= summary["reward_accuracy"] <= 1 and summary["kl_to_reference"] > 0
    records = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and "val_reward_accuracy" in records[2]

    # stop after step 3: the step-3 checkpoint and the metrics up to it, then resume
    part = tmp_path / "part"
    shutil.copytree(whole, part)
    (part / "summary.json").unlink()
    for p in (part / "checkpoints").glob("step_00000006*"):
        p.unlink()
    rc, _, err = run_main(
        dpo_args(
            inputs, part, "--steps", "6", "--save-every", "3", "--eval-every", "3", "--opt-level", "O2", "--lr", "1e-3"
        ),
        capsys,
    )
    assert rc == 2 and "already holds a training run" in err
    argv = dpo_args(
        inputs,
        part,
        "--steps",
        "6",
        "--save-every",
        "3",
        "--eval-every",
        "3",
        "--opt-level",
        "O2",
        "--lr",
        "1e-3",
        "--resume",
    )
    argv[argv.index("--init-from") : argv.index("--init-from") + 2] = []  # the checkpoint holds the reference
    rc, _, err = run_main(argv, capsys)
    assert rc == 0, err
    assert (part / "metrics.jsonl").read_text() == (whole / "metrics.jsonl").read_text()
    rc, _, err = run_main([*argv, "--beta", "0.2"], capsys)
    assert rc == 2 and "was trained with --beta 0.1, this command has --beta 0.2" in err
    rc, _, err = run_main([*argv, "--steps", "5"], capsys)
    assert rc == 2 and "already reached step 6" in err

    # killed after the final checkpoint, before summary.json: --resume only writes the summary
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["tokens"] == summary["tokens"]
    (part / "summary.json").unlink()
    rc, _, err = run_main(argv, capsys)
    assert rc == 0, err
    finished = json.loads((part / "summary.json").read_text())
    for key in ("tokens", "tokens_per_s", "dpo_loss", "reward_accuracy", "policy_bytes_per_param"):
        assert finished[key] == resumed[key], key


def test_tokens_are_the_positions_of_the_batches_drawn(inputs, tmp_path, capsys):
    rc, _, err = run_main(dpo_args(inputs, tmp_path / "o", "--steps", "3", "--opt-level", "bf16"), capsys)
    assert rc == 0, err
    # the same batches: the run's training pairs and sampler seed; answers differ in length
    train, _ = split_pairs(read_pairs(inputs / "pairs.jsonl"), 0.05)
    sampler = PairSampler(train, 4, seed=1337, block_size=preset("tiny").block_size)
    widths = [sampler.next().inputs.shape[1] for _ in range(3)]
    records = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records] == [8 * sum(widths[:n]) for n in (1, 2, 3)]
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["tokens"] == 8 * sum(widths)


@pytest.mark.slow
def test_bf16_level_learns_the_pairs(inputs, tmp_path, capsys):
    out = tmp_path / "bf16"
    rc, _, err = run_main(
        dpo_args(inputs, out, "--steps", "30", "--opt-level", "bf16", "--lr", "1e-2", "--eval-every", "30"), capsys
    )
    assert rc == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reference_bytes_per_param"] == pytest.approx(2.0)  # a BF16 copy
    assert summary["policy_bytes_per_param"] == pytest.approx(16.0, abs=0.1)  # FP32 weights, grads, two moments
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0]["dpo_loss"], sum(r["dpo_loss"] for r in records[-5:]) / 5
    assert first == pytest.approx(0.6931, abs=1e-3) and last < first - 0.05  # policy = reference at the start


def torchrun_dpo(inputs, out, level, *extra):
    """``fp8lm dpo`` on 2 gloo ranks (one thread each, eager: comparable bit for bit)."""
    argv = forked_ranks(2, "-m", "fp8lm.cli")
    argv += dpo_args(inputs, out, "--steps", "4", "--save-every", "2", "--eval-every", "2", "--opt-level", level)
    if "--resume" in extra:  # the checkpoint holds the reference
        argv.remove("--init-from")
        argv.remove(str(inputs / "init.pt"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([*argv, *extra], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_torchrun_two_ranks_and_bit_for_bit_resume(inputs, tmp_path, level):
    whole = tmp_path / "whole"
    torchrun_dpo(inputs, whole, level)
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["world_size"] == 2 and set(SUMMARY_KEYS) <= set(summary)
    assert 1.0 < summary["reference_bytes_per_param"] < 1.1  # every rank holds the E4M3 reference
    records = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert all(r["comm_bytes"] > 0 for r in records)  # the policy's FP8 gradients crossed ranks
    assert records[-1]["tokens"] == summary["tokens"]
    if level == "O3":
        return
    part = tmp_path / "part"
    shutil.copytree(whole, part)
    (part / "summary.json").unlink()
    for p in (part / "checkpoints").glob("step_00000004*"):  # the .pt file and the .dcp folder of its shards
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    torchrun_dpo(inputs, part, level, "--resume")
    assert (part / "metrics.jsonl").read_text() == (whole / "metrics.jsonl").read_text()
    assert json.loads((part / "summary.json").read_text())["tokens"] == summary["tokens"]
