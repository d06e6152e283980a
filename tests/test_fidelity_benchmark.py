"""benchmarks/fidelity.py: every ablation variant builds the model it names, and the gap table's
arithmetic (gaps to bf16 per seed, mean, spread, mean minus fp32's)."""

import importlib.util
import json
import statistics

import pytest
import torch

import fp8lm
from fp8lm.bench import scripts_dir
from fp8lm.train.model import GPT, preset


def _fidelity():
    spec = importlib.util.spec_from_file_location("fidelity", scripts_dir() / "fidelity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fidelity = _fidelity()


# Variants that spell out today's defaults (kept for the measurements made before the head rule).
# variants that spell out a default (the output head's BF16 GEMMs and weight gradient)
_DEFAULTS = {
    "O1",
    "O2",
    "O1-head-grad-bf16",
    "O2-head-grad-bf16",
    "O1-head-gemm-bf16",
    "O2-head-gemm-bf16",
    "O1-master-fp32",
    "O2-act-fp8",  # O2's default since its 5-seed comparison
}


def _signature(variant: str, arch: str = "gpt") -> list:
    """What a variant decides, after one training step: the layers (GEMM precision, recipe) and
    each parameter's, gradient's and optimizer state's type and format."""
    torch.manual_seed(0)
    level, options = fidelity.variant_options(variant)
    model = GPT(preset("small", n_layer=1, arch=arch))
    model, opt = fp8lm.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level, **options)
    x = torch.randint(0, 256, (2, 16))
    model(x, x)[1].backward()
    opt.step()

    def kind(t):
        return None if t is None else (type(t).__name__, t.dtype, str(getattr(t, "fmt", "")))

    params = [
        (n, kind(p), kind(p.grad), sorted((k, kind(v)) for k, v in opt.state[p].items() if torch.is_tensor(v)))
        for n, p in model.named_parameters()
    ]
    return [repr(model), params]


@pytest.mark.parametrize("variant", [v for v, (level, _) in fidelity.VARIANTS.items() if level not in ("bf16", "fp32")])
def test_every_variant_changes_what_it_names(variant):
    same = _signature(variant) == _signature(fidelity.VARIANTS[variant][0])
    assert same == (variant in _DEFAULTS), variant


@pytest.mark.parametrize("variant", ["O2-master-fp32", "O2-gemm-bf16", "O2-attn-gemm-bf16", "O2-mlp-hp"])
def test_the_llama_probes_variants_change_the_llama_model(variant):
    # their patterns name GPT's modules (attn.*, mlp.*), which --arch llama keeps
    assert _signature(variant, "llama") != _signature("O2", "llama")


def test_arch_reaches_every_job_and_the_main_job_stays_gpt():
    args = fidelity.parser().parse_args(["--arch", "llama", "--init-from", "x.pt", "--lr", "4e-4"])
    assert fidelity.train_options(args) == {**fidelity._continuation(args), "arch": "llama"}
    assert fidelity.train_options(fidelity.parser().parse_args([])) == {}


def test_summary_gaps_means_and_the_fp32_floor():
    rows = {}
    losses = {"bf16": [2.0, 4.0], "fp32": [2.02, 4.0], "O2": [2.04, 4.04]}
    for variant, values in losses.items():
        for seed, loss in enumerate(values):
            rows[(variant, seed, 500)] = {"val_loss": loss, "bytes_per_param": 6.0}
    table = fidelity.summarize(rows, ["fp32", "O2"], [0, 1], 500)
    assert table["fp32"]["gaps_pct"] == {"0": 1.0, "1": 0.0}
    assert table["O2"]["gaps_pct"] == {"0": 2.0, "1": 1.0}
    assert table["O2"]["mean_pct"] == 1.5 and table["O2"]["std_pct"] == round(statistics.stdev([2.0, 1.0]), 3)
    assert table["O2"]["above_fp32_pct"] == 1.0
    assert torch.tensor(table["fp32"]["above_fp32_pct"]) == 0
    assert table["O2"]["paired_above_fp32"] == {"mean_pct": 1.0, "std_pct": 0.0, "stderr_pct": 0.0, "seeds": 2}


def test_paired_difference_to_fp32_uses_the_seeds_both_ran():
    rows = {("bf16", s, 500): {"val_loss": 2.0, "bytes_per_param": 16.0} for s in range(3)}
    rows |= {("fp32", s, 500): {"val_loss": v, "bytes_per_param": 16.0} for s, v in enumerate([2.02, 2.0, 2.04])}
    rows |= {("O2", s, 500): {"val_loss": v, "bytes_per_param": 6.0} for s, v in enumerate([2.04, 2.0])}
    table = fidelity.summarize(rows, ["fp32", "O2"], [0, 1, 2], 500)
    assert table["O2"]["above_fp32_pct"] == 0.0  # means over 2 seeds against 3: blurred
    assert table["O2"]["paired_above_fp32"] == {
        "mean_pct": 0.5,
        "std_pct": round(statistics.stdev([1.0, 0.0]), 3),
        "stderr_pct": round(statistics.stdev([1.0, 0.0]) / 2**0.5, 3),
        "seeds": 2,
    }


def test_long_runs_also_average_the_gap_over_the_last_80_percent_of_evaluations(tmp_path):
    curves = {  # val_loss at steps 1000..5000 (step 500 is before the window)
        "bf16": {500: 9.0, 1000: 2.0, 3000: 2.0, 5000: 1.0},
        "fp32": {500: 1.0, 1000: 2.02, 3000: 2.0, 5000: 1.0},
        "O1": {500: 1.0, 1000: 2.04, 3000: 2.02, 5000: 1.03},
    }
    rows = {}
    for variant, curve in curves.items():
        out = tmp_path / variant
        out.mkdir()
        lines = [{"step": s, "train_loss": 3.0} for s in range(1, 5001, 999)]
        lines += [{"step": s, "train_loss": 3.0, "val_loss": v} for s, v in curve.items()]
        (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        rows[(variant, 0, 5000)] = {"val_loss": curve[5000], "bytes_per_param": 16.0, "out": str(out)}
    table = fidelity.summarize(rows, ["fp32", "O1"], [0], 5000)
    assert table["O1"]["gaps_from_step_1000_pct"] == {"0": 2.0}  # (2 + 1 + 3) / 3
    assert table["fp32"]["mean_from_step_1000_pct"] == round(1 / 3, 3)
    assert table["O1"]["above_fp32_from_step_1000_pct"] == round(2 - 1 / 3, 3)
    assert table["O1"]["gaps_pct"] == {"0": 3.0}  # the final evaluation alone


@pytest.mark.parametrize(("variant", "bf16_layers"), [("O2-nvfp4-last-mlp-bf16", 2), ("O2-nvfp4-last-block-bf16", 4)])
def test_nvfp4_selective_precision_keeps_the_main_jobs_last_layers_in_bf16(variant, bf16_layers):
    level, options = fidelity.variant_options(variant)
    model, _ = fp8lm.initialize(GPT(preset("small")), None, level, **options)  # the main job's 4 blocks
    blocks = {
        n: m.fp8_enabled for n, m in model.named_modules() if n.startswith("blocks.") and hasattr(m, "fp8_enabled")
    }
    assert len(blocks) == 16 and [n for n, on in blocks.items() if not on][0].startswith("blocks.3.")
    assert sum(not on for on in blocks.values()) == bf16_layers
    assert all(m.recipe.name == "nvfp4" for m in model.modules() if hasattr(m, "fp8_enabled"))


def test_mxfp8_rceil_variants_change_only_the_scale_rounding():
    _, options = fidelity.variant_options("O2-mxfp8-rceil")
    assert options["recipe"] == fp8lm.Recipe.from_name("mxfp8").replace(mx_rounding="rceil")
    _, head = fidelity.variant_options("O2-mxfp8-rceil-head-fp8")
    assert head["recipe"] == options["recipe"] and head["policy"] == fp8lm.policy.preset("O2", output_head=False)


@pytest.mark.parametrize(("variant", "kind"), [("O2-nvfp4-attn-bf16", ".attn."), ("O2-nvfp4-mlp-bf16", ".mlp.")])
def test_nvfp4_layer_kind_probes_keep_that_kinds_gemms_in_bf16_and_the_rest_4_bit(variant, kind):
    level, options = fidelity.variant_options(variant)
    model, _ = fp8lm.initialize(GPT(preset("small")), None, level, **options)
    blocks = {
        n: m.fp8_enabled for n, m in model.named_modules() if n.startswith("blocks.") and hasattr(m, "fp8_enabled")
    }
    assert len(blocks) == 16 and all(on == (kind not in n) for n, on in blocks.items())
    assert all(m.recipe.name == "nvfp4" for m in model.modules() if hasattr(m, "fp8_enabled"))


def test_nvfp4_wgrad_probe_changes_only_the_weight_gradient_gemm():
    _, options = fidelity.variant_options("O2-nvfp4-wgrad-bf16")
    assert options["recipe"] == fp8lm.Recipe.from_name("nvfp4").replace(weight_grad_gemm="bf16")
    assert "policy" not in options


def test_a_variants_train_fields_reach_its_run_and_not_initialize():
    from dataclasses import fields

    from fp8lm.train.config import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    for variant in fidelity.VARIANTS:
        assert set(fidelity.variant_train_fields(variant)) <= names, variant
        assert "train" not in fidelity.variant_options(variant)[1], variant
    assert fidelity.variant_train_fields("O2-nvfp4-final-bf16") == {"final_bf16_fraction": 0.2}
    assert fidelity.variant_train_fields("O2-nvfp4") == {}


def test_eval_bf16_recomputes_the_runs_validation_with_bf16_gemms(tmp_path):
    from test_train import EMAIL

    rows = {}
    for variant in ("bf16", "O1"):
        job = {
            "variant": variant,
            "seed": 0,
            "steps": 2,
            "out": str(tmp_path / variant),
            "cache_dir": str(tmp_path / "cache"),
            "train": {"model": "tiny", "data": EMAIL, "batch_size": 4, "seq_len": 32, "eval_batches": 2},
        }
        rows[(variant, 0, 2)] = fidelity._run(job)
    table = fidelity.eval_bf16(rows, ["bf16", "O1"], [0], 2)
    # the bf16 run's own validation, recomputed exactly (eval_bf16 refuses a mismatch)
    assert table["losses"]["bf16 seed 0"]["bf16_gemms"] == rows[("bf16", 0, 2)]["val_loss"]
    o1 = table["losses"]["O1 seed 0"]
    assert o1["val_loss"] == rows[("O1", 0, 2)]["val_loss"] and o1["bf16_gemms"] != o1["val_loss"]
    assert table["variants"]["O1"]["gaps_pct"]["0"] == round(
        100 * (o1["bf16_gemms"] / rows[("bf16", 0, 2)]["val_loss"] - 1), 3
    )
