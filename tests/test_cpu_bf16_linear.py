"""CPUBF16Linear: BF16-autocast F.linear as an FP32 GEMM of BF16-rounded operands."""

import torch
import torch.nn.functional as F

from fp8lm.ops import gemm
from fp8lm.ops.gemm import CPUBF16Linear, _bf16_linear, bf16_gemm_is_fast, emulation_dtype


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 48, generator=g, requires_grad=True)
    w = torch.randn(32, 48, generator=g, requires_grad=True)
    b = torch.randn(32, generator=g, requires_grad=True)
    return x, w, b


def _float64_reference(x, w, b):
    """What a BF16 GEMM with exact accumulation gives: BF16 operands, one final rounding."""
    r = [t.detach().to(torch.bfloat16).double() for t in (x, w, b)]
    return (r[0] @ r[1].T + r[2]).to(torch.bfloat16)


def test_emulated_linear_rounds_like_a_bf16_gemm():
    x, w, b = _inputs()
    out = _bf16_linear(x, w, b)
    assert out.dtype == torch.bfloat16
    ref = _float64_reference(x, w, b)
    # FP32 accumulation vs exact: at most one BF16 rounding step apart
    ulp = ref.float().abs().clamp_min(1e-3) * 2.0**-7
    assert ((out.float() - ref.float()).abs() <= ulp).all()


def test_emulated_gradients_match_autocast_within_bf16_rounding():
    x, w, b = _inputs(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(x, w, b)
    ref.float().square().sum().backward()
    ref_grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    _bf16_linear(x, w, b).float().square().sum().backward()
    for got, want in zip((x.grad, w.grad, b.grad), ref_grads):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)


def test_mode_routes_linear_only_without_bf16_gemm(monkeypatch):
    x, w, b = _inputs(2)
    calls = []
    monkeypatch.setattr(gemm, "_bf16_linear", lambda *a, **k: calls.append(1) or F.linear(*a, **k))
    monkeypatch.setattr(gemm, "_CPU_HAS_BF16_GEMM", False)
    with torch.autocast("cpu", dtype=torch.bfloat16), CPUBF16Linear():
        F.linear(x, w, b)
    with CPUBF16Linear():  # no autocast: untouched
        F.linear(x, w, b)
    assert calls == [1]
    monkeypatch.setattr(gemm, "_CPU_HAS_BF16_GEMM", True)
    with torch.autocast("cpu", dtype=torch.bfloat16), CPUBF16Linear():
        assert F.linear(x, w, b).dtype == torch.bfloat16
    assert calls == [1]
    assert emulation_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert bf16_gemm_is_fast("meta")


def test_emulation_dtype_is_fp32_where_bf16_gemms_are_slow(monkeypatch):
    monkeypatch.setattr(gemm, "_CPU_HAS_BF16_GEMM", False)
    assert emulation_dtype(torch.bfloat16, "cpu") == torch.float32
    assert emulation_dtype(torch.float32, "cpu") == torch.float32


def test_mode_routes_conv1d_addmm_as_a_linear_of_the_transposed_weight(monkeypatch):
    """Hugging Face GPT-2's ``Conv1D``: ``torch.addmm(bias, x, weight)`` with ``weight`` stored
    ``[in, out]`` is the emulated linear of ``weight.t()``, values and gradients; an ``addmm`` with
    ``beta``/``alpha`` or a matrix bias is left to torch."""
    monkeypatch.setattr(gemm, "_CPU_HAS_BF16_GEMM", False)
    x, w, b = _inputs(3)
    w_in_out = w.detach().t().contiguous().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), CPUBF16Linear():
        out = torch.addmm(b, x, w_in_out)
    assert out.dtype == torch.bfloat16
    ulp = _float64_reference(x, w, b).float().abs().clamp_min(1e-3) * 2.0**-7
    assert ((out.float() - _float64_reference(x, w, b).float()).abs() <= ulp).all()
    out.float().square().sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    _bf16_linear(x2, w2, b2).float().square().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(b.grad, b2.grad)
    assert torch.equal(w_in_out.grad, w2.grad.t())
    calls = []
    monkeypatch.setattr(gemm, "_bf16_linear", lambda *a, **k: calls.append(1) or F.linear(*a, **k))
    with torch.autocast("cpu", dtype=torch.bfloat16), CPUBF16Linear():
        torch.addmm(b, x, w_in_out, beta=0.5)
        torch.addmm(torch.zeros(64, 32), x, w_in_out)
    assert calls == []
