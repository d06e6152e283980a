"""FP8 pipeline stage boundaries (tests/dist_pp.py on 2 gloo ranks, GPipe and 1F1B): loss and
gradients against the same FP8 model in one process and a float64 copy, bytes on the wire; and
the carrier's packing."""

import math

import pytest
import torch

from dist_launch import run_workers
from dist_pp import MICRO, MICRO_SHAPE
from dist_tp_gpt import TOKEN_LOSS_GROWTH
from fp8lm import E4M3, E5M2
from fp8lm.distributed.pipeline import carrier_numel, pack_fp8, unpack_fp8
from fp8lm.ops.cast import saturating_cast
from fp8lm.scaling import compute_scale

TIMEOUT = 600.0
# The boundary adds one E4M3 rounding (relative error <= 2**-4) to the activation and one E5M2
# rounding to its gradient, on top of the FP8 layers' own roundings: errors against float64 may
# grow by at most a quarter of the single-process FP8 model's (measured: at most 1.18x).
ERROR_GROWTH = 1.25


@pytest.fixture(scope="module", params=["gpipe", "1f1b"])
def stages(request):
    return run_workers("dist_pp.py", 2, request.param, timeout=TIMEOUT)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


@pytest.mark.slow
def test_loss_and_gradients_within_bound(stages):
    first, last = stages
    loss = sum(last["losses"]) / MICRO
    assert len(last["losses"]) == MICRO
    assert abs(loss - first["exact_loss"]) <= ERROR_GROWTH * abs(first["ref_loss"] - first["exact_loss"])
    grads = {**first["grads"], **last["grads"]}
    assert set(grads) == set(first["exact_grads"])
    for name, exact in first["exact_grads"].items():
        assert relative_error(grads[name], exact) <= ERROR_GROWTH * relative_error(first["ref_grads"][name], exact), (
            name
        )
    assert any(not torch.equal(grads[n], first["ref_grads"][n]) for n in grads)  # the boundary did quantize


@pytest.mark.slow
def test_boundary_sends_one_byte_per_element_plus_scale(stages):
    numel = math.prod(MICRO_SHAPE)
    assert stages[0]["carrier_numel"] == carrier_numel(numel) == (numel + 4) // 4
    for r in stages:  # stage 0 sends activations, stage 1 gradients: one carrier per micro-batch
        s = r["stats"]
        assert s["send_calls"] == s["recv_calls"] == MICRO
        assert s["send_bytes"] == s["send_handed_bytes"] == MICRO * (numel + 4)
        assert s["total_bytes"] == s["send_bytes"]


def test_carrier_round_trip_is_the_fp8_cast():
    x = torch.randn(3, 5) * 100
    for fmt in (E4M3, E5M2):
        carrier = pack_fp8(x, fmt)
        assert carrier.dtype == torch.float32 and carrier.numel() == carrier_numel(15) == 5
        scale = compute_scale(x.abs().max(), fmt)
        expected = saturating_cast(x, scale, fmt).float() / scale
        assert torch.equal(unpack_fp8(carrier, (3, 5), fmt, torch.float32), expected)


def test_nonfinite_activation_arrives_as_nan():
    x = torch.ones(8)
    x[3] = math.inf
    assert unpack_fp8(pack_fp8(x, E4M3), (8,), E4M3, torch.float32).isnan().all()


def test_wrong_shape_is_one_clear_error():
    with pytest.raises(ValueError, match="declare the same activation shape"):
        unpack_fp8(pack_fp8(torch.ones(8), E4M3), (4, 4), E4M3, torch.float32)


@pytest.mark.slow
def test_gpt_stages_loss_and_grad_norm_within_bound():
    """The "tiny" GPT cut into 2 `PipelineStageModule`s (GPipe), against one process: every token's
    loss and the gradient norm."""
    first, last = run_workers("dist_tp_gpt.py", 2, "pp", timeout=TIMEOUT)
    assert first["loss"] is None and first["token_losses"] is None  # only the last stage computes the loss
    assert last["loss"] == pytest.approx(float(last["token_losses"].mean()), rel=1e-5)
    exact = last["exact_token_losses"]
    assert relative_error(last["token_losses"], exact) <= TOKEN_LOSS_GROWTH * relative_error(
        last["ref_token_losses"], exact
    )
    for r in (first, last):
        assert r["norm"] == first["norm"]  # one norm over both stages
        assert abs(r["norm"] - r["exact_norm"]) <= ERROR_GROWTH * r["ref_grad_error"] * r["exact_norm"]
        assert r["stats"]["send_calls"] == 2  # one carrier per micro-batch, each way
