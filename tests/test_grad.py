import pytest
import torch
from torch import nn

import fp8lm
from fp8lm import ScalingTensor, quantize


def params_with_grads(seed=0, fmt=fp8lm.E4M3):
    """Three parameters: an FP8 gradient, an E5M2 one and a plain one; and plain float copies."""
    g = torch.Generator().manual_seed(seed)
    params, plain = [], []
    for i, shape in enumerate([(32, 16), (8, 8), (5,)]):
        p = nn.Parameter(torch.randn(shape, generator=g))
        grad = torch.randn(shape, generator=g) * (i + 1)
        if i == 0:
            p.grad = quantize(grad, fmt)
        elif i == 1:
            p.grad = quantize(grad, fp8lm.E5M2)
        else:
            p.grad = grad
        params.append(p)
        q = nn.Parameter(p.detach().clone())
        q.grad = p.grad.dequantize() if isinstance(p.grad, ScalingTensor) else p.grad.clone()
        plain.append(q)
    return params, plain


@pytest.mark.parametrize("fmt", [fp8lm.E4M3, fp8lm.BF16])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_matches_torch_on_the_same_values(norm_type, fmt):
    """Also for a gradient stored in BF16 (the output head's by default), whose scale comes from
    BF16's float32-sized range: dividing it by the coefficient must not overflow to zeros."""
    params, plain = params_with_grads(fmt=fmt)
    total = fp8lm.clip_grad_norm_(params, 1.0, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(plain, 1.0, norm_type)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for p, q in zip(params, plain):
        got = p.grad.dequantize() if isinstance(p.grad, ScalingTensor) else p.grad
        torch.testing.assert_close(got, q.grad, rtol=1e-6, atol=1e-7)
    assert isinstance(params[0].grad, ScalingTensor) and params[0].grad.payload.dtype == fmt.dtype


def test_clipping_an_fp8_gradient_keeps_its_payload():
    params, _ = params_with_grads()
    payload = params[0].grad.payload.clone()
    before = params[0].grad.dequantize()
    fp8lm.clip_grad_norm_(params, 0.5)
    assert torch.equal(params[0].grad.payload, payload)  # only the scale changed: no requantization
    ratio = params[0].grad.dequantize()[before != 0] / before[before != 0]
    torch.testing.assert_close(ratio, torch.full_like(ratio, ratio[0].item()), rtol=1e-6, atol=0)


def test_a_scale_clipped_past_float32_makes_the_step_skip_not_zero():
    p = nn.Parameter(torch.zeros(4))
    p.grad = quantize(torch.full((4,), 0.5), fp8lm.BF16)
    fp8lm.clip_grad_norm_([p], 1e-30)  # the scale divided by 1e-30 exceeds float32
    assert torch.isnan(p.grad.scale) and not fp8lm.grads_are_finite([p])


def test_no_clipping_below_max_norm_and_empty():
    params, plain = params_with_grads()
    total = fp8lm.clip_grad_norm_(params, 1e6)
    for p, q in zip(params, plain):
        got = p.grad.dequantize() if isinstance(p.grad, ScalingTensor) else p.grad
        torch.testing.assert_close(got, q.grad, rtol=1e-6, atol=0)
    assert total > 1
    assert fp8lm.clip_grad_norm_([nn.Parameter(torch.zeros(3))], 1.0).item() == 0.0


def test_torch_clip_grad_norm_also_works_on_fp8_gradients():
    params, plain = params_with_grads()
    total = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(plain, 1.0), rtol=1e-6, atol=0)
    assert isinstance(params[0].grad, ScalingTensor)
    torch.testing.assert_close(params[0].grad.dequantize(), plain[0].grad, rtol=2**-3, atol=0)


def test_clip_bad_input_and_nonfinite():
    params, _ = params_with_grads()
    with pytest.raises(ValueError, match="max_norm"):
        fp8lm.clip_grad_norm_(params, -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        fp8lm.clip_grad_norm_(params, 1.0, norm_type=0)
    params[2].grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        fp8lm.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def test_grads_are_finite():
    params, _ = params_with_grads()
    model = nn.Module()
    model.p = params[0]
    assert fp8lm.grads_are_finite(params)
    assert fp8lm.grads_are_finite(model)
    assert fp8lm.grads_are_finite(torch.optim.SGD(params, lr=0.1))
    assert fp8lm.grads_are_finite([nn.Parameter(torch.zeros(2))])  # no gradient: nothing to check
    e4m3 = quantize(torch.tensor([1.0, float("nan")]))
    assert not fp8lm.grads_are_finite([_with_grad(e4m3)])
    e5m2 = ScalingTensor(torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2), torch.tensor(1.0))
    assert not fp8lm.grads_are_finite([_with_grad(e5m2)])
    assert not fp8lm.grads_are_finite([_with_grad(torch.tensor([0.0, float("-inf")]))])


def _with_grad(grad):
    p = nn.Parameter(torch.zeros(grad.shape))
    p.grad = grad
    return p


def test_zero_grad():
    params, _ = params_with_grads()
    fp8lm.zero_grad(params, set_to_none=False)
    assert isinstance(params[0].grad, ScalingTensor)
    assert not params[0].grad.payload.float().any() and not params[2].grad.any()
    model = nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    fp8lm.zero_grad(model)
    assert model.weight.grad is None and model.bias.grad is None
