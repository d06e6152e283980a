"""FP8 layers switched to high precision under FSDP2 (2 gloo ranks, tests/dist_fsdp_high_precision.py),
as a fallback or precision annealing switches them: FSDP2 keeps a parameter's all-gather buffers
from its first all-gather, so `fp8lm.distributed.refresh_gathers` lets it gather anew. Switched,
the sharded model computes what one process does bit for bit: the weights travel as they are
stored (O2 FP16, O1 FP32, O3 E4M3), not as the E4M3 or 4-bit operand of the FP8 GEMMs, and their
gradients are reduced in BF16, not E4M3. Switched back, it computes as before the switch."""

import pytest

from dist_fsdp_high_precision import CASES, HIDDEN, IN, OUT
from dist_launch import run_workers

WORLD = 2
STORED = {"O1": "torch.float32", "O2": "torch.float16", "O3": "torch.float8_e4m3fn"}


@pytest.fixture(scope="module")
def rank0():
    return run_workers("dist_fsdp_high_precision.py", WORLD, timeout=600.0)[0]


def _phases(rank0) -> dict:
    return {
        **{f"{level} {recipe}": rank0[f"{level}-{recipe}"] for level, recipe in CASES},
        **{f"O2 {recipe} experts": res for recipe, res in rank0["experts"].items()},
    }


def test_switched_layers_compute_as_one_process_bit_for_bit(rank0):
    for name, res in _phases(rank0).items():
        high = res["high"]
        assert high["out"] == 0.0 and all(g == 0.0 for g in high["grads"]), (name, high)


def test_switched_back_the_model_computes_as_before(rank0):
    for name, res in _phases(rank0).items():
        assert res["back"] == res["fp8"], name


@pytest.mark.parametrize(("level", "recipe"), CASES)
def test_switched_weights_travel_as_stored(rank0, level, recipe):
    res = rank0[f"{level}-{recipe}"]
    kinds = res["high"]["kinds"]
    if level == "O1" and recipe == "blockwise":  # shards of 64 rows would split its 128-row blocks
        assert kinds == [f"ScalingTensor:{STORED[level]}", "Parameter:torch.float32"]
    else:
        assert kinds == [f"ScalingTensor:{STORED[level]}"] * 2
    fp8_kinds = res["fp8"]["kinds"]
    if recipe == "tensorwise-delayed":
        assert fp8_kinds == ["ScalingTensor:torch.float8_e4m3fn"] * 2
    else:
        assert all(k.startswith("BlockScaledTensor") for k in fp8_kinds[:1])


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_bytes_follow_the_switch(rank0, level):
    """Per step each rank gathers its half of each weight twice (forward, and backward after
    FSDP2 resharded it) and hands its whole gradient buffer to the reduction: a switched layer's
    weight in its stored bytes instead of E4M3's one, its gradient in BF16's two."""
    res = rank0[f"{level}-tensorwise-delayed"]
    weight_elements = IN * HIDDEN + HIDDEN * OUT
    stored_bytes = {"O1": 4, "O2": 2, "O3": 1}[level]
    gathered = 2 * weight_elements // WORLD * (stored_bytes - 1)
    assert res["high"]["all_gather"] - res["fp8"]["all_gather"] == gathered
    assert res["high"]["reduce"] - res["fp8"]["reduce"] == weight_elements * (2 - 1)


def test_torchs_fully_shard_needs_the_call(rank0):
    """torch's own ``fully_shard`` runs no hook of fp8lm's: the switched layers multiply the E4M3
    weights gathered for their FP8 GEMMs until `refresh_gathers` (or `precompute_fp8_scales`)."""
    res = rank0["torch"]
    assert res["stale_out"] > 0 and res["stale_kinds"] == ["ScalingTensor:torch.float8_e4m3fn"] * 2
    assert res["refreshed"] == 2 and res["again"] == 0
    assert res["out"] == 0.0 and res["kinds"] == ["ScalingTensor:torch.float16"] * 2


def test_weights_held_unsharded_wait_for_the_next_call(rank0):
    """Within a step (FSDP2 holds the weight unsharded) nothing is let go; the next call does it."""
    assert rank0["not_between_steps"] == {"unsharded": 1, "sharded": 1}
