"""The C kernels of the group-scaled casts (``csrc/groups.c``) against `fp8lm.nn.saved`'s torch
expressions: the same payload bytes (NaN codes aside: both are NaN), scales and read-back values."""

import pytest
import torch

from fp8lm.formats import E4M3, E5M2
from fp8lm.nn import saved
from fp8lm.ops import native

pytestmark = pytest.mark.skipif(not native.available(), reason="fp8lm's C kernels cannot be built here")


def torch_path(monkeypatch, fn, *args):
    with monkeypatch.context() as m:
        m.setattr(native, "available", lambda: False)
        return fn(*args)


def awkward(shape, dtype, seed=0):
    """Rows spanning 1e-12 .. 1e12, values that round to E4M3/E5M2 subnormals, ties, zero rows,
    and groups holding inf, -inf or NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-12, 12, shape[0]).unsqueeze(-1)
    x[1] = 0.0
    x[2, : shape[1] // 2] = torch.arange(shape[1] // 2) * 2.0**-12  # many subnormals after scaling
    x[3, 0], x[4, -1], x[5, 1] = float("inf"), -float("inf"), float("nan")
    x[6] = torch.tensor([1.0, 1.0625, 1.1875, -1.0625] * (shape[1] // 4 + 1))[: shape[1]]  # E4M3 ties
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("columns, group", [(384, 128), (32, 128), (96, 32), (1000, 128), (1536, 1536)])
def test_group_casts_equal_the_torch_expressions(monkeypatch, dtype, fmt, columns, group):
    x = awkward((12, columns), dtype)
    payload, scale = saved.quantize_groups(x, fmt, group)
    want_payload, want_scale = torch_path(monkeypatch, saved.quantize_groups, x, fmt, group)
    assert payload.shape == want_payload.shape and scale.shape == want_scale.shape
    assert torch.equal(scale.isnan(), want_scale.isnan())
    assert torch.equal(scale.nan_to_num(), want_scale.nan_to_num())
    got, want = payload.float(), want_payload.float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(payload.view(torch.uint8)[~got.isnan()], want_payload.view(torch.uint8)[~want.isnan()])
    for out in (torch.float32, torch.bfloat16):
        back = saved.dequantize_groups(payload, scale, out)
        want_back = torch_path(monkeypatch, saved.dequantize_groups, want_payload, want_scale, out)
        assert back.dtype == out and torch.equal(back.isnan(), want_back.isnan())
        assert torch.equal(back.nan_to_num(), want_back.nan_to_num())


def test_a_strided_input_is_quantized_as_its_values(monkeypatch):
    x = awkward((8, 64), torch.bfloat16).view(8, 2, 32).transpose(0, 1)  # not contiguous
    payload, scale = saved.quantize_groups(x)
    want_payload, want_scale = torch_path(monkeypatch, saved.quantize_groups, x)
    assert torch.equal(
        saved.dequantize_groups(payload, scale, torch.float32).nan_to_num(),
        saved.dequantize_groups(want_payload, want_scale, torch.float32).nan_to_num(),
    )
