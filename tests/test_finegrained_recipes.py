"""The fine-grained recipes (rowwise, rowwise-wgrad-bf16, blockwise, mxfp8, nvfp4): named frozen
values, FP8Linear's three GEMMs on the operands `fp8lm.fake_quantize` gives, training, compile,
checkpoints and the command line's --recipe."""

import math

import pytest
import torch

import fp8lm
from fp8lm.nn import FP8Linear
from fp8lm.ops.finegrained import quantize_operand
from fp8lm.ops.hadamard import random_hadamard
from fp8lm.train.config import RunError, TrainConfig
from fp8lm.train.loop import train

FINE = ("rowwise", "rowwise-wgrad-bf16", "blockwise", "mxfp8", "nvfp4")


def test_named_fine_grained_recipes_are_frozen_hashable_values():
    recipes = {name: fp8lm.Recipe.from_name(name) for name in FINE}
    assert len(set(recipes.values()) | {fp8lm.Recipe()}) == len(FINE) + 1
    assert [(r.granularity, r.block) for r in recipes.values()] == [
        ("rowwise", None),
        ("rowwise", None),
        ("blockwise", 128),
        ("mxfp8", 32),
        ("nvfp4", 16),
    ]
    for name, recipe in recipes.items():
        assert recipe.name == name and recipe.fine_grained and recipe.steps == 0
        assert recipe.grad_output_format == fp8lm.E4M3  # E4M3 for all three operands
    assert recipes["rowwise-wgrad-bf16"].weight_grad_gemm == "bf16"
    assert not fp8lm.Recipe().fine_grained and fp8lm.Recipe().granularity == "tensorwise"
    with pytest.raises(AttributeError):
        recipes["blockwise"].block = 64  # type: ignore[misc]
    custom = recipes["blockwise"].replace(block=64, pow2_scales=True)
    assert custom.name is None and custom.block == 64


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"granularity": "colwise"}, "unknown granularity 'colwise'"),
        ({"granularity": "blockwise"}, "use scaling='current' and margin=0"),
        ({"granularity": "mxfp8", "scaling": "current", "margin": 1}, "use scaling='current' and margin=0"),
        ({"granularity": "rowwise", "scaling": "current", "block": 32}, "has no block size"),
        ({"granularity": "blockwise", "scaling": "current", "block": 0}, "block must be an int >= 1"),
        ({"mx_rounding": "rceil"}, "applies to granularity='mxfp8' only"),
        ({"granularity": "mxfp8", "scaling": "current", "mx_rounding": "up"}, "unknown mx_rounding 'up'"),
        ({"pow2_scales": True}, "applies to granularity='blockwise'"),
        ({"nvfp4_scale_rule": "4over6"}, "applies to granularity='nvfp4' only"),
        ({"granularity": "rowwise", "scaling": "current", "nvfp4_scale_rule": "4over6"}, "granularity='nvfp4' only"),
        (
            {"granularity": "nvfp4", "scaling": "current", "grad_output_format": "e4m3", "nvfp4_scale_rule": "6"},
            "unknown nvfp4_scale_rule '6'",
        ),
        ({"weight_grad_gemm": "bf16"}, "fine-grained granularities only"),
        ({"granularity": "nvfp4", "scaling": "current"}, "keep the formats E4M3"),
    ],
)
def test_bad_fine_grained_recipes_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        fp8lm.Recipe(**changes)


def _fq_along(x, recipe, role, dim):
    return quantize_operand(x, recipe, role, dim=dim).dequantize().double()


@pytest.mark.parametrize("name", FINE)
def test_linear_gemms_multiply_the_operands_quantized_along_their_reduction_dims(name):
    """Forward, input gradient and weight gradient against float64 products of the operands
    quantized independently (fake_quantize, and along dim 0 its transpose); shapes (111 tokens,
    200 -> 96 features) divide no block."""
    recipe = fp8lm.Recipe.from_name(name)
    layer = FP8Linear(200, 96, weight_format="FP32", weight_grad_format="FP32", recipe=recipe)
    x = torch.randn(3, 37, 200, requires_grad=True)
    g = torch.randn(3, 37, 96)
    y = layer(x)
    generator_state = torch.get_rng_state()
    y.backward(g)
    w, x2, g2 = layer.weight.detach(), x.detach().reshape(-1, 200), g.reshape(-1, 96)
    ref = lambda v, role: fp8lm.fake_quantize(v, recipe, role).double()  # noqa: E731
    expected_y = ref(x2, "input") @ ref(w, "weight").t() + layer.bias.detach().double()
    torch.testing.assert_close(y.detach().reshape(-1, 96).double(), expected_y, rtol=1e-5, atol=1e-5)
    torch.set_rng_state(generator_state)  # nvfp4: the same noise for the output gradient
    g_dx = ref(g2, "grad_output")
    w_dx = ref(w, "weight") if name in ("blockwise", "nvfp4") else _fq_along(w, recipe, "weight", 0)
    torch.testing.assert_close(x.grad.reshape(-1, 200).double(), g_dx @ w_dx, rtol=1e-5, atol=1e-5)
    if recipe.weight_grad_gemm == "bf16":
        expected_w = g2.bfloat16().double().t() @ x2.bfloat16().double()
    elif name == "nvfp4":
        hx, hg = random_hadamard(x2, recipe.hadamard_seed), random_hadamard(g2, recipe.hadamard_seed)
        expected_w = _fq_along(hg, recipe, "grad_output", 0).t() @ _fq_along(hx, recipe, "input", 0)
    else:
        expected_w = _fq_along(g2, recipe, "grad_output", 0).t() @ _fq_along(x2, recipe, "input", 0)
    if name != "nvfp4":  # nvfp4 draws noise for the weight-gradient operand after the dx one
        torch.testing.assert_close(layer.weight.grad.double(), expected_w, rtol=1e-5, atol=1e-5)
    else:
        error = (layer.weight.grad.double() - expected_w).norm() / expected_w.norm()
        assert error < 0.2  # stochastic rounding of the gradient: same spec, other noise
    torch.testing.assert_close(layer.bias.grad, g2.sum(0))


def test_weight_gradient_at_rest_stays_an_e4m3_scaling_tensor():
    layer = FP8Linear(64, 32, recipe="blockwise")
    layer(torch.randn(5, 64)).sum().backward()
    assert isinstance(layer.weight.grad, fp8lm.ScalingTensor) and layer.weight.grad.fmt == fp8lm.E4M3


def test_non_finite_inputs_make_outputs_nan():
    layer = FP8Linear(64, 32, recipe="mxfp8")
    x = torch.randn(4, 64)
    x[0, 0] = float("inf")
    y = layer(x)
    assert y[0].isnan().all() and not y[1:].isnan().any()


@pytest.mark.parametrize("recipe", ["blockwise", "nvfp4"])  # nvfp4: its packed saves, its stochastic rounding
@pytest.mark.parametrize("weight_format", ["fp16", "fp32"])  # O2's stored weight; O1's plain one
def test_fullgraph_compile_of_a_fine_grained_layer_gives_the_eager_numbers(recipe, weight_format):
    torch.manual_seed(0)
    layer = FP8Linear(96, 64, recipe=recipe, weight_format=weight_format)
    x = torch.randn(2, 40, 96, requires_grad=True)

    def step(inp):
        out = layer(inp)
        out.square().sum().backward()
        return out

    torch.manual_seed(1)  # the noise of nvfp4's stochastic rounding: the same draws in both runs
    eager_y = step(x)
    eager_grads = (x.grad.clone(), _values(layer.weight.grad).clone())
    x.grad, layer.weight.grad = None, None
    torch._dynamo.reset()
    torch.manual_seed(1)
    compiled_y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    compiled_y.square().sum().backward()
    assert torch.equal(compiled_y, eager_y)
    assert torch.equal(x.grad, eager_grads[0])
    assert torch.equal(_values(layer.weight.grad), eager_grads[1])


def _values(t: torch.Tensor) -> torch.Tensor:
    """The values of a gradient stored in FP8 (a ScalingTensor) or plain."""
    return t.dequantize() if isinstance(t, fp8lm.ScalingTensor) else t


@pytest.fixture(scope="module")
def runs(tmp_path_factory, email_corpus):
    cache = str(tmp_path_factory.mktemp("tokens"))
    results = {}

    def run(recipe: str, steps: int = 12, **kw):
        if (recipe, steps) not in results:
            out = tmp_path_factory.mktemp(recipe)
            tiny = dict(model="tiny", batch_size=4, seq_len=32, eval_every=steps, eval_batches=2, lr=1e-2)
            cfg = TrainConfig(
                **tiny,
                progress=False,
                data=email_corpus,
                opt_level="O2",
                steps=steps,
                recipe=recipe,
                out=str(out),
                cache_dir=cache,
                **kw,
            )
            results[(recipe, steps)] = (train(cfg), out)
        return results[(recipe, steps)]

    return run


@pytest.mark.parametrize("name", FINE)
def test_a_tiny_model_trains_at_o2_with_each_recipe(runs, name):
    tensorwise, _ = runs("tensorwise-current")
    summary, _ = runs(name)
    assert math.isfinite(summary["val_loss"])
    tolerance = 0.05 if name == "nvfp4" else 0.02
    assert abs(summary["val_loss"] - tensorwise["val_loss"]) / tensorwise["val_loss"] < tolerance, (summary, tensorwise)


def test_checkpoint_round_trip_with_a_fine_grained_recipe(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8lm.initialize(model, opt, "O2", recipe="mxfp8")
    x = torch.randn(8, 64)
    model(x).square().mean().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh, fresh_opt = fp8lm.initialize(fresh, fresh_opt, "O2", recipe="mxfp8")
    saved = torch.load(path, weights_only=True)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    assert fresh[0].recipe == fp8lm.Recipe.from_name("mxfp8")
    assert torch.equal(fresh(x), model(x))


def test_train_config_takes_every_recipe_name():
    for name in FINE:
        cfg = TrainConfig(opt_level="O2", recipe=name)
        cfg.validate()
        assert cfg.initialize_options() == {"recipe": fp8lm.Recipe.from_name(name)}
    with pytest.raises(RunError, match="--recipe sets the FP8 layers"):
        TrainConfig(opt_level="bf16", recipe="blockwise").validate()


def test_grouped_expert_gemms_take_every_fine_grained_recipe():
    from fp8lm.nn import FP8GroupedLinear

    for name in ("blockwise", "mxfp8", "nvfp4", "nvfp4-4over6"):
        recipe = fp8lm.Recipe.from_name(name)
        assert FP8GroupedLinear(4, 32, 16, recipe=name).recipe == recipe
        TrainConfig(opt_level="O2", recipe=name, moe_experts=4).validate()


def test_nvfp4_4over6_is_nvfp4_with_four_over_six_by_name():
    recipe = fp8lm.Recipe.from_name("nvfp4-4over6")
    assert recipe == fp8lm.Recipe.from_name("nvfp4").replace(nvfp4_scale_rule="4over6")
    assert recipe.name == "nvfp4-4over6" and fp8lm.Recipe.from_name("nvfp4").name == "nvfp4"
    cfg = TrainConfig(opt_level="O2", recipe="nvfp4-4over6")
    cfg.validate()
    assert cfg.initialize_options() == {"recipe": recipe}


@pytest.mark.parametrize("name", ["rowwise", "rowwise-wgrad-bf16"])
def test_rowwise_gemms_through_scaled_mm_match_the_emulation(name):
    """backend='scaled_mm' (on CPU, torch's kernel) gives the emulation's BF16 results within one
    rounding of BF16: row-wise scales go to torch._scaled_mm as scale_a (M, 1) and scale_b (1, N).
    (No bias: _scaled_mm adds it rounded to BF16, the emulation in FP32.)"""
    recipe = fp8lm.Recipe.from_name(name)
    torch.manual_seed(0)
    emulated = FP8Linear(200, 96, bias=False, weight_grad_format="FP32", recipe=recipe.replace(backend="emulated"))
    fast = FP8Linear(200, 96, bias=False, weight_grad_format="FP32", recipe=recipe.replace(backend="scaled_mm"))
    fast.load_state_dict(emulated.state_dict())
    x, g = torch.randn(111, 200), torch.randn(111, 96)
    outs = []
    for layer in (emulated, fast):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xi)
        y.float().backward(g)
        outs.append((y.float(), xi.grad, layer.weight.grad.float()))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=2**-8, atol=1e-6)


def test_scaled_mm_takes_only_row_wise_e4m3_operands_with_a_bf16_result():
    from fp8lm.ops.finegrained import takes_rowwise_scaled_mm

    x, w = torch.randn(64, 128), torch.randn(32, 128)
    for name, expected in (("rowwise", True), ("blockwise", False), ("mxfp8", False)):
        recipe = fp8lm.Recipe.from_name(name)
        a, b = quantize_operand(x, recipe, "input"), quantize_operand(w, recipe, "weight").t()
        assert takes_rowwise_scaled_mm(a, b, torch.bfloat16) is expected
    rowwise = fp8lm.Recipe.from_name("rowwise")
    a, b = quantize_operand(x, rowwise, "input"), quantize_operand(w, rowwise, "weight").t()
    assert not takes_rowwise_scaled_mm(a, b, torch.float32)


def test_block_scaled_mm_takes_the_three_gemms_of_blockwise_and_nothing_else():
    """cuBLAS's block-scaled GEMM (DeepSeek-V3's layouts): 1 x 128 activations against 128 x 128
    weights (forward, input gradient) or against 1 x 128 activations (weight gradient, along the
    tokens); never on CPU, where torch has no kernel for it (the emulation runs)."""
    from fp8lm.ops.finegrained import block_scales_fit, takes_block_scaled_mm

    blockwise = fp8lm.Recipe.from_name("blockwise")
    x, w, g = torch.randn(256, 512), torch.randn(128, 512), torch.randn(256, 128)
    x_op, w_op = quantize_operand(x, blockwise, "input"), quantize_operand(w, blockwise, "weight")
    forward = (x_op, w_op.t())
    dgrad = (quantize_operand(g, blockwise, "grad_output"), w_op)  # K = 128: not a multiple of 512
    wgrad = (quantize_operand(g, blockwise, "grad_output", dim=0).t(), quantize_operand(x, blockwise, "input", dim=0))
    assert block_scales_fit(*forward, torch.bfloat16) and block_scales_fit(*wgrad, torch.float32)
    assert not block_scales_fit(*dgrad, torch.bfloat16)
    assert not block_scales_fit(*forward, torch.float16)
    assert not takes_block_scaled_mm(*forward, torch.bfloat16)  # a CPU tensor
    for name in ("rowwise", "mxfp8", "nvfp4"):
        recipe = fp8lm.Recipe.from_name(name)
        a, b = quantize_operand(x, recipe, "input"), quantize_operand(w, recipe, "weight").t()
        assert not block_scales_fit(a, b, torch.bfloat16), name
    # On CPU backend="scaled_mm" multiplies blockwise operands exactly (emulated), bit for bit.
    exact = fp8lm.ops.finegrained.block_mm(*forward, torch.bfloat16, backend="emulated")
    assert torch.equal(fp8lm.ops.finegrained.block_mm(*forward, torch.bfloat16, backend="scaled_mm"), exact)


def test_mx_scaled_mm_takes_the_three_gemms_of_mxfp8_and_its_scales_in_cublas_layout():
    from fp8lm.ops.finegrained import block_mm, mx_blocked_scales, mx_scales_fit, takes_mx_scaled_mm

    mx = fp8lm.Recipe.from_name("mxfp8")
    x, w, g = torch.randn(64, 96), torch.randn(64, 96), torch.randn(64, 64)
    forward = (quantize_operand(x, mx, "input"), quantize_operand(w, mx, "weight").t())
    dgrad = (quantize_operand(g, mx, "grad_output"), quantize_operand(w, mx, "weight", dim=0))
    wgrad = (quantize_operand(g, mx, "grad_output", dim=0).t(), quantize_operand(x, mx, "input", dim=0))
    for a, b in (forward, dgrad, wgrad):
        assert mx_scales_fit(a, b, torch.bfloat16) and not takes_mx_scaled_mm(a, b, torch.bfloat16)  # CPU
    blockwise = fp8lm.Recipe.from_name("blockwise")
    assert not mx_scales_fit(
        quantize_operand(x, blockwise, "input"), quantize_operand(w, blockwise, "weight").t(), torch.bfloat16
    )
    # On CPU the MX flag changes nothing: the emulation multiplies, bit for bit.
    exact = block_mm(*forward, torch.bfloat16)
    assert torch.equal(block_mm(*forward, torch.bfloat16, backend="scaled_mm", e8m0_scales=True), exact)
    # cuBLAS's layout: 128 x 4 tiles of scales, row r of a tile at (r % 32) * 16 + (r // 32) * 4 + column.
    rows, cols = 200, 6
    d = 2.0 ** (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) % 200 - 100)
    flat = mx_blocked_scales(d).view(torch.uint8)
    tiles_c = -(-cols // 4)
    assert flat.numel() == 256 * tiles_c * 4
    for r in range(rows):
        for c in range(cols):
            offset = ((r // 128) * tiles_c + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
            assert int(flat[offset]) == int(d[r, c].log2()) + 127
    assert int(flat.sum()) == int((d.log2() + 127).sum())  # the padding is zeros
    nan = torch.full((2, 3), float("nan"))
    assert bool((mx_blocked_scales(nan).view(torch.uint8)[[0, 1, 2, 16, 17, 18]] == 255).all())
    # Off the CPU it runs compiled: inductor's function gives the same bytes.
    from fp8lm.ops.finegrained import _blocked_e8m0

    assert torch.equal(torch.compile(_blocked_e8m0, dynamic=True)(d), flat)


def test_block_stats_count_what_the_blocks_lose():
    from fp8lm.telemetry import block_stats

    x = torch.ones(2, 64)
    x[0, 0] = 1e6  # one outlier: it flushes the 31 ones of its 1 x 32 block, not the others
    x[0, 40] = 1e-9  # below E4M3's range even in its own block (amax 1)
    stats = block_stats(x, fp8lm.Recipe.from_name("mxfp8"), "input")
    assert stats.underflow == pytest.approx(32 / 128) and stats.amax == 1e6
    assert stats.saturation == pytest.approx(1 / 128)  # 1e6 / 2**(19 - 8) = 488 > 448: saturates
    assert stats.scale == 2.0**-11
    tensorwise = fp8lm.telemetry.quantization_stats(x, fp8lm.E4M3, fp8lm.compute_scale(torch.tensor(1e6), fp8lm.E4M3))
    assert tensorwise.underflow == pytest.approx(127 / 128)  # one scale: every value but the outlier


def test_telemetry_records_block_stats_of_fine_grained_layers():
    from fp8lm.telemetry import Telemetry

    model = torch.nn.Sequential(FP8Linear(64, 32, recipe="blockwise"))
    telemetry = Telemetry(model, every=1)
    with telemetry.step(0):
        model(torch.randn(8, 64)).sum().backward()
    records = {r["kind"]: r for r in telemetry.after_backward()}
    assert {"input", "weight", "grad_output", "weight_grad"} <= set(records)
    assert records["grad_output"]["fmt"] == "E4M3" and records["input"]["underflow"] == 0.0
    assert all(r["amax_spread"] >= 0 for r in records.values() if r["kind"] != "weight_grad")


def test_telemetry_of_nvfp4_leaves_the_training_rounding_noise_alone():
    """nvfp4 rounds output gradients stochastically from torch's global generator: telemetry's
    own stochastic rounding draws from a generator of its own, so a run with telemetry takes the
    same rounding noise, and the same steps, as one without."""
    from fp8lm.telemetry import Telemetry, block_stats

    g = torch.randn(8, 64)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = block_stats(g, fp8lm.Recipe.from_name("nvfp4"), "grad_output")
    assert torch.equal(torch.get_rng_state(), before)
    assert block_stats(g, fp8lm.Recipe.from_name("nvfp4"), "grad_output") == first  # reproducible

    def train(telemetry_every: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(FP8Linear(64, 32, recipe="nvfp4"), FP8Linear(32, 16, recipe="nvfp4"))
        telemetry = Telemetry(model, every=telemetry_every) if telemetry_every else None
        grads = []
        for step in range(3):
            x = torch.randn(16, 64)
            if telemetry is None:
                model(x).square().sum().backward()
            else:
                with telemetry.step(step):
                    model(x).square().sum().backward()
                telemetry.after_backward()
            grads.append(model[0].weight.grad.detach().float().clone())
            model.zero_grad()
        return grads

    assert all(torch.equal(a, b) for a, b in zip(train(0), train(1)))


def test_block_amax_spread_is_the_binades_between_block_amaxes():
    from fp8lm.telemetry import block_amax_spread

    x = torch.ones(4, 64)
    x[0, :32] = 2.0**10  # the blocks (1 x 32): amaxes 1024, 1, 1, ... and one zero block
    x[3, 32:] = 0.0
    x[2, 40] = 2.0**-5
    assert block_amax_spread(x, "mxfp8", "input") == 10.0
    assert block_amax_spread(x, "rowwise", "input") == 10.0  # a row per block
    assert block_amax_spread(torch.ones(2, 64), "mxfp8", "input") == 0.0
    assert block_amax_spread(torch.zeros(2, 64), "mxfp8", "input") == 0.0
    x[1, 1] = float("nan")
    assert math.isnan(block_amax_spread(x, "mxfp8", "input"))
    g = torch.randn(256, 256, dtype=torch.float64) * torch.logspace(-8, 8, 256, base=2.0, dtype=torch.float64)[:, None]
    blocks = g.abs().reshape(2, 128, 2, 128).amax(dim=(1, 3))  # blockwise weight blocks, in float64
    assert block_amax_spread(g.float(), "blockwise", "weight") == pytest.approx(
        float(torch.log2(blocks.max() / blocks.min())), abs=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, recipe",
    [(["--fsdp"], "blockwise"), (["--fsdp"], "rowwise"), (["--tp", "2"], "blockwise"), (["--tp", "2"], "nvfp4")],
)
def test_two_ranks_train_with_a_fine_grained_recipe(tmp_path, email_corpus, layout, recipe):
    """FSDP2 (the tiny model's shards split its 128 x 128 blocks: gathered in FP16; rowwise: its
    rows' E4M3 operand and scales, tests/test_fsdp_recipes.py) and tensor parallelism run a
    fine-grained recipe in the training app; their numerics against one process are compared in
    tests/test_fsdp_recipes.py and tests/test_tensor_parallel.py, not here. nvfp4 under tensor
    parallelism: the telemetry of the head's vocabulary-sharded output gradient (a DTensor) reads
    this rank's shard (it stopped the first step before)."""
    import json
    import os
    import subprocess

    from dist_launch import forked_ranks

    out = tmp_path / "run"
    args = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--steps", "4", "--eval-batches", "2"]
    args += ["--data", email_corpus, "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--no-progress"]
    command = forked_ranks(2)
    command += ["-m", "fp8lm.cli", "train", "--opt-level", "O2", "--recipe", recipe, *layout, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < 5.6


def test_e8m0_codes_are_the_exponent_plus_127():
    from fp8lm.ops.block_scales import e8m0_codes

    exps = torch.tensor([-127, -126, -1, 0, 1, 127])
    d = torch.tensor([2.0**e for e in exps.tolist()], dtype=torch.float32)
    assert e8m0_codes(d).tolist() == [0, 1, 126, 127, 128, 254]
    assert e8m0_codes(torch.tensor([float("nan")])).item() == 255


def test_e8m0_values_decode_every_code_as_torch_does_and_compile():
    """`e8m0_values` (a gathered weight's E8M0 scale bytes to float32, from the bits) gives torch's
    own float8_e8m0fnu conversion for all 256 codes (the subnormal 2**-127 and NaN included),
    `e8m0_codes` takes it back, and inductor compiles it to the same bits."""
    from fp8lm.ops.block_scales import e8m0_codes, e8m0_values

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e8m0fnu).to(torch.float32)
    got = e8m0_values(codes)
    assert torch.equal(got.view(torch.int32)[:255], want.view(torch.int32)[:255])
    assert got[255].isnan() and want[255].isnan() and got[0].item() == 2.0**-127
    assert torch.equal(e8m0_codes(got), codes)
    compiled = torch.compile(e8m0_values, dynamic=True)(codes)
    assert torch.equal(compiled.view(torch.int32), got.view(torch.int32))


@pytest.mark.parametrize("name", ["rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_a_stored_weight_is_read_as_its_values_and_gets_its_gradient_stored(name):
    """`fine_grained_linear` on a stored weight (E4M3 payload and its scale, as O2 keeps it) gives
    the bits of the same layer on the weight's float32 values, and stores the weight's gradient
    as `_stored_weight_grad` does (E4M3 here): the values are read inside the quantization, never
    copied to float32 first."""
    from fp8lm.nn.finegrained import fine_grained_linear
    from fp8lm.nn.scale_math import _stored_weight_grad

    recipe = fp8lm.Recipe.from_name(name)
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(48, 64, generator=gen) * 0.05
    scale = torch.tensor(2.0**8)
    payload = (values * scale).to(torch.float8_e4m3fn)
    stored = fp8lm.ScalingTensor(payload, scale).requires_grad_()
    plain = (payload.to(torch.float32) / scale).requires_grad_()
    x = torch.randn(2, 40, 64, generator=gen, requires_grad=True)
    g = torch.randn(2, 40, 48, generator=gen)
    outputs, grads = [], []
    for weight, fmt in ((stored, fp8lm.E4M3), (plain, None)):
        torch.manual_seed(0)  # nvfp4: the same stochastic rounding noise
        y = fine_grained_linear(x, weight, None, recipe, weight_grad_format=fmt)
        y.backward(g)
        outputs.append(y.detach())
        grads.append((x.grad.clone(), weight.grad))
        x.grad = None
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(grads[0][0], grads[1][0])
    got, want = grads[0][1], _stored_weight_grad(grads[1][1], fp8lm.E4M3, torch.float32)
    assert isinstance(got, fp8lm.ScalingTensor) and got.fmt == fp8lm.E4M3
    assert torch.equal(got.payload.view(torch.uint8), want.payload.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("name", ["rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_no_rows_give_an_empty_output_and_zero_gradients(name):
    """An expert without tokens: no GEMM runs (nvfp4 has no tensor amax to scale an empty
    operand by); the output is (0, out), the weight's gradient zeros in its stored format."""
    from fp8lm.nn.finegrained import fine_grained_linear

    layer = FP8Linear(64, 32, recipe=name)
    x = torch.zeros(0, 64, requires_grad=True)
    y = fine_grained_linear(x, layer.weight, layer.bias, layer.recipe, weight_grad_format=layer.weight_grad_format)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 64)
    assert isinstance(layer.weight.grad, fp8lm.ScalingTensor) and not layer.weight.grad.dequantize().any()
    assert layer.bias.grad is not None and not layer.bias.grad.any()


def test_a_recipe_without_an_fp8_gemm_on_the_gpu_warns_once(monkeypatch):
    """A fine-grained recipe whose GEMMs a GPU has no kernel for (they would run emulated in
    FP32, slower than BF16) warns once per recipe and kind of GPU, naming where it runs in FP8;
    not where the kernel exists, not on the CPU, not when the emulation is asked for."""
    import warnings

    from fp8lm.ops import finegrained as fg

    monkeypatch.setattr(fg, "_checked_emulation", set())
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    cuda = torch.device("cuda", 0)
    mxfp8, blockwise, rowwise, nvfp4 = (fp8lm.Recipe.from_name(n) for n in ("mxfp8", "blockwise", "rowwise", "nvfp4"))
    with pytest.warns(UserWarning, match=r"recipe mxfp8 has no FP8 GEMM on cuda:0 \(compute capability 9\.0\)"):
        fg.warn_if_emulated(mxfp8, cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fg.warn_if_emulated(mxfp8, cuda)  # once
        for recipe in (rowwise, blockwise, mxfp8.replace(backend="emulated")):
            fg.warn_if_emulated(recipe, cuda)
        fg.warn_if_emulated(mxfp8, torch.device("cpu"))
    assert fg.fine_grained_kernel(blockwise, cuda) == "torch._scaled_mm with 1 x 128 / 128 x 128 block scales"
    capability[0] = (10, 0)  # a B200: MX and FP4 GEMMs, no block-scaled one
    assert fg.fine_grained_kernel(mxfp8, cuda) == "torch._scaled_mm with MX scales"
    assert fg.fine_grained_kernel(nvfp4, cuda) == "cuBLAS's FP4 GEMM"
    with pytest.warns(UserWarning, match=r"blockwise multiplies in FP8 on compute capability 9\.0"):
        fg.warn_if_emulated(blockwise, cuda)
    capability[0] = (8, 0)
    with pytest.warns(UserWarning, match=r"recipe nvfp4 .* 10\.0 and later, or 8\.9 / 9\.0 with Triton"):
        fg.warn_if_emulated(nvfp4, cuda)
