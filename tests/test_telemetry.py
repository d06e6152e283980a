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
