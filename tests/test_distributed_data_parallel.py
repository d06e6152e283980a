"""FP8DataParallel on 2 and 4 gloo ranks: broadcast at start, identical gradients within the
FP8 bound of the exact mean, FP8 and plain gradients side by side, no_sync accumulation,
overlap with backward, bytes per step vs FP32 / BF16 DDP, automatic mu, checkpointed state."""

import pytest
import torch

from dist_launch import run_workers_once
from fp8lm.distributed import AutoScaler, ddp_bytes, fp8_all_reduce_error_bound


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request):
    return [r["data_parallel"] for r in run_workers_once("dist_sync.py", request.param)]


@pytest.mark.slow
def test_replicas_start_from_rank0_weights(ranks):
    for r in ranks[1:]:
        for name, w in r["weights"].items():
            assert torch.equal(w, ranks[0]["weights"][name]), name


@pytest.mark.slow
def test_fp8_and_plain_gradients_side_by_side(ranks):
    types = ranks[0]["synced_types"]
    assert types["w"] == "ScalingTensor" and types["emb.weight"] == "Tensor"
    assert types == ranks[0]["grad_types"]  # each gradient keeps its kind through the sync


@pytest.mark.slow
def test_every_rank_holds_identical_gradients(ranks):
    for r in ranks[1:]:
        for name, g in r["synced"].items():
            assert torch.equal(g, ranks[0]["synced"][name]), name


@pytest.mark.slow
def test_gradients_within_fp8_bound_of_exact_mean(ranks):
    worst = 0.0
    for name, synced in ranks[0]["synced"].items():
        inputs = [r["local"][name] for r in ranks]
        bound = fp8_all_reduce_error_bound(inputs, average=True, segment=synced.numel())
        err = (synced.double() - ranks[0]["exact_mean"][name].double()).abs()
        assert bool((err <= bound).all()), name
        worst = max(worst, float((err / bound).max()))
    assert worst > 0.1  # the bound is tight enough to mean something


@pytest.mark.slow
def test_no_sync_sends_nothing(ranks):
    assert ranks[0]["no_sync_bytes"] == 0


@pytest.mark.slow
def test_buckets_launch_during_backward(ranks):
    assert ranks[0]["buckets"] == 4
    assert ranks[0]["last_sync"] == {"buckets": 4, "launched_during_backward": 4}


@pytest.mark.slow
def test_grad_sync_bytes_per_param_vs_ddp(ranks):
    world = len(ranks)
    stats, n = ranks[0]["mlp_stats"], ranks[0]["mlp_params"]
    assert stats["total_bytes"] <= 0.26 * ddp_bytes(n, 4, world)
    assert stats["total_bytes"] <= 0.51 * ddp_bytes(n, 2, world)
    # payload: all-to-all + all-gather of 1 byte per element (padded to the world size)
    assert stats["all_to_all_bytes"] == pytest.approx((world - 1) / world * world * -(-n // world))


@pytest.mark.slow
def test_shared_scaling_adapts_mu(ranks):
    world = len(ranks)
    # Equal gradients on every rank: at mu = 1 the FP8 sum of N values saturates; mu halves
    # until N * mu <= 1, and after `window` (2) clean steps doubles.
    expected = {2: [0.5, 0.5, 1.0], 4: [0.5, 0.25, 0.25]}[world]
    assert ranks[0]["shared_mus"] == expected
    for r in ranks[1:]:
        assert r["shared_mus"] == expected
        for name, g in r["shared_grads"].items():
            assert torch.equal(g, ranks[0]["shared_grads"][name])


@pytest.mark.slow
def test_mu_is_saved_and_loaded_with_state_dict(ranks):
    r = ranks[0]
    assert r["shared_extra_state"]["autoscalers"][0]["mu"] == r["shared_mus"][-1]
    assert r["reloaded_mu"] == r["shared_mus"][-1]
    assert "same scaling and bucket_mb" in r["mismatched_state_error"]
    assert "bucket_mb must be positive" in r["bad_bucket_error"]


# -- AutoScaler alone -------------------------------------------------------------------------
def test_autoscaler_halves_on_saturation_and_doubles_after_window():
    s = AutoScaler(mu=1.0, max_saturated_fraction=1e-5, window=3)
    assert s.update(2, 100_000) == 0.5  # 2e-5 > 1e-5
    assert s.update(1, 100_000) == 0.5  # 1e-5 is not more than the limit: clean
    assert s.update(0, 100_000) == 0.5
    assert s.update(0, 100_000) == 1.0  # third clean step in a row
    assert s.clean_steps == 0


def test_autoscaler_state_round_trip_and_bad_values():
    s = AutoScaler(window=5)
    s.update(10, 100)
    t = AutoScaler(window=5)
    t.load_state_dict(s.state_dict())
    assert (t.mu, t.clean_steps, t.last_saturated_fraction) == (0.5, 0, 0.1)
    with pytest.raises(ValueError, match="window"):
        AutoScaler(window=0)
    with pytest.raises(ValueError, match="max_saturated_fraction"):
        AutoScaler(max_saturated_fraction=1.5)
    with pytest.raises(ValueError, match="saturated <= total"):
        s.update(5, 4)
    with pytest.raises(ValueError, match="positive"):
        t.load_state_dict({"mu": 0.0, "clean_steps": 0, "last_saturated_fraction": 0.0})
    assert t.mu == 0.5  # a rejected state leaves the scaler as it was


@pytest.mark.slow
def test_dead_rank_makes_the_others_fail_fast():
    from dist_kill import TIMEOUT_S
    from dist_launch import launch

    codes, logs, results = launch("dist_kill.py", 2, timeout=TIMEOUT_S + 60)
    assert codes == [0, 17], logs[0][-2000:]
    assert "gradient sync failed" in results[0]["error"] and "rank may have died" in results[0]["error"]
    assert results[0]["seconds"] <= TIMEOUT_S + 10


@pytest.mark.slow
def test_o2_training_through_wrap_keeps_replicas_identical(ranks):
    types = ranks[0]["o2_grad_types"]
    assert types["blocks.0.mlp.c_fc.weight"] == "ScalingTensor" and types["wte.weight"] == "ScalingTensor"
    assert types["blocks.0.ln_1.weight"] == "Tensor"
    for r in ranks[1:]:
        for k, v in r["o2_weights"].items():
            assert torch.equal(v, ranks[0]["o2_weights"][k]), k
    assert types["lm_head.weight"] == "ScalingTensor"  # stored in BF16, and sent so
    world, n, head = len(ranks), ranks[0]["o2_params"], ranks[0]["o2_head_params"]
    # a quarter of FP32 DDP's bytes, the output head's gradient counted twice (BF16 on the wire)
    assert ranks[0]["o2_stats"]["total_bytes"] <= 0.26 * ddp_bytes(n + head, 4, world)
