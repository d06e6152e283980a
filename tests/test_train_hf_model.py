"""``--model PATH`` (`fp8lm.train.hf_model`): folders made here from ``transformers.LlamaConfig``
and ``GPT2Config`` train through the same loop (FP8 layers, telemetry), resume bit for bit, compare,
start from safetensors weights and a tokenizer.json, go through dpo and export; what cannot work is
refused in one line."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from cli_helpers import run_main  # noqa: E402
from fp8lm.nn import FP8Linear  # noqa: E402
from fp8lm.train import hf_model  # noqa: E402
from fp8lm.train.compare import compare  # noqa: E402
from fp8lm.train.config import DPOConfig, RunError, TrainConfig  # noqa: E402
from fp8lm.train.dpo import dpo  # noqa: E402
from fp8lm.train.loop import train  # noqa: E402
from fp8lm.train.run import TrainingRun  # noqa: E402
from fp8lm.train.tokenizer import train_bpe  # noqa: E402

RUN = dict(batch_size=4, seq_len=32, eval_every=3, eval_batches=2, progress=False, lr=1e-2)


def llama_config(**kw):
    sizes = dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2)
    sizes |= dict(num_key_value_heads=1, max_position_embeddings=64, vocab_size=256)
    return transformers.LlamaConfig(**{**sizes, "bos_token_id": None, "eos_token_id": None, **kw})


def gpt2_config(**kw):
    # 250 ids: padded to 256 by the run; a head tied to the embedding (GPT-2's default)
    sizes = dict(vocab_size=250, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2Config(**{**sizes, "bos_token_id": None, "eos_token_id": None, **kw})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    llama_config().save_pretrained(root / "llama")
    gpt2_config().save_pretrained(root / "gpt2")
    return root


def run_cfg(tmp_path, email_corpus, token_cache, model, **kw):
    return TrainConfig(
        **{
            **RUN,
            "model": str(model),
            "data": email_corpus,
            "cache_dir": token_cache,
            "out": str(tmp_path / "run"),
            **kw,
        }
    )


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_folder_trains_at_o2_with_every_linear_layer_in_fp8(folders, tmp_path, email_corpus, token_cache, kind):
    cfg = run_cfg(tmp_path, email_corpus, token_cache, folders / kind, opt_level="O2", steps=4, telemetry_every=2)
    run = TrainingRun(cfg)
    hf = run.core.hf
    assert type(hf).__name__ == ("LlamaForCausalLM" if kind == "llama" else "GPT2LMHeadModel")
    assert run.model_config.vocab_size == 256 and hf.get_input_embeddings().weight.shape[0] == 256
    assert not [m for m in run.core.modules() if type(m) is torch.nn.Linear or type(m).__name__ == "Conv1D"]
    assert len(run.core.blocks) == 2  # the decoder layers: what FSDP2 wraps one by one
    summary = run.fit()
    assert math.isfinite(summary["val_loss"]) and summary["model_config"]["hf_config"]["model_type"] == kind
    layers = {json.loads(line)["layer"] for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()}
    assert any(".layers.0." in name or ".h.0." in name for name in layers)  # telemetry of the HF layers
    per_layer = 7 if kind == "llama" else 4  # q, k, v, o, gate, up, down; GPT-2: c_attn, c_proj, c_fc, c_proj
    assert sum(isinstance(m, FP8Linear) for m in run.core.modules()) == 2 * per_layer + 1  # and the head


def test_resume_continues_bit_for_bit(folders, tmp_path, email_corpus, token_cache):
    kw = dict(opt_level="O2", steps=6, save_every=3, keep_checkpoints=3)
    whole = train(run_cfg(tmp_path, email_corpus, token_cache, folders / "llama", **kw))
    out, resumed_out = tmp_path / "run", tmp_path / "resumed"
    shutil.copytree(out, resumed_out)
    (resumed_out / "summary.json").unlink()
    (resumed_out / "checkpoints" / "step_00000006.pt").unlink()
    resumed = train(
        run_cfg(tmp_path, email_corpus, token_cache, folders / "llama", **kw, out=str(resumed_out), resume=True)
    )
    assert (resumed_out / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()
    assert resumed["val_loss"] == whole["val_loss"]


def test_compare_runs_the_levels_on_a_folder(folders, tmp_path, email_corpus, token_cache):
    cfg = run_cfg(tmp_path, email_corpus, token_cache, folders / "gpt2", steps=2, out=str(tmp_path / "cmp"))
    result = compare(cfg, ["bf16", "O2"])
    assert set(result["levels"]) == {"bf16", "O2"} and result["model_config"]["hf_config"]["model_type"] == "gpt2"
    assert all(math.isfinite(row["val_loss"]) for row in result["levels"].values())


def test_safetensors_weights_and_tokenizer_json_are_the_start(tmp_path, email_corpus, token_cache):
    folder = tmp_path / "pretrained"
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(llama_config(vocab_size=300))  # padded to 304 by the run
    model.save_pretrained(folder)
    text = open(os.path.join(email_corpus, "message.py"), "rb").read()
    tok = train_bpe(np.frombuffer(text, dtype=np.uint8), 300)
    (folder / "tokenizer.json").write_text(tok.json)
    cfg = run_cfg(tmp_path, email_corpus, token_cache, folder, opt_level="fp32", steps=1)
    run = TrainingRun(cfg)
    assert run.tokenizer.json == tok.json and run.model_config.vocab_size == 304
    ours = run.core.hf.state_dict()
    for name, value in model.state_dict().items():
        if "embed_tokens" in name or "lm_head" in name:  # padded rows appended
            assert torch.equal(ours[name][:300], value), name
        else:
            assert torch.equal(ours[name], value), name
    run.fit()
    assert (tmp_path / "run" / "tokenizer.json").read_text() == tok.json


def test_refusals_are_one_line(folders, tmp_path, email_corpus, token_cache, monkeypatch):
    def refused(model, **kw):
        with pytest.raises(RunError) as info:
            run_cfg(tmp_path, email_corpus, token_cache, model, steps=1, **kw).validate()
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "neither a size preset" in refused(tmp_path / "nowhere")
    assert "takes its architecture and sizes from its config.json: drop --n-layer" in refused(
        folders / "llama", n_layer=4
    )
    assert "drop --arch" in refused(folders / "llama", arch="llama")
    assert "--pp splits --model folders of model_type llama, mistral, qwen2, qwen3" in refused(folders / "gpt2", pp=2)
    assert "--pp 4 splits the 2 decoder layers of --model" in refused(folders / "llama", pp=4)
    llama_config(tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    assert "(tie_word_embeddings): set it false" in refused(tmp_path / "tied", pp=2)
    assert "--tp 2 splits the key/value heads of --model (1)" in refused(folders / "llama", tp=2)
    assert "model_type 'gpt2' declares none" in refused(folders / "gpt2", tp=2)
    assert "exceeds the 64 positions" in refused(folders / "llama", seq_len=128)
    assert "does not fit the vocabulary" in refused(folders / "llama", tokenizer="bpe")  # 8192 ids > 256
    pickled = tmp_path / "pickled"
    llama_config().save_pretrained(pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    assert "as pickles (pytorch_model.bin), which can run code" in refused(pickled)
    for name, config in [
        ("remote", {**llama_config().to_dict(), "auto_map": {"AutoModelForCausalLM": "x.Model"}}),
        ("vision", transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).to_dict()),
        ("untyped", {"hidden_size": 32}),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert "names custom code ('auto_map')" in refused(tmp_path / "remote")
    assert "not a causal language model" in refused(tmp_path / "vision")
    assert "has no 'model_type'" in refused(tmp_path / "untyped")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    assert "cannot be read as JSON" in refused(tmp_path / "broken")
    monkeypatch.setattr(hf_model.importlib.util, "find_spec", lambda name: None)
    assert "needs Hugging Face transformers: pip install 'fp8lm[hf]'" in refused(folders / "llama")


def test_cli_refusal_exits_2_with_one_line(folders, tmp_path, tiny_cli_args, capsys):
    argv = ["train", *tiny_cli_args[2:], "--model", str(folders / "gpt2"), "--n-embd", "64", "--out", str(tmp_path)]
    rc, _, err = run_main(argv, capsys)
    assert rc == 2 and "drop --n-embd" in err and err.count("\n") == 1


@pytest.mark.slow  # pretraining, DPO and an export
def test_dpo_and_export_of_a_folder_run(folders, tmp_path, email_corpus, token_cache, monkeypatch):
    from fp8lm.train import dpo as dpo_module
    from fp8lm.train.export import export_run, read_run_checkpoint, run_autocast, run_model

    train(run_cfg(tmp_path, email_corpus, token_cache, folders / "llama", opt_level="bf16", steps=2))
    monkeypatch.setattr(dpo_module, "BUILTIN_HELD_OUT_PAIRS", 16)
    summary = dpo(
        DPOConfig(init_from=str(tmp_path / "run"), out=str(tmp_path / "dpo"), steps=2, batch_size=4, progress=False)
    )
    assert math.isfinite(summary["dpo_loss"]) and summary["model_config"]["hf_config"]["model_type"] == "llama"
    out = export_run(tmp_path / "run", tmp_path / "exported")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    state = read_run_checkpoint(tmp_path / "run")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), run_autocast(state):
        ours = run_model(state)(ids)[0].float()
    theirs = exported(ids).logits.float()
    assert torch.allclose(ours, theirs, atol=0.05)  # BF16 export of the run's FP32 weights


@pytest.mark.slow  # two ranks
@pytest.mark.parametrize(
    "layout, options",
    [
        ("FSDP2", ["--fsdp", "--opt-level", "O2"]),
        ("FP8 ZeRO", ["--opt-level", "O3"]),
        ("data parallel", ["--opt-level", "O2"]),
    ],
)
def test_two_ranks_train_a_folder(folders, tmp_path, email_corpus, layout, options):
    from dist_launch import forked_ranks

    args = ["--model", str(folders / "llama"), *options, "--steps", "4", "--batch-size", "8", "--seq-len", "32"]
    args += ["--eval-batches", "2", "--data", email_corpus, "--out", str(tmp_path / "run")]
    command = forked_ranks(2, "-m", "fp8lm.cli", "train", *args, "--no-progress")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["layout"] == layout and math.isfinite(summary["val_loss"])


def folder_run(tmp_path, email_corpus, folder, out, *options, ranks=2):
    """6 steps of ``tmp_path / folder`` on ``ranks`` forked gloo ranks (checkpoints at 3 and 6); its metrics."""
    from dist_launch import forked_ranks

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    args = ["--model", str(tmp_path / folder), "--steps", "6", "--batch-size", "8", "--seq-len", "32"]
    args += ["--eval-every", "3", "--eval-batches", "2", "--save-every", "3", "--data", email_corpus]
    args += ["--cache-dir", str(tmp_path / "cache"), "--telemetry-every", "0", "--out", str(tmp_path / out)]
    launch = (
        forked_ranks(ranks, "-m", "fp8lm.cli", "train") if ranks > 1 else [sys.executable, "-m", "fp8lm.cli", "train"]
    )
    done = subprocess.run(
        [*launch, *args, *options, "--no-progress"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]


def resume_last_checkpoint(tmp_path, email_corpus, out, *options, ranks=2) -> bytes:
    """``out`` resumed from its step-3 checkpoint to step 6 (in a copy); the copy's metrics' bytes."""
    resumed = tmp_path / f"{out}_resumed"
    shutil.copytree(tmp_path / out, resumed)
    (resumed / "summary.json").unlink()
    for p in (resumed / "checkpoints").glob("step_00000006*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    folder_run(tmp_path, email_corpus, "llama", resumed.name, *options, "--resume", ranks=ranks)
    return (resumed / "metrics.jsonl").read_bytes()


def test_the_tp_plan_sums_a_shared_inputs_gradient_once(folders):
    """q, k and v (gate and up) read one input: its gradient is summed over the ranks once, at the
    attention layer (the MLP), not by each projection; not where the module holds other weights."""
    from fp8lm.distributed.tensor_parallel import SharedReplicatedInput
    from fp8lm.train.hf_model import HFCausalLM, folder_model_config
    from fp8lm.train.hf_parallel import declared_plan, hf_tensor_parallel_plan, shared_inputs

    model = HFCausalLM(folder_model_config(str(folders / "llama")), str(folders / "llama"))
    declared = declared_plan(model.hf.config)
    assert shared_inputs(model, declared) == ["layers.*.self_attn", "layers.*.mlp"]
    plan = hf_tensor_parallel_plan(model, fp8=True)
    assert isinstance(plan["hf.model.layers.*.self_attn"], SharedReplicatedInput) and plan["hf.model.layers.*.mlp"].fp8
    without_o = {k: v for k, v in declared.items() if not k.endswith("o_proj")}  # o_proj would meet a DTensor
    assert shared_inputs(model, without_o) == ["layers.*.mlp"]
    # a replicated module with summed gradients is split as a norm over each head's features
    model.hf.config.base_model_tp_plan = {**declared, "layers.*.input_layernorm": "replicated_with_grad_allreduce"}
    with pytest.raises(ValueError, match=r"as a norm over each head's 16 features, but its weights are \[\(32,\)\]"):
        hf_tensor_parallel_plan(model, fp8=True)


@pytest.mark.slow  # two ranks
def test_tp2_splits_a_folder_by_its_declared_plan_and_trains_as_one_process(tmp_path, email_corpus):
    """--tp 2 on llama folders: q/k/v/gate/up column-wise, o/down row-wise (the plan transformers
    declares, base_model_tp_plan), the head vocabulary-sharded, or whole when tied to the embedding;
    and on a qwen3 folder, whose per-head q and k norms keep whole weights with summed gradients.
    At fp32 every step is one process's (loss, gradient norm, validation); at O2 (FP8 all-reduces)
    within 1 % of one process, and a resumed run continues byte for byte."""
    for name, tie in (("llama", False), ("llama_tied", True)):  # 2 key/value heads: --tp 2 divides them
        llama_config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie).save_pretrained(
            tmp_path / name
        )
    sizes = dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, head_dim=8)
    sizes |= dict(num_key_value_heads=2, max_position_embeddings=64, vocab_size=256, tie_word_embeddings=False)
    transformers.Qwen3Config(**sizes, bos_token_id=None, eos_token_id=None).save_pretrained(tmp_path / "qwen3")

    def run(folder, out, *options, ranks=2):
        return folder_run(tmp_path, email_corpus, folder, out, *options, ranks=ranks)

    for folder in ("llama", "llama_tied", "qwen3"):
        one = run(folder, f"{folder}_one", "--opt-level", "fp32", ranks=1)
        tp2 = run(folder, f"{folder}_tp2", "--opt-level", "fp32", "--tp", "2")
        for a, b in zip(one, tp2, strict=True):
            for key in ("train_loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (folder, a["step"], key)
        assert tp2[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], rel=1e-5)
    one = run("llama", "o2_one", "--opt-level", "O2", ranks=1)
    tp2 = run("llama", "o2_tp2", "--opt-level", "O2", "--tp", "2")
    summary = json.loads((tmp_path / "o2_tp2" / "summary.json").read_text())
    assert summary["layout"] == "tensor parallel" and summary["world_size"] == 2
    assert abs(tp2[-1]["val_loss"] / one[-1]["val_loss"] - 1) < 1e-2
    assert tp2[-1]["comm_bytes_by_kind"]["all_reduce"] > 0
    resumed = resume_last_checkpoint(tmp_path, email_corpus, "o2_tp2", "--opt-level", "O2", "--tp", "2")
    assert resumed == (tmp_path / "o2_tp2" / "metrics.jsonl").read_bytes()


@pytest.mark.slow  # two ranks
def test_pp2_splits_a_folder_into_stages_and_trains_as_one_process(tmp_path, email_corpus):
    """--pp 2 on a llama folder: each stage runs the model's own backbone on its decoder layers (the
    first embeds, the last norms and computes the head). At fp32 every step is one process's, with
    --tp 2 inside each stage too; at O2 (FP8 boundaries) within 1 % of one process; a resumed run
    continues byte for byte, and the stages' checkpoint exports as the whole model."""
    llama_config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path / "llama")
    one = folder_run(tmp_path, email_corpus, "llama", "one", "--opt-level", "fp32", ranks=1)
    pp2 = folder_run(tmp_path, email_corpus, "llama", "pp2", "--opt-level", "fp32", "--pp", "2")
    pp2_tp2 = folder_run(
        tmp_path, email_corpus, "llama", "pp2_tp2", "--opt-level", "fp32", "--pp", "2", "--tp", "2", ranks=4
    )
    for split in (pp2, pp2_tp2):  # stages, and stages split by the declared plan (3-D without data parallelism)
        for a, b in zip(one, split, strict=True):
            for key in ("train_loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
        assert split[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], rel=1e-5)
    from fp8lm.train.export import export_run, read_run_checkpoint, run_autocast, run_model

    exported = export_run(tmp_path / "pp2", tmp_path / "exported")  # the stages' DCP folder, resharded
    exported = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    state = read_run_checkpoint(tmp_path / "one")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), run_autocast(state):
        ours = run_model(state)(ids)[0].float()
    assert torch.allclose(ours, exported(ids).logits.float(), atol=0.05)  # BF16 export of the same weights
    one = folder_run(tmp_path, email_corpus, "llama", "o2_one", "--opt-level", "O2", ranks=1)
    pp2 = folder_run(tmp_path, email_corpus, "llama", "o2_pp2", "--opt-level", "O2", "--pp", "2")
    summary = json.loads((tmp_path / "o2_pp2" / "summary.json").read_text())
    assert summary["layout"] == "pipeline parallel" and summary["world_size"] == 2
    assert abs(pp2[-1]["val_loss"] / one[-1]["val_loss"] - 1) < 1e-2
    assert pp2[-1]["comm_bytes_by_kind"]["send"] > 0
    resumed = resume_last_checkpoint(tmp_path, email_corpus, "o2_pp2", "--opt-level", "O2", "--pp", "2")
    assert resumed == (tmp_path / "o2_pp2" / "metrics.jsonl").read_bytes()
