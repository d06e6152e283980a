"""What the app prints: the data summary line, the progress without tqdm, no plots without
matplotlib (said once), telemetry lines that say whether a value matters, DPO named as DPO."""

import json
import sys

import pytest

from cli_helpers import run_main
from fp8lm.train import progress
from fp8lm.train.data import describe
from fp8lm.train.telemetry_report import telemetry_line


def _info(split, documents, val_documents):
    return {
        "source": "path:corpus",
        "split": split,
        "val_fraction": 0.05,
        "documents": documents,
        "val_documents": val_documents,
        "train_tokens": 950_000,
        "val_tokens": 50_000,
    }


def test_the_data_line_says_how_the_corpus_was_split():
    by_file = describe(_info("by-document", 300, 14))
    assert by_file.startswith("data: path:corpus: 300 file(s), 1.00 MB") and "14 file(s) held out" in by_file
    by_bytes = describe(_info("by-bytes", 15, 0))
    assert "split by bytes" in by_bytes and "no file held out" in by_bytes and "15 file(s) are too few" in by_bytes
    assert "train 950,000 / validation 50,000 tokens" in by_bytes
    assert by_file.startswith("data: path:corpus: 300 file(s), 1.00 MB, 1,000,000 tokens (bytes);")


def _record(layer, kind, underflow=0.0, saturation=0.0):
    return {"layer": layer, "kind": kind, "underflow": underflow, "saturation": saturation}


def test_telemetry_lines_judge_against_the_fallback_thresholds():
    normal = [_record("h", "grad_output", 0.01), _record("h", "input"), _record("lm_head", "exp_avg", 0.2955)]
    line = telemetry_line(normal, 5)
    assert line.startswith("step 5: FP8 telemetry normal, within the --fallback thresholds")
    assert "output-gradient underflow 1.00% (h; threshold 5.0%)" in line
    assert "optimizer-moment underflow 29.55% (lm_head exp_avg) is expected" in line
    over = telemetry_line([_record("h", "grad_output", 0.2), _record("w", "weight_grad", 0.5)], 7, "runs/my run")
    assert "over a --fallback threshold: output-gradient underflow of h, weight-gradient underflow of w" in over
    assert "train with --fallback" in over and "\n" not in over
    assert "fp8lm inspect 'runs/my run' shows them" in over  # the run's own folder, ready to paste


def test_progress_without_tqdm_is_plain_lines(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now fails
    monkeypatch.setattr(progress, "_said", set())
    bar = progress.bar(20, 0, "train O2", enabled=True)
    for _ in range(20):
        bar.update(1)
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "progress as plain lines: tqdm is not installed (pip install 'fp8lm[train]' installs it)"
    assert lines[1].startswith("train O2: 2/20 steps") and "ETA" in lines[1]
    assert lines[-1].startswith("train O2: 20/20 steps") and len(lines) == 11


def test_no_plots_without_matplotlib_said_once(monkeypatch, capsys, tmp_path):
    from fp8lm.train.report import plot_losses

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(progress, "_said", set())
    records = {"bf16": [{"step": 1, "tokens": 10, "train_loss": 5.0, "val_loss": 5.0}]}
    assert plot_losses(records, tmp_path / "a.png") is None and plot_losses(records, tmp_path / "b.png") is None
    out = capsys.readouterr().out
    assert out.count("no plots: matplotlib is not installed") == 1 and not list(tmp_path.iterdir())


def test_compare_without_tqdm_and_matplotlib_runs_and_says_so(
    monkeypatch, tmp_path, token_cache, email_corpus, tiny_cli_args, capsys
):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(progress, "_said", set())
    args = [a for a in tiny_cli_args if a != "--no-progress"]
    argv = ["compare", *args, "--levels", "bf16,fp32", "--steps", "4", "--data", email_corpus]
    rc, out, err = run_main([*argv, "--cache-dir", token_cache, "--out", str(tmp_path / "c")], capsys)
    assert rc == 0, err
    assert out.count("data: path:") == 1  # one data line for the comparison
    assert "train fp32: 8/8 steps" in out  # one progress across both runs, named by the one training
    assert "no plots" in out and "plot:" not in out
    assert "\nbf16: step 4: train loss" in out and "\nfp32: step 4: train loss" in out  # whose loss it is
    # resumed with bf16 finished: the progress counts what trains now, so its ETA is fp32's alone
    argv = [*argv, "--levels", "bf16,fp32,O1", "--resume"]
    rc, out, err = run_main([*argv, "--cache-dir", token_cache, "--out", str(tmp_path / "c")], capsys)
    assert rc == 0, err
    assert "train O1: 4/4 steps" in out and "/8 steps" not in out and "/12 steps" not in out


def test_one_progress_line_across_runs_names_them_and_counts_what_trains(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(progress, "_said", {"tqdm"})
    with progress.overall(30, 0, "compare (3 runs)", enabled=True):
        progress.skipped(10)  # a run finished before: nothing of it left to train
        with progress.naming("O2 seed 1"):
            assert progress.run_name() == "O2 seed 1"
            bar = progress.bar(10, 6, f"train {progress.run_name()}", enabled=True)  # resumes at step 6
            for _ in range(4):
                bar.update(1)
            progress.say("step 10: train loss 1.0000, val loss 1.0000")
        assert progress.run_name() is None
        progress.bar(10, 0, "train bf16", enabled=True).update(10)
    lines = capsys.readouterr().out.splitlines()
    assert "O2 seed 1: step 10: train loss 1.0000, val loss 1.0000" in lines
    assert lines[-1].startswith("train bf16: 14/14 steps")  # 30 - 10 finished - 6 done before


@pytest.mark.slow
def test_dpo_is_named_dpo_and_inspect_understands_it(tmp_path, token_cache, email_corpus, tiny_cli_args, capsys):
    pre = tmp_path / "pre"
    argv = ["train", *tiny_cli_args, "--data", email_corpus, "--steps", "2", "--out", str(pre)]
    assert run_main(argv, capsys)[0] == 0
    run = tmp_path / "dpo"
    argv = ["dpo", "--init-from", str(pre), "--steps", "2", "--batch-size", "4", "--eval-every", "2"]
    rc, out, err = run_main([*argv, "--out", str(run), "--no-progress"], capsys)
    assert rc == 0, err
    assert "step 2: DPO loss" in out and "held-out DPO loss" in out and "train loss" not in out
    assert "preference pairs built from the starting run's corpus (path:" in out
    assert f"tokens read from {pre / 'cache'}" in out
    assert not (run / "cache").exists()  # the pretraining run's packed tokens, not a copy
    rc, _, err = run_main(["inspect", str(run)], capsys)
    assert rc == 2 and "is an fp8lm dpo run: DPO records no FP8 telemetry" in err
    assert f"(--init-from {pre}: fp8lm inspect {pre})" in err  # the run to inspect instead


def test_inspect_of_a_dpo_run_names_the_run_it_started_from(tmp_path):
    from fp8lm.train.telemetry_report import InspectError, read_telemetry

    run = tmp_path / "dpo"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "reference.pt").write_bytes(b"")
    with pytest.raises(InspectError, match=r"\(its --init-from\)"):  # no summary yet: no name
        read_telemetry(run)
    (run / "summary.json").write_text(json.dumps({"config": {"init_from": "runs/pre/checkpoints/step_00000020.pt"}}))
    with pytest.raises(
        InspectError, match=r"--init-from runs/pre/checkpoints/step_00000020.pt: fp8lm inspect runs/pre\)"
    ):
        read_telemetry(run)


def test_dpo_pairs_say_which_corpus_they_come_from():
    from fp8lm.train.dpo import _data_line, _pretraining_corpus

    state = {"path": "runs/pre/checkpoints/step_00000002.pt", "options": {"data": "corpus", "val_fraction": 0.1}}
    corpus = _pretraining_corpus(state)
    assert corpus is not None and corpus["data"] == "corpus" and corpus["val_fraction"] == 0.1
    # a run trained on a Hugging Face dataset: not reused, the pairs come from the default corpus
    assert _pretraining_corpus({**state, "options": {"data": None, "hf_dataset": "wikitext"}}) is None
    info = {"source": "builtin:stdlib:lib", "prompt_bytes": 64, "answer_bytes": 32, "tokens_from": "runs/dpo/cache"}
    line = _data_line(8192, 1024, {**info, "from": "the default corpus"})
    assert line.startswith("data: 8,192 training and 1,024 held-out preference pairs built from the default corpus")
    assert "(stdlib:lib): a 64-byte prompt, its true next 32 bytes chosen" in line
    assert _data_line(10, 2, {"source": "jsonl:pairs.jsonl"}) == (
        "data: 10 training and 2 held-out preference pairs, jsonl:pairs.jsonl"
    )
