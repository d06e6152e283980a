"""``hf-fp8`` exports of runs trained with the fine-grained recipes: each exported E4M3 weight with
its scales is the recipe's weight operand (`fp8lm.fake_quantize`), bit for bit, as compressed-tensors
reads it back (per output channel for rowwise, 128 x 128 blocks for blockwise, MXFP8 groups for
mxfp8); float64 references for the power-of-two scales; fused layers split into their shares;
the refusals (nvfp4, layouts compressed-tensors cannot hold); transformers loading the exports."""

import json

import pytest
import torch

from cli_helpers import run_main
from fp8lm import Recipe, fake_quantize
from fp8lm.export import (
    ExportError,
    WeightScheme,
    activation_args,
    dequantize_weight,
    model_recipe,
    quantization_config,
    quantize_weight,
    quantize_weights,
    save_pretrained,
    weight_scheme,
)
from fp8lm.train.export import full_weights, hf_model, read_run_checkpoint
from fp8lm.train.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
compressed_tensors = pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

FINE = ("rowwise", "rowwise-wgrad-bf16", "blockwise", "mxfp8")
SHAPES = [(48, 64), (300, 160)]  # the second: neither dim a multiple of 128


def weight(shape, seed=0) -> torch.Tensor:
    """Rows of very different magnitudes, so per-row and per-block scales differ."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0]).unsqueeze(1)


def reader(e4m3: torch.Tensor, weight_scale: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """The weight compressed-tensors decompresses from an export's tensors (as transformers does
    at load time with ``dequantize``)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme_ct = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**scheme.weights_args()))
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    return compressor.decompress({"weight": e4m3, "weight_scale": weight_scale}, scheme_ct)["weight"]


@pytest.mark.parametrize(
    "name, strategy, block",
    [
        ("tensorwise-delayed", "tensor", None),
        ("tensorwise-current", "tensor", None),
        ("rowwise", "channel", None),
        ("rowwise-wgrad-bf16", "channel", None),
        ("blockwise", "block", 128),
        ("mxfp8", "group", 32),
    ],
)
def test_each_recipe_has_its_compressed_tensors_strategy(name, strategy, block):
    scheme = weight_scheme(Recipe.from_name(name))
    assert (scheme.strategy, scheme.block) == (strategy, block)
    config = quantization_config(["lm_head"], dequantize=False, scheme=scheme)
    args = config["config_groups"]["group_0"]["weights"]
    assert args["strategy"] == strategy and args["type"] == "float" and args["num_bits"] == 8
    assert args.get("block_structure") == ([128, 128] if strategy == "block" else None)
    assert args.get("group_size") == (32 if strategy == "group" else None)
    assert config["format"] == ("mxfp8-quantized" if name == "mxfp8" else "float-quantized")
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(config).config_groups["group_0"].weights
    assert parsed.strategy == strategy and parsed.block_structure == args.get("block_structure")


def test_nvfp4_and_non_e4m3_weights_are_refused_in_one_line():
    with pytest.raises(ExportError, match="recipe nvfp4") as e:
        weight_scheme(Recipe.from_name("nvfp4"))
    assert "'hf'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ExportError, match="E5M2 weight operands"):
        weight_scheme(Recipe(weight_format="e5m2"))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", FINE)
def test_exported_weights_are_the_recipes_weight_operand_bit_for_bit(name, shape):
    recipe = Recipe.from_name(name)
    scheme = weight_scheme(recipe)
    w = weight(shape)
    operand = fake_quantize(w, recipe, "weight")
    q, weight_scale = quantize_weight(w, recipe)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    rows, cols = shape
    expected_scale_shape = {
        "channel": (rows, 1),
        "block": (-(-rows // 128), -(-cols // 128)),
        "group": (rows, cols // 32),
    }[scheme.strategy]
    assert tuple(weight_scale.shape) == expected_scale_shape
    assert weight_scale.dtype == (torch.uint8 if name == "mxfp8" else torch.float32)
    assert torch.equal(dequantize_weight(q, weight_scale, block=scheme.scale_block), operand)
    assert torch.equal(reader(q, weight_scale, scheme).float(), operand)
    if name != "mxfp8":  # a GPT-2 Conv1D's (in, out) weight: payload and scales transposed
        qt, st = quantize_weight(w.t(), recipe, transposed=True)
        assert torch.equal(qt, q.t()) and torch.equal(reader(qt, st, scheme).float(), operand.t())


def e4m3_nearest(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64) to the nearest finite E4M3 value, saturating (ties: the even code)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    codes = torch.arange(256)
    keep = values.isfinite()
    order = values[keep].argsort()
    grid, grid_codes = values[keep][order], codes[keep][order]
    x = x.clamp(grid[0], grid[-1])
    hi = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = x - grid[lo], grid[hi] - x
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (grid_codes[hi] % 2 == 0))
    return torch.where(pick_hi, grid[hi], grid[lo])


@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_power_of_two_scales_against_a_float64_reference(name):
    w = weight((40, 96), seed=1).double()
    q, weight_scale = quantize_weight(w.float(), Recipe.from_name(name))
    if name == "rowwise":  # the smallest power of two d with amax / d <= 448, per row
        d = torch.exp2(torch.ceil(torch.log2(w.abs().amax(dim=1, keepdim=True) / 448)))
        assert torch.equal(weight_scale.double(), d)
    else:  # OCP MX: 2**(floor(log2(amax)) - 8) per 32 weights of a row, values above 448 d saturate
        amax = w.reshape(40, 3, 32).abs().amax(dim=2)
        d = torch.exp2(torch.floor(torch.log2(amax)) - 8)
        assert torch.equal(weight_scale.long() - 127, torch.log2(d).long())
        d = d.repeat_interleave(32, dim=1)
    assert torch.equal(q.double(), e4m3_nearest(w / d))


@pytest.mark.parametrize(
    "name, sizes",
    [
        ("tensorwise-delayed", (40, 24)),
        ("rowwise", (40, 24)),
        ("mxfp8", (40, 24)),
        ("blockwise", (40, 24)),  # both parts within one 128-row block: its scales
        ("blockwise", (256, 72)),  # the split on a block edge; the second part's last block is partial
    ],
)
def test_fused_parts_get_their_share_of_the_fused_operand(name, sizes):
    recipe = None if name.startswith("tensorwise") else Recipe.from_name(name)
    scheme = weight_scheme(recipe)
    parts = [weight((n, 64), seed=i) for i, n in enumerate(sizes)]
    whole = torch.cat(parts)
    operand = fake_quantize(whole, recipe or Recipe(scaling="current"), "weight")
    got = torch.cat([reader(q, s, scheme).float() for q, s in quantize_weights(parts, recipe)])
    assert torch.equal(got, operand)


def test_blocks_that_straddle_a_fused_split_are_refused():
    parts = [weight((100, 64)), weight((100, 64), seed=1)]
    with pytest.raises(ExportError, match="straddle the split of a fused layer at row 100"):
        quantize_weights(parts, Recipe.from_name("blockwise"))


def test_mxfp8_layouts_the_group_format_cannot_hold_are_refused():
    mxfp8 = Recipe.from_name("mxfp8")
    with pytest.raises(ExportError, match="Conv1D"):
        quantize_weight(weight((64, 48)), mxfp8, transposed=True)
    with pytest.raises(ExportError, match="partial block of 32"):
        quantize_weight(weight((48, 40)), mxfp8)


def test_save_pretrained_takes_the_recipe_of_the_models_fp8_layers(tmp_path):
    from fp8lm import initialize

    cfg = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    model = hf_model(GPT(cfg).state_dict(), cfg)
    model, _ = initialize(model, None, "O1", recipe="blockwise")
    assert model_recipe(model) == Recipe.from_name("blockwise")
    with pytest.raises(ExportError, match="recipe rowwise was given but the model's FP8 layers compute with blockwise"):
        model_recipe(model, "rowwise")
    out = save_pretrained(model, tmp_path / "out", format="hf-fp8")
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["strategy"] == "block"
    with pytest.raises(ExportError, match="recipe nvfp4"):
        save_pretrained(hf_model(GPT(cfg).state_dict(), cfg), tmp_path / "nv", format="hf-fp8", recipe="nvfp4")
    assert not (tmp_path / "nv").exists()


def trained(tmp_path, args, email_corpus, token_cache, tiny_cli_args, capsys):
    run = tmp_path / "run"
    cmd = ["train", *tiny_cli_args, "--steps", "3", "--opt-level", "O2", *args, "--data", email_corpus]
    assert run_main([*cmd, "--cache-dir", token_cache, "--out", str(run)], capsys)[0] == 0
    return run


def operand_logits(run, ids: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """fp8lm's GPT in float32 with the export's weights: the linear layers' as the recipe's weight
    operands (`fake_quantize`), the head and the rest BF16."""
    state = read_run_checkpoint(run)
    weights = {k: v.bfloat16().float() for k, v in full_weights(state).items()}
    linear = [
        m + ".weight" for m, mod in GPT(state["model_config"]).named_modules() if isinstance(mod, torch.nn.Linear)
    ]
    for k, v in full_weights(state).items():
        if k in linear and k != "lm_head.weight":
            weights[k] = fake_quantize(v, recipe, "weight")
    model = GPT(state["model_config"])
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(ids)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, arch, strategy",
    [
        ("rowwise", "gpt", "channel"),
        ("blockwise", "gpt", "block"),
        ("blockwise", "llama", "block"),
    ],
)
def test_a_fine_grained_run_loads_in_transformers_with_its_operands(
    tmp_path, email_corpus, token_cache, tiny_cli_args, capsys, recipe, arch, strategy
):
    args = ["--recipe", recipe, "--arch", arch] + (["--n-kv-head", "1"] if arch == "llama" else [])
    if (
        recipe == "blockwise" and arch == "llama"
    ):  # width 48: the fused gate/up layer (2 x 128 rows) splits on a block edge
        args += ["--n-embd", "48"]
    run = trained(tmp_path, args, email_corpus, token_cache, tiny_cli_args, capsys)
    out = tmp_path / "fp8"
    rc, _, err = run_main(["export", str(run), "--out", str(out), "--format", "hf-fp8"], capsys)
    assert rc == 0, err
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization["config_groups"]["group_0"]["weights"]["strategy"] == strategy
    assert ("dequantize" in quantization) == (arch == "gpt")  # Conv1D: dequantized at load time
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = operand_logits(run, ids, Recipe.from_name(recipe))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-4, atol=1e-4)
        served = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits.float()
    # BF16 (the folder's dtype): activations and results rounded to 8 significant bits per op
    assert (served - reference).abs().max() <= 2**-5 * reference.abs().max()
    assert (served.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("recipe, arch, named", [("nvfp4", "gpt", "recipe nvfp4"), ("mxfp8", "gpt", "Conv1D")])
def test_a_run_whose_recipe_has_no_exact_format_is_refused_in_one_line(
    tmp_path, email_corpus, token_cache, tiny_cli_args, capsys, recipe, arch, named
):
    run = trained(tmp_path, ["--recipe", recipe, "--arch", arch], email_corpus, token_cache, tiny_cli_args, capsys)
    rc, _, err = run_main(["export", str(run), "--out", str(tmp_path / "fp8"), "--format", "hf-fp8"], capsys)
    assert rc == 2 and err.count("\n") == 1 and named in err and "'hf'" in err
    assert not (tmp_path / "fp8").exists()
    rc, _, err = run_main(["export", str(run), "--out", str(tmp_path / "bf16"), "--format", "hf"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize(
    "name, expected",
    [
        ("tensorwise-delayed", {"strategy": "tensor"}),
        ("tensorwise-current", {"strategy": "tensor"}),
        ("rowwise", {"strategy": "token"}),
        ("blockwise", {"strategy": "group", "group_size": 128}),
    ],
)
def test_fp8_input_activations_take_the_recipes_blocks(name, expected):
    assert activation_args(Recipe.from_name(name)) == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": True,
        **expected,
    }


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_fp8_input_activations_no_scheme_holds_are_refused(name):
    with pytest.raises(ExportError, match="--input-activations bf16"):
        activation_args(Recipe.from_name(name))


def test_fp8_input_activations_are_refused_where_they_would_not_be_honoured(tmp_path):
    gpt = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    llama = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, arch="llama", mlp="swiglu")
    cases = [
        (hf_model(GPT(gpt).state_dict(), gpt), "hf-fp8", "fp8", "Conv1D"),  # transformers would not quantize them
        (hf_model(GPT(llama).state_dict(), llama), "hf", "fp8", "format 'hf-fp8'"),
        (hf_model(GPT(llama).state_dict(), llama), "hf-fp8", "e4m3", "unknown input_activations"),
    ]
    for model, format, activations, message in cases:
        with pytest.raises(ExportError, match=message):
            save_pretrained(model, tmp_path / "out", format=format, input_activations=activations)
        assert not (tmp_path / "out").exists()
    out = save_pretrained(cases[1][0], tmp_path / "w8a8", format="hf-fp8", input_activations="fp8", recipe="rowwise")
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"]["strategy"] == "token" and group["weights"]["strategy"] == "channel"


@pytest.mark.slow
def test_a_llama_run_exported_w8a8_runs_in_transformers_with_fp8_inputs(
    tmp_path, email_corpus, token_cache, tiny_cli_args, capsys
):
    """``--input-activations fp8`` on a rowwise Llama run: transformers (compressed-tensors' runtime)
    quantizes each linear layer's input to E4M3 per token, with the scale ``amax / 448``, which is
    fp8lm's blockwise quantization with one block per row."""
    run = trained(
        tmp_path, ["--recipe", "rowwise", "--arch", "llama"], email_corpus, token_cache, tiny_cli_args, capsys
    )
    out = tmp_path / "w8a8"
    args = ["export", str(run), "--out", str(out), "--format", "hf-fp8", "--input-activations", "fp8"]
    rc, _, err = run_main(args, capsys)
    assert rc == 0, err
    assert "W8A8" in (out / "README.md").read_text()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    state = read_run_checkpoint(run)
    weights = {k: v.bfloat16().float() for k, v in full_weights(state).items()}
    reference_model = GPT(state["model_config"])
    for name, module in reference_model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            weights[name + ".weight"] = fake_quantize(full_weights(state)[name + ".weight"], "rowwise", "weight")
            per_token = Recipe.from_name("blockwise").replace(block=module.in_features)
            module.register_forward_pre_hook(lambda m, a, r=per_token: (fake_quantize(a[0], r, "input"),))
    reference_model.load_state_dict(weights)
    with torch.no_grad():
        reference = reference_model.eval()(ids)[0]
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-4, atol=1e-4)
        w8a16 = tmp_path / "w8a16"
        assert run_main(["export", str(run), "--out", str(w8a16), "--format", "hf-fp8"], capsys)[0] == 0
        unquantized_inputs = transformers.AutoModelForCausalLM.from_pretrained(w8a16, dtype=torch.float32)
        assert (unquantized_inputs.eval()(ids).logits - reference).abs().max() > 1e-3


def test_fp8_input_activations_of_a_gpt_run_are_refused_in_one_line(
    tmp_path, email_corpus, token_cache, tiny_cli_args, capsys
):
    run = trained(tmp_path, [], email_corpus, token_cache, tiny_cli_args, capsys)
    for format, named in (("hf-fp8", "Conv1D"), ("hf", "format 'hf-fp8'")):
        out = tmp_path / format
        args = ["export", str(run), "--out", str(out), "--format", format, "--input-activations", "fp8"]
        rc, _, err = run_main(args, capsys)
        assert rc == 2 and err.count("\n") == 1 and named in err, err
        assert not out.exists()
