"""`fp8lm.distributed.grad_sync`: which way each mesh dimension's gradients are synchronized for
every layout (one way per dimension larger than 1), and on 4 gloo ranks (tests/dist_grad_sync.py)
the experts' sync and the one clip's norm over an expert-parallel run against float64."""

import itertools

import pytest
import torch

from dist_launch import run_workers
from fp8lm.distributed import ParallelDims
from fp8lm.distributed.grad_sync import SYNC_DIMS, GradientSync, SyncPlan


@pytest.mark.parametrize(("tp", "pp", "shard"), list(itertools.product((1, 2), (1, 2), (None, "fsdp", "zero"))))
def test_every_dimension_larger_than_one_syncs_one_way(tp, pp, shard):
    dims = ParallelDims.for_world(8, tp=tp, pp=pp, shard=shard is not None)
    ways = SyncPlan.for_run(dims, fsdp=shard == "fsdp", zero=shard == "zero").ways()
    assert list(ways) == [d for d in SYNC_DIMS if d in ways]  # in order: tp, dp_replicate, dp_shard
    assert {d for d in ("tp", "dp_replicate", "dp_shard") if getattr(dims, d) > 1} == set(ways)
    if dims.dp_replicate > 1:  # a whole model: a wrapper during backward; else after backward
        assert ways["dp_replicate"] == ("wrapper" if tp == pp == 1 else "all-reduce")
    if shard:
        assert ways["dp_shard"] == shard


def test_data_parallel_on_one_rank_still_takes_the_wrapper():
    assert SyncPlan.for_run(ParallelDims()).ways() == {"dp_replicate": "wrapper"}
    assert SyncPlan.for_run(ParallelDims(dp_shard=4), fsdp=True, ep=2).ways() == {"dp_shard": "fsdp", "ep": "experts"}


def test_what_cannot_be_planned_is_refused():
    with pytest.raises(ValueError, match="pick one"):
        SyncPlan.for_run(ParallelDims(dp_shard=2), fsdp=True, zero=True)
    with pytest.raises(ValueError, match="needs the run's mesh"):
        GradientSync(SyncPlan.for_run(ParallelDims()), None, fp8=True)
    none = GradientSync.none()
    assert none.plan.ways() == {} and none.clip_options() == {}


@pytest.fixture(scope="module")
def sync_ranks():
    return run_workers("dist_grad_sync.py", 4, timeout=600.0)


@pytest.mark.parametrize("case", ["clip_replicated", "clip_sharded"])
def test_the_one_clip_counts_each_expert_and_each_replicated_gradient_once(sync_ranks, case):
    for r in sync_ranks:
        res = r[case]
        assert "ep_params" in res["options"]
        assert res["norm"] == pytest.approx(res["exact"], rel=1e-6)  # float32 sums of squares
        # clipped to norm 1: the replicated part is that share of the whole
        replicated = sum(float(g.double().square().sum()) for g in __import__("dist_grad_sync").grads(0))
        assert res["replicated_clipped"] == pytest.approx(replicated / res["exact"] ** 2, rel=1e-5)


def test_experts_are_divided_as_they_arrive_and_averaged_over_their_replicas(sync_ranks):
    for rank, r in enumerate(sync_ranks):
        exact = r["expert_fp32"]
        own = __import__("dist_grad_sync").grads(10 + rank, n=1)[0]
        assert torch.equal(exact["arrived"], own / 2)  # ep 2: halved as it arrived
        torch.testing.assert_close(exact["synced"], exact["mean"], rtol=1e-6, atol=0)
        fp8 = r["expert_fp8"]  # E4M3 twice: within a few of its unit roundoffs (1/16) of the mean's scale
        error = (fp8["synced"] - fp8["mean"]).norm() / fp8["mean"].norm()
        assert 0 < error < 0.08
    for a, b in zip(sync_ranks[:2], sync_ranks[2:]):  # the replicas of an expert agree bit for bit
        assert torch.equal(a["expert_fp8"]["synced"], b["expert_fp8"]["synced"])


def test_a_switched_experts_gradient_is_averaged_from_bf16(sync_ranks):
    """An expert of a layer switched to high precision: its replicas' gradients cross in BF16 and
    are summed in FP32 (`sent_in_bf16`), the mean sent back in BF16."""
    for rank, r in enumerate(sync_ranks):
        replicas = [s["expert_switched"]["arrived"] for i, s in enumerate(sync_ranks) if i % 2 == rank % 2]
        mean = sum(g.bfloat16().float() for g in replicas) / len(replicas)
        assert torch.equal(r["expert_switched"]["synced"], mean.bfloat16().float())


def test_replicas_of_a_stage_average_after_backward(sync_ranks):
    for r in sync_ranks:
        assert r["replicas"]["ways"] == {"dp_replicate": "all-reduce"}
        for got, mean in zip(r["replicas"]["grads"], r["replicas"]["mean"]):
            torch.testing.assert_close(got, mean, rtol=1e-6, atol=1e-7)
