"""Optimizer checkpoints: exact round trip through torch.load(weights_only=True), bit-exact resume."""

import io

import pytest
import torch
from torch import nn

import fp8lm
from fp8lm.nn import load_scaling_state_dict, scaling_state_dict
from fp8lm.optim import FP8AdamW


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _assert_equal_nested(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.float(), b.float())
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal_nested(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal_nested(x, y)
    else:
        assert a == b


def _mixed_params(seed=0):
    """An O2-style FP16 scaled weight, a plain FP32 vector and a BF16 matrix (FP16 master in state)."""
    torch.manual_seed(seed)
    return [
        nn.Parameter(fp8lm.quantize(torch.randn(24, 16) * 0.1, fp8lm.FP16)),
        nn.Parameter(torch.randn(16)),
        nn.Parameter(torch.randn(8, 8).bfloat16()),
    ]


def _give_grads(params, gen):
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        p.grad = fp8lm.quantize(g) if isinstance(p, fp8lm.ScalingTensor) else g.to(p.dtype)


def test_optimizer_state_dict_round_trips_exactly_with_weights_only():
    params = _mixed_params()
    opt = FP8AdamW(params, lr=1e-2, exp_avg_sq_dtype=fp8lm.E5M2, kernel="eager")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _give_grads(params, gen)
        opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["exp_avg_sq_dtype"] == "E5M2"
    assert "master" in saved["state"][2] and saved["state"][2]["master"].dtype == torch.float16
    loaded = _roundtrip(saved)

    fresh = FP8AdamW(_mixed_params(seed=5), lr=1.0, kernel="eager")
    fresh.load_state_dict(loaded)
    _assert_equal_nested(_roundtrip(opt.state_dict()), _roundtrip(fresh.state_dict()))
    assert fresh.param_groups[0]["lr"] == 1e-2
    # Loaded tensors are copies: stepping one optimizer leaves the other's state alone.
    assert fresh.state[fresh.param_groups[0]["params"][0]]["exp_avg"] is not loaded["state"][0]["exp_avg"]


def _batches(n, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(n)]


def _plain_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _save(model, opt, **extra):
    return _roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict(), **extra})


def test_plain_model_resume_is_bit_identical():
    batches = _batches(6)
    model = _plain_model()
    opt = FP8AdamW(model.parameters(), lr=1e-2, kernel="eager")
    _train(model, opt, batches)

    first = _plain_model()
    first_opt = FP8AdamW(first.parameters(), lr=1e-2, kernel="eager")
    _train(first, first_opt, batches[:3])
    ckpt = _save(first, first_opt)
    resumed = _plain_model()
    resumed_opt = FP8AdamW(resumed.parameters(), lr=1.0, kernel="eager")
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    _train(resumed, resumed_opt, batches[3:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def _fp8_model():
    model = _plain_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return fp8lm.initialize(model, opt, "O2", optimizer_options={"kernel": "eager"})


def test_fp8_model_resume_through_initialize_o2_is_bit_identical():
    batches = _batches(6)
    model, opt = _fp8_model()
    assert isinstance(opt, FP8AdamW) and isinstance(model[0], fp8lm.nn.FP8Linear)
    _train(model, opt, batches)

    first, first_opt = _fp8_model()
    _train(first, first_opt, batches[:3])
    ckpt = _save(first, first_opt, scaling=scaling_state_dict(first))
    resumed, resumed_opt = _fp8_model()
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    load_scaling_state_dict(resumed, ckpt["scaling"])
    _train(resumed, resumed_opt, batches[3:])
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        if isinstance(p, fp8lm.ScalingTensor):
            assert torch.equal(p.payload, q.payload) and torch.equal(p.scale, q.scale), name
        else:
            assert torch.equal(p, q), name
    _assert_equal_nested(_roundtrip(opt.state_dict()), _roundtrip(resumed_opt.state_dict()))


def _stepped(params):
    opt = FP8AdamW(params, kernel="eager")
    _give_grads(params, torch.Generator().manual_seed(0))
    opt.step()
    return opt


def test_mismatched_checkpoints_raise_and_change_nothing():
    opt = _stepped(_mixed_params())
    before = _roundtrip(opt.state_dict())

    other_groups = _stepped(_mixed_params()[:2]).state_dict()
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(other_groups)

    wrong_shape = _roundtrip(opt.state_dict())
    wrong_shape["state"][1]["exp_avg"] = torch.zeros(3, dtype=torch.float8_e4m3fn)
    wrong_shape["param_groups"][0]["lr"] = 123.0
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(wrong_shape)

    plain = torch.nn.Parameter(torch.randn(4))
    torch_adamw = torch.optim.AdamW([plain])
    plain.grad = torch.randn(4)
    torch_adamw.step()
    with pytest.raises(ValueError, match="another optimizer"):
        FP8AdamW([torch.nn.Parameter(torch.randn(4))]).load_state_dict(torch_adamw.state_dict())

    _assert_equal_nested(before, _roundtrip(opt.state_dict()))
