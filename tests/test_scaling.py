import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8lm
from fp8lm import ScalingMeta, compute_scale
from fp8lm.scaling import MAX_SCALE_EXPONENT


def test_compute_scale_examples():
    assert compute_scale(10.0, fp8lm.E4M3).item() == 32.0
    assert compute_scale(10000.0, fp8lm.E4M3).item() == 1 / 32
    assert compute_scale(10.0, fp8lm.E4M3, margin=1).item() == 16.0
    assert compute_scale(448.0, fp8lm.E4M3).item() == 1.0


@pytest.mark.parametrize("amax", [0.0, float("inf"), float("-inf"), float("nan")])
def test_compute_scale_keeps_previous_on_uninformative_amax(amax):
    assert compute_scale(amax, fp8lm.E4M3, previous=torch.tensor(8.0)).item() == 8.0
    assert compute_scale(amax, fp8lm.E4M3).item() == 1.0


def test_compute_scale_elementwise():
    amax = torch.tensor([10.0, 0.0, 10000.0])
    out = compute_scale(amax, fp8lm.E4M3, previous=torch.tensor([1.0, 4.0, 1.0]))
    assert out.tolist() == [32.0, 4.0, 1 / 32]


@given(st.floats(min_value=1e-30, max_value=1e30), st.sampled_from([fp8lm.E4M3, fp8lm.E5M2, fp8lm.FP16]))
def test_compute_scale_is_power_of_two_fitting_amax(amax, fmt):
    scale = compute_scale(amax, fmt).item()
    exp = math.log2(scale)
    assert exp == int(exp)
    if -126 < exp < MAX_SCALE_EXPONENT:  # away from the clamps, the largest power of two that fits
        assert amax * scale <= fmt.max
        assert amax * scale * 2 > fmt.max


@pytest.mark.parametrize("fmt", [fp8lm.E4M3, fp8lm.FP16, fp8lm.BF16, fp8lm.FP32])
def test_scales_leave_room_below_float32s_top(fmt):
    """A tiny amax, or a format as wide as float32, gets at most 2**MAX_SCALE_EXPONENT on both
    paths, so dividing the scale by a clipping coefficient cannot overflow."""
    for amax in (1e-3, 1e-35):
        for path in (torch.tensor(amax), torch.tensor([amax, 0.0])):
            assert compute_scale(path, fmt).reshape(-1)[0].item() <= 2.0**MAX_SCALE_EXPONENT
    assert compute_scale(torch.tensor(1e-3), fp8lm.BF16).item() == 2.0**MAX_SCALE_EXPONENT


def test_delayed_scaling_uses_history_of_earlier_steps():
    meta = ScalingMeta(fp8lm.E4M3, history_len=3)
    # First step: no history, so the scale fits the tensor itself.
    assert meta.scale_for(torch.tensor([10.0])).item() == 32.0
    # Second step: scale from the history (amax 10), not from this tensor's amax 100.
    assert meta.scale_for(torch.tensor([100.0])).item() == 32.0
    # Third: history max is now 100.
    assert meta.scale_for(torch.tensor([1.0])).item() == 4.0
    meta.scale_for(torch.tensor([1.0]))
    meta.scale_for(torch.tensor([1.0]))
    # The amax of 100 has left the window of 3.
    assert meta.scale_for(torch.tensor([1.0])).item() == 256.0


def test_current_scaling_uses_the_tensor_itself():
    meta = ScalingMeta(fp8lm.E5M2, history_len=0)
    assert meta.scale_for(torch.tensor([1.0])).item() == 32768.0
    assert meta.scale_for(torch.tensor([1000.0])).item() == 32.0


def test_scaling_meta_state_round_trip_and_mismatch():
    meta = ScalingMeta(fp8lm.E4M3, history_len=4)
    for v in (1.0, 5.0, 2.0):
        meta.scale_for(torch.tensor([v]))
    other = ScalingMeta(fp8lm.E4M3, history_len=4)
    other.load_scaling_state(meta.scaling_state())
    assert torch.equal(other.amax_history, meta.amax_history) and torch.equal(other.scale, meta.scale)
    assert int(other.step) == int(meta.step) == 3
    with pytest.raises(ValueError, match="history_len=2"):
        ScalingMeta(fp8lm.E4M3, history_len=2).load_scaling_state(meta.scaling_state())
    with pytest.raises(ValueError, match="history_len must be >= 0"):
        ScalingMeta(fp8lm.E4M3, history_len=-1)


@given(
    st.floats(min_value=2.0**-99, max_value=2.0**99, width=32),
    st.integers(0, 3),
    st.sampled_from([fp8lm.E4M3, fp8lm.E5M2, fp8lm.FP16]),
)
def test_cpu_scalar_path_matches_the_exact_definition(amax, margin, fmt):
    """The scalar fast path gives the largest power of two with amax * scale <= max (before the
    margin), like the tensor path, except where float32 log2 rounds at a power-of-two boundary."""
    got = compute_scale(torch.tensor(amax), fmt, margin).item()
    exp = math.log2(got) + margin
    if -126 < exp - margin < MAX_SCALE_EXPONENT:
        assert amax * 2.0**exp <= fmt.max < amax * 2.0 ** (exp + 1)
    tensor_path = compute_scale(torch.tensor([amax, 0.0]), fmt, margin)[0].item()  # elementwise path
    assert got == tensor_path or abs(math.log2(got / tensor_path)) == 1


def test_scaling_state_is_in_buffers_and_loads_the_earlier_form():
    meta = ScalingMeta(fp8lm.E4M3, history_len=4)
    meta.scale_for(torch.tensor([3.0]))
    assert {name for name, _ in meta.named_buffers()} == {"scale", "amax_history", "step", "rescales", "last_amax"}
    assert meta.state_dict() == {}  # not persistent: a converted model's state_dict stays the plain model's
    assert meta.to(torch.bfloat16) is meta and meta.scale.dtype == meta.amax_history.dtype == torch.float32
    assert meta.history_len == 4 and meta.step.dtype == torch.int64
    # The form saved before the state lived in buffers: step an int, no rescales.
    old = {"scale": torch.tensor(64.0), "amax_history": torch.tensor([5.0, 0.0, 0.0, 0.0]), "step": 1}
    fresh = ScalingMeta(fp8lm.E4M3, history_len=4)
    fresh.load_scaling_state(old)
    assert int(fresh.step) == 1 and int(fresh.rescales) == 0 and fresh.scale.item() == 64.0
    assert fresh.scale_for(torch.tensor([1.0])).item() == 64.0  # delayed: from the loaded history


def test_scale_known_in_advance_reads_no_buffer():
    # On CUDA a read of the step buffer is a host sync: the answer comes from Python state.
    meta = ScalingMeta(fp8lm.E4M3, history_len=2)
    assert not meta.scale_known_in_advance
    meta.scale_for(torch.tensor([2.0]))
    assert meta.scale_known_in_advance
    fresh = ScalingMeta(fp8lm.E4M3, history_len=2)
    fresh.load_scaling_state(meta.scaling_state())
    assert fresh.scale_known_in_advance
    fresh.load_scaling_state(ScalingMeta(fp8lm.E4M3, history_len=2).scaling_state())
    assert not fresh.scale_known_in_advance
