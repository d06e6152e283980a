import pytest
import torch

import fp8lm
from fp8lm.telemetry import quantization_stats, stored_stats


def test_quantization_stats_counts_underflow_and_saturation():
    fmt = fp8lm.E4M3
    x = torch.tensor([0.0, 1e-6, -1e-6, 1.0, -2.0, 1000.0, -1000.0, 3.0])
    stats = quantization_stats(x, fmt, scale=1.0)
    # 2 of the 7 non-zero values round to zero; 2 of the 8 values are clipped to the max (448).
    assert stats.underflow == pytest.approx(2 / 7)
    assert stats.saturation == pytest.approx(2 / 8)
    assert stats.amax == 1000.0 and stats.scale == 1.0


def test_quantization_stats_agree_with_the_real_cast():
    torch.manual_seed(0)
    x = torch.randn(10000) * torch.logspace(-8, 2, 10000)
    for fmt in (fp8lm.E4M3, fp8lm.E5M2):
        scale = torch.tensor(4.0)
        q = fp8lm.quantize(x, fmt, scale=scale)
        stats = quantization_stats(x, fmt, scale)
        lost = ((q.payload.float() == 0) & (x != 0)).sum().item() / (x != 0).sum().item()
        clipped = ((x * scale).abs() > fmt.max).sum().item() / x.numel()
        at_max = (q.payload.float().abs() == fmt.max).sum().item() / x.numel()
        assert stats.underflow == pytest.approx(lost) and stats.saturation == pytest.approx(clipped)
        assert stored_stats(q).saturation == pytest.approx(at_max) and at_max >= clipped


def test_stats_of_empty_and_zero_tensors():
    assert quantization_stats(torch.zeros(0), fp8lm.E4M3, 1.0).underflow == 0.0
    s = stored_stats(fp8lm.quantize(torch.zeros(4)))
    assert s.underflow == 1.0 and s.saturation == 0.0 and s.amax == 0.0


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def test_telemetry_records_every_kind_on_sampled_steps_only():
    from fp8lm.telemetry import KINDS, Telemetry

    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8lm.initialize(model, opt, opt_level="O2")
    telemetry = Telemetry(model, opt, every=2)
    per_step = []
    for step in range(3):
        with telemetry.step(step):
            model(torch.randn(16, 32)).square().mean().backward()
        records = telemetry.after_backward()
        opt.step()
        opt.zero_grad()
        records += telemetry.after_optimizer_step()
        per_step.append(records)
    assert per_step[1] == []
    for step in (0, 2):
        kinds = {(r["layer"], r["kind"]) for r in per_step[step]}
        assert kinds == {(layer, kind) for layer in ("0", "2") for kind in KINDS}
        assert all(r["step"] == step and 0 <= r["underflow"] <= 1 and 0 <= r["saturation"] <= 1 for r in per_step[step])
    # Hooks are gone after the window: an unsampled step leaves no hooks behind.
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_telemetry_leaves_layer_outputs_as_they_are():
    # A module's full backward hook would return each FP8 layer's output as a view: an in-place op on
    # it (a residual `y += x`) would then fail, and FSDP2 warns when it is the model's output.
    from fp8lm.telemetry import Telemetry

    model = _tiny_model()
    model, _ = fp8lm.initialize(model, None, opt_level="O2")
    telemetry = Telemetry(model, every=1)
    x = torch.randn(16, 32)
    with telemetry.step(0):
        out = model(x)
        assert out._base is None
        out += x  # in place on the last FP8 layer's output
        out.square().mean().backward()
    records = telemetry.after_backward()
    grad_outputs = [r for r in records if r["kind"] == "grad_output"]
    assert sorted(r["layer"] for r in grad_outputs) == ["0", "2"]  # each recorded once


def test_telemetry_sees_underflowing_gradients():
    from fp8lm.telemetry import Telemetry, worst

    model = _tiny_model()
    model, _ = fp8lm.initialize(model, None, opt_level="O1")
    telemetry = Telemetry(model, every=1)
    for step in range(3):
        with telemetry.step(step):
            out = model(torch.randn(16, 32))
            # Output gradients spanning 2^-40 .. 1: the small ones fall below E5M2's range.
            (out * torch.logspace(-12, 0, 32)).sum().backward()
        records = telemetry.after_backward()
    top = worst([r for r in records if r["kind"] == "grad_output"], "underflow", top=1)[0]
    assert top["layer"] == "2" and top["underflow"] > 0.1


def test_telemetry_rejects_bad_interval():
    from fp8lm.telemetry import Telemetry

    with pytest.raises(ValueError, match="interval must be >= 1"):
        Telemetry(_tiny_model(), every=0)
