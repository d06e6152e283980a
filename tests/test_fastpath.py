"""FastPath: a failing fast path warns once, turns itself off and falls back with the same results;
the casts and the optimizer step use it."""

import warnings

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm.ops import cast, native
from fp8lm.ops.fastpath import FastPath
from fp8lm.optim import FP8AdamW, fused


def _boom(*args, **kwargs):
    raise RuntimeError("no compiler here")


def test_a_failing_fast_path_warns_once_and_falls_back():
    path = FastPath("test path", fallback="the plain one")
    calls = []

    def fast():
        calls.append("fast")
        raise RuntimeError("broken")

    with pytest.warns(UserWarning, match=r"test path unavailable \(RuntimeError: broken\); using the plain one"):
        assert path.run(fast, lambda: 42) == 42
    assert not path.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert path.run(fast, lambda: 43) == 43
    assert calls == ["fast"]  # never retried


def test_a_working_fast_path_is_used_and_the_environment_switch_turns_it_off(monkeypatch):
    path = FastPath("test path", fallback="plain")
    assert path.run(lambda: "fast", lambda: "plain") == "fast" and path.enabled
    monkeypatch.setenv("FP8LM_TEST_SWITCH", "0")
    off = FastPath("test path", fallback="plain", env_switch="FP8LM_TEST_SWITCH")
    assert not off.enabled and off.run(_boom, lambda: "plain") == "plain"
    monkeypatch.setenv("FP8LM_TEST_SWITCH", "1")
    assert FastPath("test path", fallback="plain", env_switch="FP8LM_TEST_SWITCH").enabled


def test_cast_falls_back_to_eager_ops_with_the_same_bits(monkeypatch):
    monkeypatch.setattr(native.KERNELS, "enabled", False)  # the compiled cast serves where the C kernels do not
    monkeypatch.setattr(cast.FUSED_CAST, "enabled", True)
    monkeypatch.setattr(cast, "_fused", _boom)
    x = torch.randn(cast.FUSED_MIN_NUMEL) * 300
    expected = (x * 2.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    with pytest.warns(UserWarning, match="fused cast unavailable"):
        out = cast.saturating_cast(x, torch.tensor(2.0), fp8lm.E4M3)
    assert not cast.FUSED_CAST.enabled
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def _trained(kernel):
    torch.manual_seed(0)
    params = [nn.Parameter(fp8lm.quantize(torch.randn(64, 32) * 0.1, fp8lm.FP16)), nn.Parameter(torch.randn(32))]
    opt = FP8AdamW(params, lr=1e-2, kernel=kernel)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
        opt.step()
    return params, opt


def test_optimizer_step_falls_back_to_eager_ops_with_the_same_results(monkeypatch):
    monkeypatch.setattr(fused.COMPILED_STEP, "enabled", True)
    monkeypatch.setattr(fused, "_compiled", _boom)
    with pytest.warns(UserWarning, match="compiled optimizer step unavailable"):
        params, opt = _trained("compile")
    assert not fused.COMPILED_STEP.enabled
    ref_params, ref_opt = _trained("eager")
    assert torch.equal(params[0].payload, ref_params[0].payload) and torch.equal(params[0].scale, ref_params[0].scale)
    assert torch.equal(params[1], ref_params[1])
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(opt.state[params[0]][key].float(), ref_opt.state[ref_params[0]][key].float()), key
