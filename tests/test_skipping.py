"""One contract for every fp8lm optimizer: a non-finite gradient skips the step, counted once in
``skipped_steps`` (saved in and restored from the state dict) and flagged in ``last_step_skipped``;
`fp8lm.clip_grad_norm_` accepts the optimizer."""

import io

import pytest
import torch
from torch import nn

import fp8lm
from dist_launch import run_workers
from fp8lm.optim import FP8Adam, FP8AdamW, SkipsNonFiniteSteps


def _model_and_optimizer(cls):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    model.weight = nn.Parameter(fp8lm.quantize(model.weight.detach(), fp8lm.FP16))
    return model, cls(model.parameters(), lr=1e-2, kernel="eager")


def _give_grads(model, step, bad=None):
    gen = torch.Generator().manual_seed(step)
    model.weight.grad = fp8lm.quantize(torch.randn(4, 8, generator=gen))
    model.bias.grad = torch.randn(4, generator=gen)
    if bad is not None:
        model.bias.grad[1] = bad


@pytest.mark.parametrize("cls", [FP8AdamW, FP8Adam])
def test_each_non_finite_step_is_counted_once_and_changes_nothing(cls):
    model, opt = _model_and_optimizer(cls)
    assert isinstance(opt, SkipsNonFiniteSteps) and opt.skipped_steps == 0 and not opt.last_step_skipped
    history = []
    for step, bad in enumerate([None, float("nan"), float("inf"), None, float("-inf")]):
        _give_grads(model, step, bad)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        history.append((opt.skipped_steps, opt.last_step_skipped))
        if bad is not None:
            assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    assert history == [(0, False), (1, True), (2, True), (2, False), (3, True)]
    assert opt.state[model.bias]["step"] == 2  # only the applied steps


@pytest.mark.parametrize("cls", [FP8AdamW, FP8Adam])
def test_skipped_steps_round_trip_through_the_state_dict(cls):
    model, opt = _model_and_optimizer(cls)
    for step, bad in enumerate([None, float("nan"), float("inf")]):
        _give_grads(model, step, bad)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["skipped_steps"] == 2
    _, fresh = _model_and_optimizer(cls)
    fresh.load_state_dict(saved)
    assert fresh.skipped_steps == 2
    saved.pop("skipped_steps")  # a state dict from before the counter was saved: starts at 0
    fresh.load_state_dict(saved)
    assert fresh.skipped_steps == 0


def test_clip_grad_norm_accepts_an_fp8_optimizer_and_clips_its_parameters():
    model, opt = _model_and_optimizer(FP8AdamW)
    twin, _ = _model_and_optimizer(FP8AdamW)
    _give_grads(model, 0)
    _give_grads(twin, 0)
    total = fp8lm.clip_grad_norm_(opt, 0.5)
    assert torch.equal(total, fp8lm.clip_grad_norm_(twin.parameters(), 0.5))
    assert torch.equal(model.bias.grad, twin.bias.grad)
    assert torch.equal(model.weight.grad.dequantize(), twin.weight.grad.dequantize())
    assert torch.equal(opt.clip_grad_norm_(0.5), fp8lm.clip_grad_norm_(twin.parameters(), 0.5))
    with pytest.raises(ValueError, match="max_norm"):
        fp8lm.clip_grad_norm_(opt, -1.0)


def test_clip_grad_norm_of_a_torch_optimizer_clips_its_parameters():
    model, _ = _model_and_optimizer(FP8AdamW)
    _give_grads(model, 0)
    expected = torch.linalg.vector_norm(torch.cat([model.weight.grad.dequantize().view(-1), model.bias.grad]))
    total = fp8lm.clip_grad_norm_(torch.optim.SGD(model.parameters(), lr=0.1), 1e9)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_zero_optimizer_counts_skips_on_every_rank_and_saves_the_count(tmp_path):
    ranks = run_workers("dist_skipping.py", 2, str(tmp_path / "ckpt"))
    for r in ranks:
        assert r["skipped"] == [0, 1, 1, 2, 2]
        assert r["last"] == [False, True, False, True, False]
        assert r["saved_count"] == r["loaded_count"] == r["checkpoint_count"] == 2
    assert ranks[0]["global_norm"] == ranks[1]["global_norm"] > 1e-3  # the global norm, not a shard's
    for r in ranks:
        assert r["clipped_norm"] == pytest.approx(1e-3, rel=1e-4)
