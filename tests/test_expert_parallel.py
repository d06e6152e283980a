"""Expert parallelism on 2 gloo ranks: each rank holds half the experts, tokens travel to them
and back in FP8 (E4M3 forward, E5M2 backward), with the results of the whole mixture in one
process with the same round trips, and the all-to-all bytes counted."""

import pytest
import torch

from dist_expert_parallel import DIM, EXPERTS, TOKENS, TOP_K, rank_tokens
from dist_launch import run_workers
from fp8lm import E4M3, E5M2
from fp8lm.distributed.expert_parallel import pack_rows, unpack_rows


@pytest.fixture(scope="module")
def ranks():
    return run_workers("dist_expert_parallel.py", 2, timeout=240)


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item()


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_rows_pack_into_a_payload_and_a_scale_exponent_byte(fmt):
    torch.manual_seed(0)
    magnitude = torch.rand(7, 256) * 0.9 + 0.1  # within a factor 10 of each other: all normal numbers
    x = magnitude * torch.randn(7, 256).sign() * torch.logspace(-6, 6, 7).unsqueeze(1)
    x[3, 5] = float("inf")
    wire = pack_rows(x, fmt)
    assert wire.dtype == torch.uint8 and wire.shape == (7, 256 + 2)  # two groups of 128 per row
    back = unpack_rows(wire, 256, fmt, torch.float32)
    assert back[3, :128].isnan().all() and torch.isfinite(back[3, 128:]).all()  # a non-finite group reads NaN
    rows = [r for r in range(7) if r != 3]
    rel = ((back[rows] - x[rows]).abs() / x[rows].abs().clamp_min(1e-30)).max().item()
    assert rel <= (2**-4 if fmt == E4M3 else 2**-3)  # half a unit in the last place, normal values
    assert not torch.equal(back[rows], x[rows])


def test_each_rank_holds_its_experts(ranks):
    local = EXPERTS // 2
    for r, out in enumerate(ranks):
        assert out["local_experts"] == list(range(r * local, (r + 1) * local))
    # the two ranks' experts are different weights of the same mixture
    assert not torch.equal(ranks[0]["ep_expert_weights"][0], ranks[1]["ep_expert_weights"][0])


def test_outputs_and_gradients_equal_the_whole_mixture_in_one_process(ranks):
    for out in ranks:
        torch.testing.assert_close(out["y"], out["ref_y"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["dx"], out["ref_dx"], rtol=1e-5, atol=1e-6)
        for got, ref in zip(out["expert_grads"], out["ref_expert_grads"]):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
        assert int(out["counts"].sum()) == TOKENS * TOP_K
        # a real FP8 round trip: close to the mixture without one, not equal to it
        assert 25 <= sqnr_db(out["plain_y"], out["y"]) < 60


def test_all_to_all_bytes_are_fp8_and_counted(ranks):
    for r, out in enumerate(ranks):
        stats, forward = out["stats"], out["stats_forward"]
        # forward: the counts exchange, dispatch and combine; backward: two gradient all-to-alls
        assert forward["expert_all_to_all_calls"] == 3 and stats["expert_all_to_all_calls"] == 5
        counts = out["counts"]
        local = EXPERTS // 2
        other = counts[(1 - r) * local : (2 - r) * local].sum().item()  # rows that leave for the other rank
        wire_row = DIM + 1  # E4M3 payload and one exponent byte per row of 32 features
        count_bytes = 8 * EXPERTS // 2  # int64 counts for the other rank's experts
        received = (
            sum(o["counts"][r * local : (r + 1) * local].sum().item() for o in ranks)
            - counts[r * local : (r + 1) * local].sum().item()
        )
        # dispatch sends `other` rows; combine sends back the rows received from the other rank
        assert forward["expert_all_to_all_bytes"] == count_bytes + wire_row * (other + received)
        assert stats["expert_all_to_all_bytes"] == count_bytes + 2 * wire_row * (other + received)
        bf16 = 2 * DIM * 2 * (other + received)
        assert (stats["expert_all_to_all_bytes"] - count_bytes) / bf16 == pytest.approx(wire_row / (2 * DIM))
        assert wire_row / (2 * DIM) <= 0.55


def test_o2_trains_the_local_experts_in_fp8_under_their_global_names(ranks):
    local = EXPERTS // 2
    for r, out in enumerate(ranks):
        o2 = out["o2"]
        names = [f"0.c_fc.weight.{e}" for e in range(r * local, (r + 1) * local)]
        assert o2 == {
            "type": "ExpertParallelMoE",
            "layer": "FP8GroupedLinear",
            "experts": local,
            "names": names,
            "grad_fmt": "E4M3",
            "finite": True,
        }


def test_switched_experts_take_and_give_the_rows_as_they_are(ranks):
    """Experts switched to high precision (a fallback, precision annealing): the rows of both
    all-to-alls travel as FP32 (4 bytes per element), and the output is one process's to FP32
    rounding; in FP8 it is not (E4M3 rows both ways)."""
    for out in ranks:
        fp8, high = out["switched"][False], out["switched"][True]
        torch.testing.assert_close(high["y"], high["ref_y"], rtol=1e-5, atol=1e-6)
        assert (fp8["y"] - fp8["ref_y"]).abs().max() > 1e-3
        # the same rows leave in both (the router is not switched): FP32 rows against E4M3 ones
        # with an exponent byte, besides the int64 counts for the other rank's experts
        count_bytes = 8 * EXPERTS // 2
        assert (high["bytes"] - count_bytes) * (DIM + 1) == (fp8["bytes"] - count_bytes) * 4 * DIM


def test_rank_tokens_differ():
    assert not torch.equal(rank_tokens(0), rank_tokens(1))
