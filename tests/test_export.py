"""`fp8lm export` and `fp8lm generate`: a run as a Hugging Face folder that transformers loads as
GPT2LMHeadModel, its weights in BF16 (``hf``) or E4M3 with per-tensor scales (``hf-fp8``); the
numerics of the FP8 weights against a float64 reference; the byte tokenizer's round trip; the
refusals; the folder written whole or not at all; generation from a folder and from a run."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_helpers import run_main
from fp8lm.cli import main
from fp8lm.export import ExportError, dequantize_weight, quantize_weight, save_pretrained
from fp8lm.train.export import (
    byte_tokenizer,
    full_weights,
    gpt2_config,
    gpt2_model,
    hf_model,
    read_run_checkpoint,
    run_autocast,
    run_model,
    run_tokenizer,
)
from fp8lm.train.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

LINEAR = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 value, in float64."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    return values[values.isfinite()].unique()


def test_fp8_weights_are_the_nearest_e4m3_values_at_the_power_of_two_scale():
    grid = e4m3_grid()
    torch.manual_seed(0)
    for magnitude in (1e-4, 0.02, 3.0, 900.0):
        w = torch.randn(48, 40) * magnitude
        q, weight_scale = quantize_weight(w)
        assert q.dtype == torch.float8_e4m3fn and weight_scale.shape == (1,) and weight_scale.dtype == torch.float32
        x = w.double()
        scale = 2.0 ** torch.floor(torch.log2(448.0 / x.abs().max()))
        assert weight_scale.double().item() == 1.0 / scale.item()
        scaled = x * scale
        nearest = grid[(scaled.reshape(-1, 1) - grid).abs().argmin(dim=1)].reshape(x.shape)
        assert torch.equal(q.double(), nearest)
        assert torch.equal(dequantize_weight(q, weight_scale, torch.float64), nearest / scale)


def test_byte_tokenizer_ids_are_the_utf8_bytes_and_round_trip():
    tokenizer = byte_tokenizer()
    text = "def f(x):\n\treturn x  # ünïcödé ✓ 漢字 \x00\x7f end "
    ids = tokenizer.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert [tokenizer.encode(chr(b)).ids for b in range(128)] == [[b] for b in range(128)]
    assert tokenizer.get_vocab_size() == 256


@pytest.fixture(scope="module")
def run(tmp_path_factory, email_corpus, token_cache, tiny_cli_args):
    """A 5-step tiny O2 run."""
    out = tmp_path_factory.mktemp("export") / "run"
    args = ["train", *tiny_cli_args, "--steps", "5", "--opt-level", "O2", "--data", email_corpus]
    assert main([*args, "--cache-dir", token_cache, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def text_ids(email_corpus) -> torch.Tensor:
    """Two windows of real text, the run's context long."""
    data = (Path(email_corpus) / "utils.py").read_bytes()
    return torch.tensor([list(data[1000:1032]), list(data[5000:5032])])


def load(folder: Path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def reference_logits(run: Path, ids: torch.Tensor, fp8: bool) -> torch.Tensor:
    """fp8lm's GPT, in float32, with the weights as an export stores them: BF16, and for ``fp8``
    the linear layers' (not the head's) as their E4M3 values."""
    state = read_run_checkpoint(run)
    weights = {k: v.bfloat16().float() for k, v in full_weights(state).items()}
    if fp8:
        for k, v in full_weights(state).items():
            if k.endswith(LINEAR):
                weights[k] = dequantize_weight(*quantize_weight(v))
    model = GPT(state["model_config"])
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(ids)[0]


@pytest.mark.parametrize("fmt", ["hf", "hf-fp8"])
def test_export_loads_as_gpt2_and_computes_the_gpt(run, text_ids, tmp_path, capsys, fmt):
    out = tmp_path / fmt
    rc, stdout, err = run_main(["export", str(run), "--out", str(out), "--format", fmt], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert "run" in (out / "README.md").read_text() and "step 5" in (out / "README.md").read_text()
    from safetensors.torch import load_file

    stored = load_file(out / "model.safetensors")
    linear = [k for k in stored if k.endswith(LINEAR)]
    assert len(linear) == 8
    want = torch.float8_e4m3fn if fmt == "hf-fp8" else torch.bfloat16
    assert all(stored[k].dtype == want for k in linear)
    assert stored["lm_head.weight"].dtype == torch.bfloat16
    assert ("transformer.h.0.mlp.c_fc.weight_scale" in stored) == (fmt == "hf-fp8")
    model = load(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        logits = model(text_ids).logits
    torch.testing.assert_close(logits, reference_logits(run, text_ids, fp8=fmt == "hf-fp8"), rtol=1e-4, atol=1e-4)
    # as served (BF16) against fp8lm's own model at the run's level (FP8 GEMMs, BF16 autocast)
    state = read_run_checkpoint(run)
    with torch.no_grad(), run_autocast(state):
        own = run_model(state)(text_ids)[0].float()
        served = load(out, dtype=torch.bfloat16)(text_ids).logits.float()
    assert (served.argmax(-1) == own.argmax(-1)).float().mean() >= 0.95
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("héllo ✓")["input_ids"] == list("héllo ✓".encode())


def test_gpt2_config_is_the_gpt_exactly():
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32, bias=False)
    torch.manual_seed(0)
    gpt = GPT(cfg).eval()
    ids = torch.randint(0, 256, (2, 64))
    hf = gpt2_model(gpt.state_dict(), cfg)
    assert hf.config.activation_function == "gelu" and not hf.config.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gpt(ids)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ExportError, match="--mlp swiglu has no Hugging Face equivalent"):
        gpt2_config(GPTConfig(mlp="swiglu"))


def test_llama_config_is_the_gpt_exactly():
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64, arch="llama", n_kv_head=2, rope_theta=500.0)
    torch.manual_seed(0)
    gpt = GPT(cfg).eval()
    for p in gpt.parameters():  # norms away from 1, so a misplaced gain shows
        p.data.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 256, (2, 64))
    hf = hf_model(gpt.state_dict(), cfg)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_key_value_heads == 2
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gpt(ids)[0], rtol=1e-5, atol=1e-5)


def test_a_llama_run_exports_as_llama_in_fp8(tmp_path, email_corpus, token_cache, tiny_cli_args, text_ids, capsys):
    run = tmp_path / "llama"
    args = ["train", *tiny_cli_args, "--steps", "3", "--opt-level", "O2", "--arch", "llama", "--n-kv-head", "1"]
    assert run_main([*args, "--data", email_corpus, "--cache-dir", token_cache, "--out", str(run)], capsys)[0] == 0
    out = tmp_path / "fp8"
    rc, _, err = run_main(["export", str(run), "--out", str(out), "--format", "hf-fp8"], capsys)
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "dequantize" not in config["quantization_config"]  # nn.Linear layers: compressed-tensors' own route
    from safetensors.torch import load_file

    stored = load_file(out / "model.safetensors")
    assert stored["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["lm_head.weight"].dtype == torch.bfloat16
    state = read_run_checkpoint(run)
    weights = {k: v.bfloat16().float() for k, v in full_weights(state).items()}
    for k, v in full_weights(state).items():
        if k.endswith(("c_q.weight", "c_kv.weight", "c_proj.weight", "c_fc.weight")):
            # the fused k/v and gate/up layers are two tensors each, with the fused operand's scale
            weights[k] = dequantize_weight(*quantize_weight(v))
    reference = GPT(state["model_config"])
    reference.load_state_dict(weights)
    with torch.no_grad():
        torch.testing.assert_close(load(out)(text_ids).logits, reference.eval()(text_ids)[0], rtol=1e-4, atol=1e-4)


def test_mixtral_config_is_the_moe_gpt_exactly():
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64, arch="llama", n_kv_head=2, moe_experts=4)
    torch.manual_seed(0)
    gpt = GPT(cfg).eval()
    for p in gpt.parameters():  # norms away from 1, so a misplaced gain shows
        p.data.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 256, (2, 64))
    hf = hf_model(gpt.state_dict(), cfg)
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.num_local_experts == 4
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gpt(ids)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(arch="gpt"), "--arch gpt"),
        (dict(moe_router="sigmoid"), "--moe-router sigmoid"),
        (dict(moe_top_k=1), "--moe-top-k 1"),
        (dict(moe_shared_expert=True), "--moe-shared-expert"),
        (dict(moe_capacity_factor=1.0), "--moe-capacity-factor"),
    ],
)
def test_a_mixture_mixtral_does_not_compute_is_refused_in_one_line(kw, named):
    cfg = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, **{"arch": "llama", "moe_experts": 4, **kw})
    with pytest.raises(ExportError, match="MixtralForCausalLM") as e:
        hf_model(GPT(cfg).state_dict(), cfg)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_moe_run_exports_as_mixtral(tmp_path, email_corpus, token_cache, tiny_cli_args, text_ids, capsys):
    run = tmp_path / "moe"
    args = ["train", *tiny_cli_args, "--steps", "3", "--opt-level", "O2", "--arch", "llama", "--moe-experts", "4"]
    assert run_main([*args, "--data", email_corpus, "--cache-dir", token_cache, "--out", str(run)], capsys)[0] == 0
    state = read_run_checkpoint(run)
    hidden = state["model_config"].mlp_hidden
    for fmt in ("hf", "hf-fp8"):
        out = tmp_path / fmt
        rc, _, err = run_main(["export", str(run), "--out", str(out), "--format", fmt], capsys)
        assert rc == 0, err
        assert json.loads((out / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
        from safetensors.torch import load_file

        stored = load_file(out / "model.safetensors")
        assert stored["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 2 * hidden, 32)
        assert stored["model.layers.1.mlp.experts.down_proj"].dtype == torch.bfloat16  # 3-D: not nn.Linear
        k_proj = stored["model.layers.0.self_attn.k_proj.weight"].dtype
        assert k_proj == (torch.float8_e4m3fn if fmt == "hf-fp8" else torch.bfloat16)
        with torch.no_grad():
            assert load(out)(text_ids).logits.isfinite().all()
    assert "MixtralForCausalLM" in (tmp_path / "hf" / "README.md").read_text()
    reference = GPT(state["model_config"])
    reference.load_state_dict({k: v.bfloat16().float() for k, v in full_weights(state).items()})
    with torch.no_grad():
        torch.testing.assert_close(
            load(tmp_path / "hf")(text_ids).logits, reference.eval()(text_ids)[0], rtol=1e-4, atol=1e-4
        )


def test_a_bpe_run_exports_its_own_tokenizer(tmp_path, email_corpus, token_cache, tiny_cli_args, capsys):
    run = tmp_path / "bpe"
    args = ["train", *tiny_cli_args, "--steps", "1", "--tokenizer", "bpe", "--vocab-size", "512"]
    assert run_main([*args, "--data", email_corpus, "--cache-dir", token_cache, "--out", str(run)], capsys)[0] == 0
    out = tmp_path / "hf"
    rc, _, err = run_main(["export", str(run), "--out", str(out)], capsys)
    assert rc == 0, err
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 512
    text = (Path(email_corpus) / "utils.py").read_text()[:2000]
    ids = transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"]
    assert ids == run_tokenizer(read_run_checkpoint(run)).encode(text.encode()) and len(ids) < 0.8 * len(text)  # merges


def test_export_refuses_a_non_empty_out_then_overwrites(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = run_main(["export", str(run), "--out", str(out)], capsys)
    assert rc == 2 and err.count("\n") == 1 and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    rc, _, err = run_main(["export", str(run), "--out", str(out), "--overwrite"], capsys)
    assert rc == 0, err
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left


def test_export_refuses_what_the_run_would_not_trust(run, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(run / "checkpoints", bad)
    checkpoint = next(bad.glob("step_*.pt"))
    state = torch.load(checkpoint, weights_only=True)
    state["model"]["lm_head.weight"][0, 0] = float("nan")
    torch.save(state, checkpoint)
    rc, _, err = run_main(["export", str(checkpoint), "--out", str(tmp_path / "x")], capsys)
    assert rc == 2 and err.count("\n") == 1 and "lm_head.weight" in err
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])  # truncated
    rc, _, err = run_main(["export", str(checkpoint), "--out", str(tmp_path / "x")], capsys)
    assert rc == 2 and err.count("\n") == 1 and "cannot read checkpoint" in err
    rc, _, err = run_main(["export", str(run), "--out", str(tmp_path / "x"), "--step", "3"], capsys)
    assert rc == 2 and "no checkpoint of step 3" in err and "steps there: 5" in err
    rc, _, err = run_main(["export", str(run), "--out", str(tmp_path / "x"), "--format", "gguf"], capsys)
    assert rc == 2 and "invalid choice" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_a_failed_export_leaves_the_destination_as_it_was(run, tmp_path, monkeypatch):
    model = gpt2_model(full_weights(read_run_checkpoint(run)), read_run_checkpoint(run)["model_config"])
    old = tmp_path / "old"
    save_pretrained(model, old)
    before = {p.name: p.read_bytes() for p in old.iterdir()}

    def fail(self, folder):
        (Path(folder) / "half-written").write_text("x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", fail)
    for out, overwrite in ((tmp_path / "new", False), (old, True)):
        with pytest.raises(OSError, match="No space"):
            save_pretrained(model, out, format="hf-fp8", tokenizer=byte_tokenizer(), overwrite=overwrite)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before


def test_generate_from_an_export_and_from_the_run(run, tmp_path, capsys):
    out = tmp_path / "fp8"
    assert run_main(["export", str(run), "--out", str(out), "--format", "hf-fp8"], capsys)[0] == 0
    sampled = ["--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "8", "--seed", "3"]
    texts = []
    for source in (out, run):
        first = run_main(["generate", str(source), "--prompt", "def main(", *sampled], capsys)
        again = run_main(["generate", str(source), "--prompt", "def main(", *sampled], capsys)
        assert first[0] == 0 and first[1] == again[1], first[2]
        assert first[1].startswith("def main(")
        greedy = run_main(["generate", str(source), "--prompt", "import ", "--max-new-tokens", "6"], capsys)
        assert greedy[0] == 0 and greedy[1].startswith("import ")
        texts.append(first[1])
    rc, _, err = run_main(["generate", str(out), "--prompt", "", "--max-new-tokens", "3"], capsys)
    assert rc == 2 and "--prompt is empty" in err
    rc, _, err = run_main(["generate", str(run), "--prompt", "x", "--temperature", "-1"], capsys)
    assert rc == 2 and "--temperature must be >= 0" in err
