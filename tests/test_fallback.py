import pytest
import torch

import fp8lm
from fp8lm.fallback import FallbackPolicy, PrecisionFallback
from fp8lm.telemetry import Telemetry


def _run(model, telemetry, fallback, steps, grad_weights):
    events = []
    for step in range(steps):
        with telemetry.step(step):
            (model(torch.randn(16, 32)) * grad_weights).sum().backward()
        events += fallback.update(telemetry.after_backward())
        model.zero_grad()
    return events


def test_layer_with_underflowing_gradients_moves_to_bf16_and_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    model, _ = fp8lm.initialize(model, None, opt_level="O1")
    telemetry = Telemetry(model, every=1)
    fallback = PrecisionFallback(telemetry.layers, FallbackPolicy(underflow=0.05, patience=2))

    wide = torch.logspace(-12, 0, 32)  # output gradients spanning 2^-40 .. 1: E5M2 loses the small ones
    events = _run(model, telemetry, fallback, 3, wide)
    assert [(e["layer"], e["to"]) for e in events] == [("2", "bf16")]
    assert events[0]["step"] == 1 and "output-gradient underflow" in events[0]["reason"]
    assert telemetry.layers["2"].high_precision and not telemetry.layers["0"].high_precision

    # The switched layer runs in high precision: its output is the exact F.linear, and its weight
    # gradient keeps the small channels that FP8 flushed to zero.
    hidden = torch.randn(16, 64)
    exact = torch.nn.functional.linear(hidden, model[2].weight, model[2].bias)  # O1: a plain FP32 weight
    assert torch.equal(model[2](hidden), exact)
    (model(torch.randn(16, 32)) * wide).sum().backward()
    grad = model[2].weight.grad
    assert type(grad) is torch.Tensor and grad[0].abs().min() > 0
    model.zero_grad()

    events = _run(model, telemetry, fallback, 2, torch.ones(32))  # gradients back in range
    assert [(e["layer"], e["to"]) for e in events] == [("2", "fp8")]
    assert not telemetry.layers["2"].high_precision
    assert [e["to"] for e in fallback.events] == ["bf16", "fp8"]

    state = fallback.state_dict()
    other = PrecisionFallback(telemetry.layers)
    other.load_state_dict(state)
    assert other.events == fallback.events
    with pytest.raises(ValueError, match="layers this model does not have"):
        other.load_state_dict({"high_precision": {"nope": False}, "events": []})


@pytest.mark.parametrize(
    "kwargs, match",
    [({"underflow": 0}, "fractions"), ({"recover_below": 1.0}, "recover_below"), ({"patience": 0}, "patience")],
)
def test_policy_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FallbackPolicy(**kwargs)


def test_layer_whose_stored_weight_gradient_underflows_moves_to_bf16_and_back():
    # An output head's case: output-gradient channels over seven decades. E5M2 keeps them all
    # (no output-gradient underflow), but the per-tensor E4M3 weight gradient flushes the rows of
    # the small channels to zero.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    policy = fp8lm.policy.preset("O1", output_head=False)  # the head rule would store it in BF16
    model, _ = fp8lm.initialize(model, None, opt_level="O1", policy=policy)
    telemetry = Telemetry(model, every=1)
    fallback = PrecisionFallback(telemetry.layers, FallbackPolicy(weight_grad_underflow=0.1, patience=2))

    decades = torch.logspace(-7, 0, 32)
    events = _run(model, telemetry, fallback, 3, decades)
    assert [(e["layer"], e["to"]) for e in events] == [("2", "bf16")]
    assert events[0]["step"] == 1 and "weight-gradient underflow" in events[0]["reason"]

    # In high precision the weight gradient is measured as E4M3 would store it: still over.
    with telemetry.step(3):
        (model(torch.randn(16, 32)) * decades).sum().backward()
    (record,) = [r for r in telemetry.after_backward() if r["layer"] == "2" and r["kind"] == "weight_grad"]
    assert type(model[2].weight.grad) is torch.Tensor and record["underflow"] > 0.1
    model.zero_grad()

    events = _run(model, telemetry, fallback, 2, torch.ones(32))
    assert [(e["layer"], e["to"]) for e in events] == [("2", "fp8")]
    assert "weight-gradient underflow" in events[0]["reason"]
