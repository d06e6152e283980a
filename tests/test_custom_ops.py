"""torch.ops.fp8lm: every custom op passes torch.library.opcheck and gives the numbers of fp8lm.ops.cast."""

import copy

import pytest
import torch

from fp8lm.formats import format_of
from fp8lm.ops import cast as cast_ops
from fp8lm.ops import library
from fp8lm.optim.functional import adam_hyperparams
from fp8lm.optim.fused import amaxes_pass, write_pass

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
        for x in (_x().reshape(64, 64), _x(dtype=torch.bfloat16).reshape(32, 128), _x(6).reshape(2, 3)):
            yield "cast_transposed", (x, scale, dtype)
        yield "amax", (_x(),)
        for x in (_x().reshape(32, 128), _x(dtype=torch.bfloat16).reshape(128, 32)):
            group = x.shape[-1]
            scales = torch.full((x.numel() // group,), 4.0)
            yield "group_amax", (x, group)
            yield "group_cast", (x, scales, group, dtype)
            yield "group_upcast", (cast_ops.saturating_cast(x, scale, format_of(dtype)), scales, group, torch.bfloat16)
    for state in (_adam_state(torch.float16, torch.float32), _adam_state(torch.float8_e4m3fn, torch.float16)):
        w, g, m, v, scales, new_scales, hyperparams = state
        yield "adam_step", state
        yield "adam_amaxes", (w, g, m, v, scales, hyperparams)


def _adam_state(m_dtype, v_dtype, sizes=(1000, 37)):
    """Lists of two tensors' payloads (FP16 weight, E4M3 gradient, moments of the given dtypes),
    their scales (n, 4: w, g, m, v), new scales (n, 3) and step-3 AdamW coefficients (n, 8)."""
    gen = torch.Generator().manual_seed(0)
    w, g, m, v = [], [], [], []
    for n in sizes:
        w.append((torch.randn(n, generator=gen) * 64).half())
        g.append((torch.randn(n, generator=gen) * 8).to(torch.float8_e4m3fn))
        m.append((torch.randn(n, generator=gen) * 16).to(m_dtype))
        v.append((torch.rand(n, generator=gen) * 32).to(v_dtype))
    scales = torch.tensor([[64.0, 8.0, 16.0, 4096.0]] * len(sizes))
    new_scales = torch.tensor([[32.0, 8.0, 2048.0]] * len(sizes))
    row = adam_hyperparams(1e-2, (0.9, 0.999), 1e-8, 0.1, decoupled=True, step=3)
    hyperparams = torch.tensor([row] * len(sizes))
    return w, g, m, v, scales, new_scales, hyperparams


def test_every_op_is_listed():
    assert sorted(library.OPS) == [
        "adam_amaxes",
        "adam_step",
        "amax",
        "cast",
        "cast_dequantized",
        "cast_transposed",
        "cast_with_amax",
        "group_amax",
        "group_cast",
        "group_upcast",
        "upcast",
    ]
    for name in library.OPS:
        assert getattr(torch.ops.fp8lm, name).default.name() == f"fp8lm::{name}"


@pytest.mark.parametrize("name, args", list(_samples()), ids=lambda v: v if isinstance(v, str) else None)
def test_opcheck(name, args):
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if name in ("upcast", "group_upcast") or name.startswith("adam"):
        tests = tests[1:]  # the schema check compares inputs before and after with mul, which float8 lacks
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
        payload2d, transposed, x_amax = torch.ops.fp8lm.cast_transposed(x.reshape(64, 64), scale, dtype)
        assert torch.equal(payload2d.view(torch.uint8), expected.view(torch.uint8).reshape(64, 64))
        assert transposed.is_contiguous() and torch.equal(transposed.view(torch.uint8), payload2d.view(torch.uint8).t())
        assert x_amax.item() == 1e6
    assert torch.ops.fp8lm.amax(torch.tensor([1.0, -3.0, float("nan")])).isnan()
    nan_in = torch.tensor([float("inf"), 1.0])
    assert torch.ops.fp8lm.cast(nan_in, torch.tensor(1.0), FP8[0]).float()[0].isnan()  # inf stays visible as NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_cast_gives_the_column_sums_of_a_bias_gradient(dtype):
    """``sums_dtype``: ``x.sum(0)`` rounded to ``x``'s dtype, as ``g.sum(0)`` gives a bias gradient."""
    g = (torch.randn(300, 40, dtype=torch.float64) * 3).to(dtype)
    _, _, x_amax, sums = cast_ops.saturating_cast_transposed(
        g, torch.tensor(1.0), format_of(FP8[1]), True, torch.float32
    )
    reference = g.double().sum(0)
    assert sums is not None and sums.dtype == torch.float32 and x_amax is not None
    torch.testing.assert_close(
        sums.double(), reference.to(dtype).double(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=1e-5
    )
    assert x_amax.item() == g.abs().max().item()
    with pytest.raises(ValueError, match="takes a 2-D tensor"):
        cast_ops.saturating_cast_transposed(g.reshape(-1), torch.tensor(1.0), format_of(FP8[0]))


def test_ops_trace_as_single_nodes():
    def f(x, scale):
        payload, x_amax = torch.ops.fp8lm.cast_with_amax(x, scale, torch.float8_e4m3fn)
        return torch.ops.fp8lm.upcast(payload, scale.reciprocal(), torch.float32), x_amax

    x, scale = _x(), torch.tensor(8.0)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (eager_y, eager_amax), (y, y_amax) = f(x, scale), compiled(x, scale)
    assert torch.equal(y, eager_y) and torch.equal(y_amax, eager_amax)


def _pass_args(state, i):
    w, g, m, v, scales, _, hyperparams = state
    w_scale, g_scale, m_scale, v_scale = scales[i].unbind()
    return w[i], w_scale, g[i], g_scale, m[i], m_scale, v[i], v_scale, hyperparams[i]


@pytest.mark.parametrize("m_dtype, v_dtype", [(torch.float16, torch.float32), (torch.float8_e4m3fn, torch.float16)])
def test_adam_ops_give_the_numbers_of_the_torch_passes(m_dtype, v_dtype):
    """The C kernel (the ops' CPU kernel) against the passes in torch ops (their CUDA kernel)."""
    state = _adam_state(m_dtype, v_dtype)
    w, g, m, v, scales, new_scales, hyperparams = state
    amaxes = torch.ops.fp8lm.adam_amaxes(w, g, m, v, scales, hyperparams)
    expected = [copy.deepcopy(_pass_args(state, i)) for i in range(len(w))]
    for i, args in enumerate(expected):
        torch.testing.assert_close(amaxes[i], amaxes_pass(*args), rtol=2**-23, atol=0)
    stored = torch.ops.fp8lm.adam_step(w, g, m, v, scales, new_scales, hyperparams)
    for i, args in enumerate(expected):
        fmts = tuple(format_of(t.dtype) for t in (w[i], m[i], v[i]))
        write_pass(*args, new_scales[i], fmts)
        for got, want in ((w[i], args[0]), (m[i], args[4]), (v[i], args[6])):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        payload_amaxes = [t.float().abs().max() for t in (w[i], m[i], v[i])]
        assert stored[i].tolist() == [a.item() for a in payload_amaxes]


def test_adam_step_refuses_lists_of_different_lengths():
    w, g, m, v, scales, new_scales, hyperparams = _adam_state(torch.float16, torch.float32)
    with pytest.raises(ValueError, match="must list the same tensors"):
        torch.ops.fp8lm.adam_step(w, g[:1], m, v, scales, new_scales, hyperparams)
