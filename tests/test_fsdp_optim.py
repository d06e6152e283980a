"""FP8AdamW on FSDP2 shards and Distributed Checkpoint (gloo ranks, tests/dist_fsdp_optim.py):
sharded steps within one unit in the last place of one process fed the same gradients, with the
same scales; agreed skipping; per-rank memory; a checkpoint saved at 2 ranks loads at 1 and 4 and
resumes at 2 bit for bit; untrusted checkpoint content is refused."""

import io

import pytest
import torch

import dist_fsdp_optim as worker
from dist_launch import run_workers
from fp8lm.distributed import load_fsdp_checkpoint
from fp8lm.distributed.checkpoint import CheckpointError, PlainDataLoadPlanner

TIMEOUT = 600.0  # 2-4 ranks importing torch.distributed's whole stack on a shared 2-core machine


def ordinal(payload: torch.Tensor) -> torch.Tensor:
    """FP8/FP16 codes as integers in value order: neighbouring values differ by 1."""
    bits = payload.view(torch.uint8 if payload.element_size() == 1 else torch.int16).to(torch.int32)
    width = 8 * payload.element_size()
    sign = (bits >> (width - 1)) & 1
    magnitude = bits & ((1 << (width - 1)) - 1)
    return torch.where(sign.bool(), -magnitude, magnitude)


def tensors(entry) -> dict:
    return {k: v for k, v in entry.items() if isinstance(v, (torch.Tensor, tuple))}


@pytest.fixture(scope="module")
def optim_ranks():
    return run_workers("dist_fsdp_optim.py", 2, "optim", timeout=TIMEOUT)


@pytest.mark.slow
def test_sharded_step_within_one_ulp_of_one_process_with_the_same_scales(optim_ranks):
    moved = 0
    for step in optim_ranks[0]["steps"]:
        sharded, reference = step["sharded"], step["reference"]
        for name, ref in reference.items():
            if name == "skipped_steps":
                continue
            for key, want in tensors(ref).items():
                got = sharded[name][key]
                if isinstance(want, tuple):  # a ScalingTensor weight: (payload, scale)
                    assert torch.equal(got[1], want[1]), (name, key)
                    got, want = got[0], want[0]
                if key.endswith("_scale") or want.dtype == torch.float32:  # scales, plain FP32 weights
                    assert torch.equal(got, want), (name, key)
                    continue
                codes = (ordinal(got) - ordinal(want)).abs()
                assert int(codes.max()) <= 1, (name, key)
                moved += int(codes.sum())
    # Shards chose other scales than the whole tensor (first rows 1000x larger), so shards were requantized.
    assert moved > 0
    amaxes = [r["local_grad_amax"]["blocks.0.mlp.c_fc.weight"] for r in optim_ranks]
    assert max(amaxes) > 100 * min(amaxes)


@pytest.mark.slow
def test_nan_in_one_shard_skips_the_step_on_every_rank(optim_ranks):
    for r in optim_ranks:
        skip = r["skip"]
        assert skip["skipped"] and skip["count"] == 1
        for name, before in tensors(skip["before"]).items():
            for key, value in tensors(before).items():
                after = skip["after"][name][key]
                same = all(map(torch.equal, value, after)) if isinstance(value, tuple) else torch.equal(value, after)
                assert same, (name, key)


@pytest.mark.slow
def test_training_steps_match_one_process_on_the_whole_batch(optim_ranks):
    sharded = torch.stack([torch.stack(r["losses"]) for r in optim_ranks]).mean(0)
    single = torch.stack(optim_ranks[0]["single_losses"])
    assert float(sharded[0]) == pytest.approx(float(single[0]), rel=1e-6)  # same weights, FP8 forward
    assert float(((sharded - single).abs() / single).max()) < 0.01


@pytest.mark.slow
def test_each_rank_reports_its_share_of_the_training_state(optim_ranks):
    single = optim_ranks[0]["single_memory"]
    for r in optim_ranks:
        mem = r["memory"]
        assert mem["num_params"] == single["num_params"]
        for kind in ("exp_avg", "exp_avg_sq"):
            assert sum(x["memory"][kind] for x in optim_ranks) == single[kind]
        # FSDP2 pads each weight to whole rows per rank: at most one row of 32 FP16 values per tensor.
        assert mem["weights"] <= single["weights"] / 2 + 29 * 32 * 2
        assert mem["total"] < 0.52 * single["total"]


# -- Distributed Checkpoint ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp_ckpt")
    return folder, run_workers("dist_fsdp_optim.py", 2, "save", str(folder), timeout=TIMEOUT)


def whole(snapshots: list[dict], name: str, key: str):
    """The rank-ordered concatenation of a sharded entry (scales and counters: equal on every rank)."""
    values = [s[name][key] for s in snapshots]
    first = values[0]
    if isinstance(first, tuple):
        assert all(torch.equal(v[1], first[1]) for v in values)
        return torch.cat([v[0] for v in values]).float() / first[1]
    if isinstance(first, torch.Tensor) and first.dim():
        return torch.cat([v.view(torch.uint8) if v.element_size() == 1 else v for v in values])
    assert all((torch.equal(v, first) if isinstance(v, torch.Tensor) else v == first) for v in values)
    return first


def assert_same_state(got: list[dict], want: list[dict]) -> None:
    for name, entry in want[0].items():
        if name == "skipped_steps":
            assert all(g[name] == entry for g in got)
            continue
        for key in entry:
            a, b = whole(got, name, key), whole(want, name, key)
            assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(b, torch.Tensor) else a == b, (name, key)


@pytest.mark.slow
def test_checkpoint_saved_at_2_ranks_loads_at_4(saved):
    folder, ranks = saved
    loaded = run_workers("dist_fsdp_optim.py", 4, "load", str(folder), timeout=TIMEOUT)
    assert_same_state([r["loaded"] for r in loaded], [r["saved"] for r in ranks])
    # O1: torch's AdamW leaves each FP16 shard its own scale; saving agrees them, so values re-shard.
    for name in ranks[0]["o1_saved"]:
        saved_value = torch.cat([r["o1_saved"][name] for r in ranks])
        assert torch.equal(torch.cat([r["o1_loaded"][name] for r in loaded]), saved_value), name


@pytest.mark.slow
def test_checkpoint_saved_at_2_ranks_loads_in_one_process(saved):
    folder, ranks = saved
    model = worker.tiny_gpt()
    opt = worker.optimizer(model)
    load_fsdp_checkpoint(folder / "dcp", model, opt)
    assert_same_state([worker.snapshot(model, opt)], [r["saved"] for r in ranks])


@pytest.mark.slow
def test_resume_at_2_ranks_continues_bit_for_bit(saved):
    folder, ranks = saved
    resumed = run_workers("dist_fsdp_optim.py", 2, "resume", str(folder), timeout=TIMEOUT)
    for r, run in zip(resumed, ranks):
        assert all(torch.equal(a, b) for a, b in zip(r["losses"], run["losses"]))
    assert_same_state([r["final"] for r in resumed], [r["final"] for r in ranks])


def test_load_refuses_a_missing_folder(tmp_path):
    model = worker.tiny_gpt()
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        load_fsdp_checkpoint(tmp_path / "nothing", model, worker.optimizer(model))


class _Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_non_tensor_entries_that_would_run_code_are_refused():
    class Item:  # what DCP hands a planner for a non-tensor entry
        class dest_index:
            fqn = "optim.param_groups"

    hostile = io.BytesIO()
    torch.save({"lr": 0.1, "hook": _Payload()}, hostile)
    hostile.seek(0)
    with pytest.raises(CheckpointError, match="'optim.param_groups' is not plain data"):
        PlainDataLoadPlanner().load_bytes(Item, hostile)
