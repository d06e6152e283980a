"""torch.ops.fp8lm: every custom op passes torch.library.opcheck and gives the numbers of fp8lm.ops.cast."""

import pytest
import torch

from fp8lm.formats import format_of
from fp8lm.ops import cast as cast_ops
from fp8lm.ops import library

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _x(n=4096, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(n, dtype=torch.float32) * 30
    x[:3] = torch.tensor([1e6, -1e6, 0.0])  # saturating values
    return x.to(dtype)


def _samples():
    scale = torch.tensor(4.0)
    for dtype in FP8:
        for x in (_x(), _x(dtype=torch.bfloat16), _x(6).reshape(2, 3)):
            yield "cast", (x, scale, dtype)
            yield "cast_with_amax", (x, scale, dtype)
            yield "cast_dequantized", (x, scale, torch.tensor(0.25), dtype, torch.float32)
            yield "upcast", (cast_ops.saturating_cast(x, scale, format_of(dtype)), torch.tensor(0.5), torch.bfloat16)
        yield "amax", (_x(),)


def test_every_op_is_listed():
    assert sorted(library.OPS) == ["amax", "cast", "cast_dequantized", "cast_with_amax", "upcast"]
    for name in library.OPS:
        assert getattr(torch.ops.fp8lm, name).default.name() == f"fp8lm::{name}"


@pytest.mark.parametrize("name, args", list(_samples()), ids=lambda v: v if isinstance(v, str) else None)
def test_opcheck(name, args):
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if name == "upcast":  # the schema check compares inputs before and after with mul, which float8 lacks
        tests = tests[1:]
    torch.library.opcheck(getattr(torch.ops.fp8lm, name).default, args, test_utils=tests)


def test_numbers_match_the_casts():
    x, scale = _x(), torch.tensor(2.0)
    for dtype in FP8:
        fmt = format_of(dtype)
        expected = cast_ops.saturating_cast(x, scale, fmt)
        assert torch.equal(torch.ops.fp8lm.cast(x, scale, dtype).view(torch.uint8), expected.view(torch.uint8))
        payload, x_amax = torch.ops.fp8lm.cast_with_amax(x, scale, dtype)
        assert torch.equal(payload.view(torch.uint8), expected.view(torch.uint8)) and x_amax.item() == 1e6
        _, deq, _ = torch.ops.fp8lm.cast_dequantized(x, scale, scale.reciprocal(), dtype, torch.float32)
        assert torch.equal(deq, expected.float() / 2.0)
    assert torch.ops.fp8lm.amax(torch.tensor([1.0, -3.0, float("nan")])).isnan()
    nan_in = torch.tensor([float("inf"), 1.0])
    assert torch.ops.fp8lm.cast(nan_in, torch.tensor(1.0), FP8[0]).float()[0].isnan()  # inf stays visible as NaN


def test_ops_trace_as_single_nodes():
    def f(x, scale):
        payload, x_amax = torch.ops.fp8lm.cast_with_amax(x, scale, torch.float8_e4m3fn)
        return torch.ops.fp8lm.upcast(payload, scale.reciprocal(), torch.float32), x_amax

    x, scale = _x(), torch.tensor(8.0)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (eager_y, eager_amax), (y, y_amax) = f(x, scale), compiled(x, scale)
    assert torch.equal(y, eager_y) and torch.equal(y_amax, eager_amax)
