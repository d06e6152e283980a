import pytest
import torch

import fp8lm
from fp8lm.policy import FP8_LEVELS, ParamPrecision, Policy, preset

W = torch.zeros(4, 4)
V = torch.zeros(4)


def test_presets():
    o1, o2, o3 = (preset(level) for level in FP8_LEVELS)
    assert o1.linear == ParamPrecision(fp8lm.FP32, fp8lm.E4M3, None, fp8lm.FP32, fp8lm.FP32)  # FP8 GEMMs and grads
    assert o1.precision("wte.weight", W, in_linear=False).weight == fp8lm.FP32  # O1: only linears change
    assert o2.linear == ParamPrecision(fp8lm.FP16, fp8lm.E4M3, None, fp8lm.E4M3, fp8lm.FP16)
    assert o2.precision("wte.weight", W, in_linear=False) == o2.linear  # O2 covers embeddings too
    small = o2.precision("ln.weight", V, in_linear=False)
    assert small.weight == fp8lm.FP32 and small.grad == fp8lm.FP32 and not small.scaled_weight
    assert o3.linear.weight == fp8lm.E4M3 and o3.linear.master == fp8lm.FP16
    assert all(p.gemm_in_fp8("any.layer") for p in (o1, o2, o3))


def test_unknown_level():
    with pytest.raises(ValueError, match="O1, O2, O3"):
        preset("O4")


def test_overrides_by_name_pattern_later_wins():
    policy = (
        preset("O2")
        .override("lm_head", fp8_gemm=False, weight=fp8lm.FP32, grad="FP32")
        .override("blocks.*.mlp.*", exp_avg=fp8lm.FP16)
        .override("blocks.1.mlp.fc", exp_avg_sq=torch.float32, exp_avg="BF16")
    )
    assert not policy.gemm_in_fp8("lm_head") and policy.gemm_in_fp8("blocks.0.attn")
    head = policy.precision("lm_head.weight", W, in_linear=True)
    assert head.weight == fp8lm.FP32 and head.grad == fp8lm.FP32 and head.exp_avg == fp8lm.E4M3
    assert policy.precision("blocks.0.mlp.fc.weight", W, True).exp_avg == fp8lm.FP16
    fc1 = policy.precision("blocks.1.mlp.fc.weight", W, True)
    assert fc1.exp_avg == fp8lm.BF16 and fc1.exp_avg_sq == fp8lm.FP32
    # a pattern can name a parameter too
    bias = preset("O2").override("*.bias", weight=fp8lm.FP16).precision("blocks.0.mlp.fc.bias", V, False)
    assert bias.scaled_weight
    assert preset("O2").overrides == ()  # policies are immutable


def test_with_linear_changes_only_the_linear_layers_defaults():
    o1 = preset("O1")
    fp16 = o1.with_linear(weight="FP16")
    assert fp16.linear == ParamPrecision(fp8lm.FP16, fp8lm.E4M3, None, fp8lm.FP32, fp8lm.FP32)
    assert fp16.precision("blocks.0.attn.c_attn.weight", W, in_linear=True).scaled_weight
    assert not fp16.precision("wte.weight", W, in_linear=False).scaled_weight  # embeddings stay FP32
    assert not fp16.precision("blocks.0.attn.c_attn.bias", V, in_linear=False).scaled_weight
    # overrides still win over it
    assert fp16.override("lm_head", weight="FP32").precision("lm_head.weight", W, in_linear=True).weight == fp8lm.FP32
    assert o1.linear.weight == fp8lm.FP32  # policies are immutable
    with pytest.raises(ValueError, match=r"unknown precision field\(s\) \['wieght'\]: use weight, grad"):
        o1.with_linear(wieght="FP16")
    with pytest.raises(ValueError, match="unknown format"):
        o1.with_linear(weight="E2M5")


def test_bad_overrides():
    with pytest.raises(ValueError, match="unknown precision field"):
        preset("O1").override("lm_head", wieght=fp8lm.FP32)
    with pytest.raises(ValueError, match="unknown format"):
        preset("O1").override("lm_head", weight="E2M5")
    with pytest.raises(ValueError, match="pattern"):
        preset("O1").override("", weight=fp8lm.FP32)
    with pytest.raises(ValueError, match="fp8_gemm"):
        preset("O1").override("x", fp8_gemm="no")
    with pytest.raises(ValueError, match="unknown activations 'e5m2': use one of bf16, fp8"):
        preset("O2").override("x", activations="e5m2")
    with pytest.raises(ValueError, match="unknown format"):
        ParamPrecision(fp8lm.FP16, None, None, fp8lm.E4M3, fp8lm.FP16)


def test_policy_is_a_value():
    assert isinstance(preset("O1"), Policy)
    assert preset("O2") == preset("O2")
    assert hash(preset("O2").override("x", fp8_gemm=False))


@pytest.mark.parametrize("level", FP8_LEVELS)
def test_output_head_has_bf16_gemms_and_a_bf16_weight_gradient(level):
    policy = preset(level)
    head = policy.precision("lm_head.weight", W, in_linear=True, output_head=True)
    assert head == ParamPrecision(
        policy.linear.weight, fp8lm.BF16, policy.linear.master, policy.linear.exp_avg, policy.linear.exp_avg_sq
    )
    assert not policy.gemm_in_fp8("lm_head", output_head=True)
    assert policy.gemm_in_fp8("lm_head")  # not the head: unchanged
    assert policy.precision("lm_head.weight", W, in_linear=True) == policy.linear
    for plain in (preset(level, output_head=False), policy.without_output_head()):
        assert plain.precision("lm_head.weight", W, in_linear=True, output_head=True) == plain.linear
        assert plain.gemm_in_fp8("lm_head", output_head=True)
    # overrides by name win over the head rule
    e4m3 = policy.override("lm_head", grad="E4M3").precision("lm_head.weight", W, True, output_head=True)
    assert e4m3.grad == fp8lm.E4M3
    assert policy.override("lm_head", fp8_gemm=True).gemm_in_fp8("lm_head", output_head=True)


def test_saved_activations_follow_the_level_then_the_overrides_by_module_name():
    o2 = preset("O2").override("*.mlp.*", activations="bf16").override("blocks.1.mlp.act", activations="fp8")
    assert [o2.saved_activations(n) for n in ("blocks.0.ln_1", "blocks.0.mlp.act", "blocks.1.mlp.act")] == [
        "fp8",
        "bf16",
        "fp8",
    ]
    o1 = preset("O1").override("ln_f", activations="fp8")
    assert (o1.saved_activations("ln_f"), o1.saved_activations("blocks.0.ln_1")) == ("fp8", "bf16")
    # an activations override changes no parameter's formats and no layer's GEMMs
    assert o2.precision("blocks.0.mlp.c_fc.weight", torch.empty(4, 4), in_linear=True) == preset("O2").linear
    assert o2.gemm_in_fp8("blocks.0.mlp.c_fc")
