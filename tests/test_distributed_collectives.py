"""FP8 collectives on 2 and 4 gloo ranks: identical results, error within the stated bound,
the shared-scale variant's saturation, non-finite propagation, byte accounting, bad inputs."""

import math

import pytest
import torch

from dist_collectives import rank_input
from dist_launch import run_workers_once
from fp8lm import E4M3, E5M2
from fp8lm.distributed import FlatLayout, LocalScaling, SharedScaling, fp8_all_reduce_error_bound
from fp8lm.distributed.accounting import collective_bytes
from fp8lm.distributed.reduction import scaling_strategy
from fp8lm.scaling import compute_scale


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request):
    return [r["collectives"] for r in run_workers_once("dist_sync.py", request.param)]


def exact_sum(world, n=1000):
    return torch.stack([rank_input(r, n).double() for r in range(world)]).sum(0)


@pytest.mark.slow
def test_all_reduce_identical_on_every_rank(ranks):
    for key in ("all_reduce", "all_reduce_mean", "all_reduce_e5m2", "all_reduce_2d", "nonfinite"):
        for r in ranks[1:]:
            assert torch.equal(r[key].nan_to_num(7.0), ranks[0][key].nan_to_num(7.0)), key


@pytest.mark.slow
@pytest.mark.parametrize(
    "key,fmt,average",
    [
        ("all_reduce", E4M3, False),
        ("all_reduce_mean", E4M3, True),
        ("all_reduce_e5m2", E5M2, False),
    ],
)
@pytest.mark.slow
def test_all_reduce_error_within_fp8_bound(ranks, key, fmt, average):
    world = len(ranks)
    inputs = [rank_input(r) for r in range(world)]
    exact = exact_sum(world) / (world if average else 1)
    bound = fp8_all_reduce_error_bound(inputs, fmt, average)
    err = (ranks[0][key].double() - exact).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3f}"
    # The bound is a real FP8 bound, not a loose one: the worst element uses a good part of it,
    # and FP8 is far less exact than the FP32 all-reduce.
    assert float((err / bound).max()) > 0.2
    fp32_err = (ranks[0]["fp32_all_reduce"].double() - exact_sum(world)).abs().max()
    assert float(err.max()) > 100 * float(fp32_err) / (world if average else 1)


@pytest.mark.slow
def test_all_reduce_of_odd_sized_2d_tensor(ranks):
    world = len(ranks)
    inputs = [rank_input(r)[:999].view(27, 37) for r in range(world)]
    exact = exact_sum(world)[:999].view(27, 37)
    out = ranks[0]["all_reduce_2d"]
    assert out.shape == (27, 37) and out.dtype == torch.float32
    assert bool(((out.double() - exact).abs() <= fp8_all_reduce_error_bound(inputs)).all())


@pytest.mark.slow
def test_reduce_scatter_gives_each_rank_its_chunk(ranks):
    world = len(ranks)
    chunk = math.ceil(999 / world)
    inputs = [rank_input(r)[:999] for r in range(world)]
    exact, bound = exact_sum(world)[:999], fp8_all_reduce_error_bound(inputs)
    for r, res in enumerate(ranks):
        lo, hi = r * chunk, min(999, (r + 1) * chunk)
        assert res["reduce_scatter"].shape == (hi - lo,)
        assert bool(((res["reduce_scatter"].double() - exact[lo:hi]).abs() <= bound[lo:hi]).all())


@pytest.mark.slow
def test_all_gather_is_exact_for_fp8_shards(ranks):
    expected = torch.cat([r["all_gather_input"] for r in ranks])
    for r in ranks:
        assert torch.equal(r["all_gather"], expected)


@pytest.mark.slow
def test_shared_scale_post_scaling_saturates_and_pre_scaling_does_not(ranks):
    world = len(ranks)
    x = rank_input(0).double()
    post, post_saturated = ranks[0]["shared_post"]
    pre, pre_saturated = ranks[0]["shared_pre"]
    assert post_saturated > 0 and pre_saturated == 0
    for r in ranks[1:]:
        assert r["shared_post"][1] == post_saturated and torch.equal(r["shared_pre"][0], pre)
    # Sums beyond the shared scale's range are clipped to its max (10% margin over rounding).
    s = compute_scale(x.abs().max().float(), E4M3).double()
    big = (world * x).abs() * s > 1.1 * E4M3.max
    assert bool(big.any()) and bool((post.double()[big].abs() == E4M3.max / s).all())
    # Pre-scaling: N equal FP8 values sum exactly; only the quantization of x * mu errs, with
    # subnormals 1/mu times coarser (the underflow the paper warns of).
    mu = 1.0 / 2 ** math.ceil(math.log2(world))
    h = torch.finfo(E4M3.dtype).smallest_normal * torch.finfo(E4M3.dtype).eps / 2
    bound = world * (2.0**-4 * x.abs() + h / (s * mu))
    assert bool(((pre.double() - world * x).abs() <= bound).all())


@pytest.mark.slow
def test_non_finite_value_on_one_rank_reaches_every_rank(ranks):
    for r in ranks:
        out = r["nonfinite"]
        assert bool(out[3].isnan()) and bool(out[-1].isfinite())


@pytest.mark.slow
def test_comm_stats_counts_standard_algorithm_bytes(ranks):
    world = len(ranks)
    chunk = math.ceil(20000 / world)
    share = (world - 1) / world
    stats = ranks[0]["all_reduce_stats"]
    assert stats["all_to_all_bytes"] == pytest.approx(share * world * chunk)
    # the payload all-gather plus the all-gather of every rank's per-chunk scales
    assert stats["all_gather_bytes"] == pytest.approx(share * (world * chunk + world * world * 4))
    assert stats["all_reduce_bytes"] == pytest.approx(2 * share * world * 4)  # agreed output scales
    assert (stats["all_to_all_calls"], stats["all_gather_calls"], stats["all_reduce_calls"]) == (1, 2, 1)
    assert stats["total_bytes"] == pytest.approx(
        stats["all_to_all_bytes"] + stats["all_gather_bytes"] + stats["all_reduce_bytes"]
    )
    fp32_ddp = collective_bytes("all_reduce", 4 * 20000, world)
    assert stats["total_bytes"] / fp32_ddp < 0.26


@pytest.mark.slow
def test_bad_inputs_raise_clear_errors(ranks):
    for r in ranks:
        assert "equal shard sizes" in r["unequal_gather_error"]
        assert "floating-point" in r["int_error"]
        assert "float8" in r["comm"]["fp8_sum_error"] and "fp8_all_reduce" in r["comm"]["fp8_sum_error"]


@pytest.mark.slow
def test_all_gather_of_a_non_finite_shard_reads_nan(ranks):
    world = len(ranks)
    for r in ranks:
        parts = r["nonfinite_gather"].view(world, 100)
        assert bool(parts[-1].isnan().all()) and bool(parts[:-1].isfinite().all())


@pytest.mark.slow
def test_comm_helpers_move_the_right_values(ranks):
    world = len(ranks)
    for r, res in enumerate(ranks):
        c = res["comm"]
        assert torch.equal(c["all_reduce"], world * torch.arange(8.0) + 10 * sum(range(world)))
        total = world * torch.arange(4.0 * world) + sum(range(world))
        assert torch.equal(c["reduce_scatter"], total[4 * r : 4 * r + 4])
        assert c["all_gather"].dtype == torch.float8_e4m3fn  # sent as its bits
        assert c["all_gather"].float().tolist() == [i + 1.0 for i in range(world) for _ in range(3)]
        assert c["all_to_all"].tolist() == [100.0 * i + r for i in range(world)]
        assert c["broadcast"].tolist() == [1.0] * 5  # from rank 1
        assert c["recv"].tolist() == [float((r - 1) % world)] * 6  # a ring of sends


@pytest.mark.slow
def test_comm_helpers_count_bytes_by_kind(ranks):
    world = len(ranks)
    share = (world - 1) / world
    expected = {  # the full tensor's bytes times the kind's cost; a send counts all, a recv none
        "all_reduce": 2 * share * 8 * 4,
        "reduce_scatter": share * 4 * world * 4,
        "all_gather": share * 3 * world,
        "all_to_all": share * world * 4,
        "broadcast": share * 5 * 4,
        "send": 6 * 4,
        "recv": 0,
    }
    for r in ranks:
        stats = r["comm"]["stats"]
        for kind, nbytes in expected.items():
            assert (stats[f"{kind}_bytes"], stats[f"{kind}_calls"]) == (pytest.approx(nbytes), 1), kind
        assert stats["total_bytes"] == pytest.approx(sum(expected.values()))


# -- pure parts ----------------------------------------------------------------------------
def test_collective_bytes_formula():
    assert collective_bytes("all_reduce", 400, 4) == 600
    assert collective_bytes("reduce_scatter", 400, 4) == 300
    assert collective_bytes("all_gather", 400, 1) == 0
    assert collective_bytes("send", 400, 4) == 400 and collective_bytes("recv", 400, 4) == 0
    with pytest.raises(ValueError, match="unknown collective kind"):
        collective_bytes("gather", 1, 2)


def test_flat_layout_contiguous_pieces():
    lay = FlatLayout.contiguous([5, 3, 4], 3)
    assert lay.chunk == 4 and lay.numel == 12 and lay.offsets == (0, 5, 8)
    assert lay.pieces(0) == [(0, 0, 4)]
    assert lay.pieces(1) == [(0, 0, 1), (1, 1, 4)]
    assert lay.pieces(2) == [(2, 0, 4)]


def test_flat_layout_by_owner_keeps_segments_whole():
    lay = FlatLayout.by_owner([6, 2, 3, 1], owners=[0, 1, 1, 0], world_size=2)
    assert lay.chunk == 7 and lay.offsets == (0, 7, 9, 6)
    assert lay.pieces(0) == [(0, 0, 6), (3, 6, 7)]
    assert lay.pieces(1) == [(1, 0, 2), (2, 2, 5)]
    with pytest.raises(ValueError, match="one owner"):
        FlatLayout.by_owner([1, 2], owners=[0, 2], world_size=2)


def test_scaling_strategies_put_the_right_factor_on_the_wire():
    local = scaling_strategy("local", E4M3, 4, average=True)
    assert isinstance(local, LocalScaling) and (local.wire_factor, local.divisor) == (1.0, 4.0)
    shared = scaling_strategy("shared", E4M3, 4, average=True, mu=0.25)
    assert isinstance(shared, SharedScaling) and shared.wire_factor == shared.divisor == 1.0  # mu * N
    assert scaling_strategy("shared", E4M3, 4, average=False, mu=0.5).wire_factor == 0.5
    with pytest.raises(ValueError, match="scaling must be one of"):
        scaling_strategy("global", E4M3, 2, average=False)
    with pytest.raises(ValueError, match="mu must be a finite positive number"):
        scaling_strategy("shared", E4M3, 2, average=False, mu=0.0)


def test_local_scaling_gives_each_segment_its_own_scale_and_nan_when_not_finite():
    local = LocalScaling(E4M3, 2, average=False)
    dst = torch.empty(3, dtype=E4M3.dtype)
    scale = local.quantize_input(0, torch.tensor([0.5, -2.0, 1.0]), dst)
    assert scale == compute_scale(torch.tensor(2.0), E4M3)
    assert dst.float().div(scale).tolist() == [0.5, -2.0, 1.0]
    assert bool(local.quantize_input(1, torch.tensor([1.0, math.inf]), torch.empty(2, dtype=E4M3.dtype)).isnan())
    assert local.saturated == 0


def test_shared_scaling_saturates_and_counts_the_sum_beyond_the_shared_scale():
    shared = SharedScaling(E4M3, world_size=2, average=False, mu=1.0)
    out = shared.quantize_output(torch.tensor([1.0, 500.0, -600.0]), torch.tensor(1.0))
    assert out.float().tolist() == [1.0, E4M3.max, -E4M3.max] and shared.saturated == 2


def test_collectives_need_a_process_group():
    from fp8lm.distributed import fp8_all_reduce

    with pytest.raises(RuntimeError, match="setup"):
        fp8_all_reduce(torch.ones(4))
