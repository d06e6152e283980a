"""FP8 ZeRO (O3) on 2 and 4 gloo ranks: FP8 weights, sharded state, bit-exact agreement with an
unsharded optimizer fed the same reduced gradients, bytes per parameter, global clipping,
non-finite skip, checkpoints saved on 2 ranks and loaded on 4."""

import pytest
import torch

from dist_launch import run_workers
from fp8lm.distributed import partition_by_size


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero_ckpt")


@pytest.fixture(scope="module")
def two(ckpt_dir):
    return run_workers("dist_zero.py", 2, str(ckpt_dir / "two"))


@pytest.fixture(scope="module")
def four(ckpt_dir, two):
    return run_workers("dist_zero.py", 4, str(ckpt_dir / "four"), str(ckpt_dir / "two"))


@pytest.fixture(params=["two", "four"])
def ranks(request):
    return request.getfixturevalue(request.param)


@pytest.mark.slow
def test_weights_are_fp8_except_vectors(ranks):
    for name, dtype in ranks[0]["payload_dtypes"].items():
        assert dtype == (
            torch.float32
            if name.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"))
            else torch.float8_e4m3fn
        ), name


@pytest.mark.slow
def test_every_tensor_has_exactly_one_owner(ranks):
    owned = [n for r in ranks for n in r["owned"]]
    assert sorted(owned) == sorted(ranks[0]["payload_dtypes"])


@pytest.mark.slow
def test_sharded_step_equals_unsharded_optimizer_bit_for_bit(ranks):
    for r in ranks:
        assert all(r["matches_unsharded"].values()), [k for k, v in r["matches_unsharded"].items() if not v]


@pytest.mark.slow
def test_all_ranks_hold_identical_weights(ranks):
    for r in ranks[1:]:
        for k, v in r["weights"].items():
            assert torch.equal(v, ranks[0]["weights"][k]), k


@pytest.mark.slow
def test_state_bytes_per_param_per_rank(four):
    # FP8 weight (1) + FP16 master, E4M3 m, FP16 v (5) split over 4 ranks, + 0.1 slack; counted
    # by fp8lm.memory_report on the default preset (so FP32 vectors, scales and the FP8 layers'
    # amax histories are in), on every rank
    worst = max(r["small_memory"]["bytes_per_param"] for r in four)
    assert worst <= 1 + 5 / 4 + 0.1
    for r in four:
        assert r["small_memory"]["gradients"] == 0  # none held between steps
        # the optimizer's own count agrees with memory_report up to the FP8 layers' scaling state
        assert 0 <= r["small_memory"]["total"] - r["small_state_bytes"]["total"] <= 0.01 * r["small_memory"]["total"]


@pytest.mark.slow
def test_step_bytes_are_fp8_reduce_scatter_plus_fp8_all_gather(ranks):
    world = len(ranks)
    stats, params = ranks[0]["step_stats"], ranks[0]["state_bytes"]["num_params"]
    share = (world - 1) / world
    # Two all-to-alls: each rank sends its gradients of the tensors the others own, 1 byte per
    # element, 2 for the output head's (the policy stores it in BF16, and it crosses so); one
    # all-gather of weights as stored (1 byte, or 4 for the few FP32 vectors): well under FP32 DDP.
    assert stats["all_to_all_calls"] == 2
    assert stats["all_gather_calls"] == 2  # the gradients' scales, the weights
    others = {n: k for n, k in ranks[0]["numels"].items() if n not in ranks[0]["owned"]}
    assert stats["all_to_all_bytes"] == sum(k * (2 if n == "lm_head.weight" else 1) for n, k in others.items())
    mean_total = sum(r["step_stats"]["total_bytes"] for r in ranks) / world  # ranks own unequal shares
    assert mean_total < 0.3 * 2 * share * 4 * params


@pytest.mark.slow
def test_global_grad_clipping(ranks):
    for r in ranks:
        assert r["grad_norm"] == pytest.approx(ranks[0]["grad_norm"])  # same global norm on every rank
        assert r["clipped_norm"] == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.slow
def test_non_finite_gradient_on_one_rank_skips_step_everywhere(ranks):
    assert all(r["nan_skipped"] for r in ranks)
    assert all(r["overflow_norm"] == float("inf") and r["overflow_skipped"] for r in ranks)


@pytest.mark.slow
def test_checkpoint_from_two_ranks_loads_on_four(two, four):
    saved = {k: v for r in two for k, v in r["state"].items()}
    loaded = {k: v for r in four for k, v in r["loaded_state"].items()}
    assert saved.keys() == loaded.keys()
    for k in saved:
        if isinstance(saved[k], torch.Tensor):
            assert saved[k].dtype == loaded[k].dtype and torch.equal(saved[k], loaded[k]), k
        else:  # param groups' options, the skipped-step count
            assert saved[k] == loaded[k], k
    for r in four:
        for k, v in two[0]["weights"].items():
            assert torch.equal(r["loaded_weights"][k], v), k


@pytest.mark.slow
def test_bad_inputs_raise_clear_errors(two):
    assert "not in the model" in two[0]["foreign_param_error"]
    assert "another model" in two[0]["foreign_state_error"]


def test_partition_by_size_is_greedy_largest_first():
    assert partition_by_size([10, 4, 7, 3, 3], 2) == [0, 1, 1, 0, 1]
    assert partition_by_size([5, 5, 5], 4) == [0, 1, 2]
    with pytest.raises(ValueError, match="world_size"):
        partition_by_size([1], 0)
