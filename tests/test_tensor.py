import copy
import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8lm
from fp8lm import ScalingTensor, quantize

MIN_NORMAL = {fp8lm.E4M3: 2.0**-6, fp8lm.E5M2: 2.0**-14}
REL_BOUND = {fp8lm.E4M3: 2.0**-4, fp8lm.E5M2: 2.0**-3}


@settings(max_examples=200, deadline=None)
@given(
    magnitude=st.floats(min_value=1e-6, max_value=1e6),
    values=st.lists(st.floats(min_value=-1.0, max_value=1.0, allow_subnormal=False), min_size=1, max_size=64),
    fmt=st.sampled_from([fp8lm.E4M3, fp8lm.E5M2]),
)
def test_round_trip_relative_error_of_in_range_values(magnitude, values, fmt):
    x = torch.tensor(values, dtype=torch.float64) * magnitude
    q = quantize(x.float(), fmt)
    back = q.dequantize(torch.float64)
    scaled = x.abs() * q.scale.double()
    in_range = scaled >= MIN_NORMAL[fmt]  # normal after scaling: no subnormal or underflow
    rel = ((back - x).abs() / x.abs())[in_range]
    # float32 input rounding adds ~2^-24, far below the FP8 bounds.
    assert rel.numel() == 0 or rel.max().item() <= REL_BOUND[fmt] + 2.0**-20
    # The scale fits the tensor: the largest value never saturates.
    assert scaled.max() <= fmt.max


def test_quantize_fields_and_dtype():
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    q = quantize(x, fp8lm.E5M2)
    assert isinstance(q, torch.Tensor) and isinstance(q, ScalingTensor)
    assert q.dtype == torch.bfloat16 and q.shape == x.shape
    assert q.payload.dtype == torch.float8_e5m2 and q.fmt is fp8lm.E5M2
    assert q.scale.dtype == torch.float32 and q.scale.shape == ()
    assert torch.equal(q.scale_inv * q.scale, torch.tensor(1.0))
    assert q.dequantize().dtype == torch.float32


def test_explicit_scale_and_saturation():
    x = torch.tensor([1e6, -1e6, 1.0, 0.0])
    q = quantize(x, fp8lm.E4M3, scale=1.0)
    assert q.dequantize().tolist() == [448.0, -448.0, 1.0, 0.0]
    q = quantize(x, fp8lm.E5M2, scale=torch.tensor(2.0))
    assert q.dequantize().tolist() == [28672.0, -28672.0, 1.0, 0.0]


@pytest.mark.parametrize("fmt", [fp8lm.E4M3, fp8lm.E5M2, fp8lm.FP16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_infinite_values_stay_visible(fmt, dtype, scale):
    # Saturated to the format's max, an inf would pass every later finiteness check.
    x = torch.tensor([1.0, float("inf"), 2.0, float("-inf"), 1e30, float("nan")], dtype=dtype)
    got = quantize(x, fmt, scale=scale).dequantize()
    assert got[[0, 2]].tolist() == [1.0, 2.0]
    assert torch.isnan(got[[1, 3, 5]]).all()
    assert got[4] == fmt.max  # a finite overflow still saturates (the inf amax keeps scale 1)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (torch.arange(4), TypeError, "floating-point tensor, got torch.int64.*x.float"),
        ([1.0, 2.0], TypeError, "expects a torch.Tensor, got list"),
    ],
)
def test_quantize_rejects_bad_input(bad, error, match):
    with pytest.raises(error, match=match):
        quantize(bad)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan"), torch.ones(2)])
def test_quantize_rejects_bad_scale(scale):
    with pytest.raises(ValueError, match="scale must be one finite positive number"):
        quantize(torch.ones(3), scale=scale)


def test_quantize_rejects_unknown_format():
    with pytest.raises(ValueError, match="unknown format"):
        quantize(torch.ones(3), "E2M1")


def _same(a: ScalingTensor, b: ScalingTensor) -> bool:
    return (
        type(a) is type(b) is ScalingTensor
        and a.dtype == b.dtype
        and torch.equal(a.payload.view(torch.uint8), b.payload.view(torch.uint8))
        and torch.equal(a.scale, b.scale)
    )


def test_save_load_including_weights_only():
    q = quantize(torch.randn(8, 8))
    for weights_only in (False, True):
        buf = io.BytesIO()
        torch.save({"q": q}, buf)
        buf.seek(0)
        assert _same(torch.load(buf, weights_only=weights_only)["q"], q)


def test_deepcopy_detach_to_clone_are_independent_copies():
    q = quantize(torch.randn(8, 8))
    for other in (copy.deepcopy(q), q.clone(), q.to("cpu", copy=True)):
        assert _same(other, q)
        assert other.payload.data_ptr() != q.payload.data_ptr()
    assert _same(q.detach(), q)
    assert q.detach().payload.data_ptr() == q.payload.data_ptr()


def test_to_another_dtype_dequantizes():
    x = torch.randn(4, 4)
    q = quantize(x)
    h = q.to(torch.float16)
    assert type(h) is torch.Tensor and h.dtype == torch.float16
    assert torch.equal(h, q.dequantize(torch.float16))


def test_views_split_and_cat_keep_payload_and_scale():
    x = torch.randn(8, 6)
    q = quantize(x)
    ref = q.dequantize()
    for view, expected in [
        (q.t(), ref.t()),
        (q[2:5], ref[2:5]),
        (q.view(6, 8), ref.view(6, 8)),
        (q.reshape(48), ref.reshape(48)),
        (q[1], ref[1]),
        (q.unsqueeze(0), ref.unsqueeze(0)),
    ]:
        assert isinstance(view, ScalingTensor)
        assert torch.equal(view.dequantize(), expected)
    parts = q.split(3)
    assert all(isinstance(p, ScalingTensor) for p in parts)
    joined = torch.cat(parts)
    assert isinstance(joined, ScalingTensor) and _same(joined.contiguous(), q)
    # Different scales cannot share a payload: the result is the exact dequantized values.
    mixed = torch.cat([q, quantize(x * 1000)])
    assert type(mixed) is torch.Tensor
    assert torch.equal(mixed, torch.cat([ref, quantize(x * 1000).dequantize()]))


def test_other_ops_compute_on_dequantized_values():
    x = torch.randn(16, 16)
    q = quantize(x)
    ref = q.dequantize()
    out = q @ torch.eye(16) + 1
    assert type(out) is torch.Tensor and torch.equal(out, ref @ torch.eye(16) + 1)
    assert torch.equal(torch.zeros_like(q), torch.zeros(16, 16)) and type(torch.zeros_like(q)) is torch.Tensor
    assert torch.equal(q.norm(), ref.norm())


def test_inplace_ops_requantize_with_a_fitting_scale():
    x = torch.randn(64)
    q = quantize(x, fp8lm.E4M3)
    old_scale = q.scale.item()
    expected = q.dequantize() * 100
    assert q.mul_(100) is q
    assert isinstance(q, ScalingTensor) and q.payload.dtype == torch.float8_e4m3fn
    assert q.scale.item() < old_scale  # rescaled to the larger amax, not saturated
    in_range = expected.abs() * q.scale >= 2.0**-6
    rel = (q.dequantize() - expected).abs() / expected.abs()
    assert rel[in_range].max() <= 2.0**-4


def test_multiplying_by_a_positive_number_folds_into_the_scale():
    """``t.mul_(c)`` keeps the payload and divides the scale by c (exact); a negative factor is
    requantized instead."""
    q = quantize(torch.randn(64), fp8lm.FP16)
    payload, value = q.payload.clone(), q.dequantize()
    q.mul_(0.9999)
    assert torch.equal(q.payload, payload)
    torch.testing.assert_close(q.dequantize(), value * 0.9999, rtol=2e-7, atol=0)
    q.mul_(-2.0)
    assert not torch.equal(q.payload, payload)
    torch.testing.assert_close(q.dequantize(), value * 0.9999 * -2.0, rtol=2.0**-10, atol=1e-6)


def test_adamw_weight_decay_acts_on_fp16_stored_weights():
    """AdamW multiplies the weight by ``1 - lr * wd`` (here 1 - 1e-4), then adds the update: on a
    weight stored in FP16, rounding the product alone would give the weight back every step, and
    the decay would never act. It must shrink the weight as it shrinks an FP32 one."""

    def norm_ratio(stored_in_fp16: bool) -> float:
        norms = []
        for weight_decay in (0.0, 0.1):
            torch.manual_seed(0)
            w = torch.randn(64, 64) * 0.05
            p = torch.nn.Parameter(quantize(w, fp8lm.FP16) if stored_in_fp16 else w)
            opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=weight_decay)
            gen = torch.Generator().manual_seed(1)
            for _ in range(300):
                p.grad = torch.randn(64, 64, generator=gen) * 1e-2
                opt.step()
            norms.append(float(p.detach().float().norm()))
        return norms[1] / norms[0]

    fp32, fp16 = norm_ratio(False), norm_ratio(True)
    assert fp32 < 0.98  # the decay's effect: about 3 %
    assert abs(fp16 - fp32) < 0.002


def test_inplace_add_of_two_scaling_tensors_accumulates():
    a = quantize(torch.randn(128), fp8lm.E4M3)
    b = quantize(torch.randn(128) * 50, fp8lm.E4M3)
    expected = a.dequantize() + b.dequantize()
    a += b
    assert isinstance(a, ScalingTensor)
    err = (a.dequantize() - expected).abs() / expected.abs().max()
    assert err.max() <= 2.0**-4


def test_copy_into_scaling_tensor_and_out_of_it():
    q = quantize(torch.zeros(4, 4), fp8lm.FP16)
    src = torch.randn(4, 4)
    q.copy_(src)
    assert torch.allclose(q.dequantize(), src, rtol=2.0**-11, atol=0)
    plain = torch.empty(4, 4)
    plain.copy_(q)
    assert torch.equal(plain, q.dequantize())
    other = quantize(torch.randn(4, 4), fp8lm.FP16)
    q.copy_(other)
    assert _same(q, other)


def test_inplace_op_on_a_view_keeps_the_other_elements():
    """A view shares its base's scale: writing one row (a larger or a smaller amax) must leave
    the other rows' values as they were (power-of-two rescaling is exact here)."""
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5], [0.25, 1.5, -1.0, 2.0]])
    for fmt, rtol in ((fp8lm.E4M3, 2.0**-4), (fp8lm.FP16, 2.0**-11)):  # half a unit in the last place
        for factor in (100.0, -0.01):
            q = quantize(x, fmt)
            before = q.dequantize()
            q[0].mul_(factor)
            after = q.dequantize()
            assert torch.equal(after[1], before[1]), (fmt, factor)
            expected = (before[0].double() * factor).float()
            torch.testing.assert_close(after[0], expected, rtol=rtol, atol=0)


def test_copy_into_a_view_keeps_the_other_elements():
    q = quantize(torch.tensor([[1.0, -2.0, 3.0], [0.25, 1.5, -1.0], [2.0, -0.5, 0.75]]), fp8lm.E4M3)
    before = q.dequantize()
    row = quantize(torch.tensor([40.0, -12.0, 7.0]), fp8lm.E4M3)  # another scale
    q[1].copy_(row)
    after = q.dequantize()
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    torch.testing.assert_close(after[1], row.dequantize(), rtol=2.0**-4, atol=0)


def test_view_over_zero_padding_rescales_as_the_whole_tensor():
    """FSDP2 keeps a shard as the leading rows of a zero-padded buffer: writing the shard view
    gives the scale and payload that writing an unpadded tensor gives."""
    value = torch.randn(3, 4) * 300
    padded = quantize(torch.zeros(4, 4), fp8lm.E4M3)
    shard = padded[:3]
    shard.copy_(value)
    alone = quantize(torch.zeros(3, 4), fp8lm.E4M3)
    alone.copy_(value)
    assert torch.equal(shard.scale, alone.scale)
    assert torch.equal(shard.dequantize(), alone.dequantize())
    assert torch.equal(padded.dequantize()[3], torch.zeros(4))
    # AdamW's decay factor folds into the scale, exact, as for the whole tensor.
    payload = shard.payload.clone()
    shard.mul_(0.9999)
    assert torch.equal(shard.payload, payload)
    torch.testing.assert_close(shard.dequantize(), alone.dequantize() * 0.9999, rtol=2e-7, atol=0)


def test_parameter_of_scaling_tensor():
    p = torch.nn.Parameter(quantize(torch.randn(4, 4), fp8lm.FP16))
    assert isinstance(p, ScalingTensor) and isinstance(p, torch.nn.Parameter) and p.requires_grad
    before = p.dequantize()
    with torch.no_grad():
        p.add_(1.0)
    assert torch.allclose(p.dequantize(), before + 1, rtol=2.0**-10)


def test_torch_compile_traces_through_scaling_tensor():
    q = quantize(torch.randn(32, 32))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(t):
        return (t * 2).sum(dim=0)

    assert torch.allclose(f(q), (q.dequantize() * 2).sum(dim=0))


def test_quantize_matches_numpy_float64_reference():
    """The cast is round-to-nearest-even of x*scale in the target format."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
    q = quantize(x, fp8lm.E4M3)
    scaled = x.double() * q.scale.double()
    # All E4M3 values: nearest representable value for each scaled input.
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    grid = grid[torch.isfinite(grid)].unique()
    nearest_dist = (scaled[:, None] - grid[None, :]).abs().min(dim=1).values
    got_dist = (q.payload.double() - scaled).abs()
    assert torch.equal(got_dist, nearest_dist)


def test_fused_and_eager_casts_agree_bit_for_bit():
    from fp8lm.ops import cast

    x = torch.randn(cast.FUSED_MIN_NUMEL + 17) * 300
    x[:4] = torch.tensor([1e9, -1e9, float("nan"), 1e-30])
    for fmt in (fp8lm.E4M3, fp8lm.E5M2):
        scale = fp8lm.compute_scale(cast.amax(x[4:]), fmt)
        fused = cast.saturating_cast(x, scale, fmt)
        eager = cast._eager_cast(x, scale, fmt.max, fmt.dtype)
        nan = torch.isnan(eager.float())
        assert torch.equal(nan, torch.isnan(fused.float()))  # NaN's sign bit may differ
        assert torch.equal(fused.view(torch.uint8)[~nan], eager.view(torch.uint8)[~nan])


@pytest.mark.parametrize("numel", [100, (1 << 18) + 5])
def test_cast_with_amax_matches_separate_passes(numel):
    from fp8lm.ops import cast

    x = torch.randn(numel, dtype=torch.bfloat16) * 7
    scale = torch.tensor(16.0)
    payload, got_amax = cast.saturating_cast_with_amax(x, scale, fp8lm.E4M3)
    assert torch.equal(
        payload.view(torch.uint8), cast._eager_cast(x, scale, 448.0, torch.float8_e4m3fn).view(torch.uint8)
    )
    assert got_amax.item() == x.float().abs().max().item()


@pytest.mark.slow  # compiles the casts for every dtype and autocast: about half a minute on 2 cores
def test_fused_casts_never_recompile_across_dtypes_and_autocast(monkeypatch):
    """Each (dtype, format, autocast) combination compiles once into its own cache: none of them
    may trigger a recompile (which would hit torch.compile's limit and drop to eager code). The
    compiled casts serve CUDA and CPUs without the C kernels: the kernels are turned off here."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from fp8lm.ops import cast, native

    monkeypatch.setattr(native.KERNELS.switch, "on", False)

    x = torch.randn(cast.FUSED_MIN_NUMEL)
    cast._compiled.clear()  # only this test's kernels (other tests may have reset dynamo's caches)
    for enabled in (False, True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            for fmt in (fp8lm.E4M3, fp8lm.E5M2):
                for dtype in (torch.float32, torch.bfloat16):
                    cast.saturating_cast(x.to(dtype), torch.tensor(2.0), fmt)
    # 2 autocast states x (fp32 -> E4M3, bf16 -> E4M3, fp32 -> E5M2; bf16 -> E5M2 widens to fp32 first)
    assert cast.FUSED_CAST.enabled and len(cast._compiled) == 6
    for compiled in cast._compiled.values():
        assert len(_debug_get_cache_entry_list(compiled._torchdynamo_orig_callable.__code__)) == 1
