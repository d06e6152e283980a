"""FSDP2 with the fine-grained recipes on a mixture's experts (2 gloo ranks,
tests/dist_fsdp_grouped.py): each expert's weight travels as the recipe's operand, as an
`FP8Linear`'s does (tests/test_fsdp_recipes.py): the gathered operand is `quantize_operand` of
the expert's weight bit for bit, the bytes are the payload and the scales, nothing the forward
saves copies a gathered expert, a resharded expert holds no bytes, the first step's outputs are
one process's, and a few training steps stay within 1 % of one process; at O2 (FP16-stored
experts) and O1 (plain FP32 ones, `BlockGatheredWeight` shards)."""

import pytest
import torch

import fp8lm
from dist_fsdp_grouped import EXPERTS, HIDDEN, IN, RECIPES
from dist_fsdp_recipes import LEVELS, assert_trains_as_one_process
from dist_fsdp_recipes import level_results as _of
from dist_launch import run_workers
from fp8lm.block_tensor import shards_whole_blocks
from fp8lm.ops.finegrained import quantize_operand

WORLD = 2
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks():
    return run_workers("dist_fsdp_grouped.py", WORLD, timeout=900.0)


def _operand(weight: torch.Tensor, recipe: str):
    return quantize_operand(weight, fp8lm.Recipe.from_name(recipe), "weight", dim=1)


def test_every_recipe_shards_these_experts_in_whole_blocks():
    for recipe in RECIPES:
        assert shards_whole_blocks(fp8lm.Recipe.from_name(recipe), (HIDDEN, IN), WORLD)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_gathered_expert_is_the_recipes_operand_bit_for_bit(ranks, recipe, level):
    for r in ranks:
        for e in range(EXPERTS):
            got = _of(r, level, recipe)["gathered"][e]
            assert got["type"] == "BlockScaledTensor"
            op = _operand(_of(r, level, recipe)["weights"][e], recipe)
            assert got["block"] == op.block
            assert torch.equal(got["payload"], op.payload.view(torch.uint8))
            assert torch.equal(got["d"], op.d)


def test_torch_fully_shard_gathers_the_experts_as_fp8lms_does(ranks):
    """torch's own ``fully_shard`` hands an expert's all-gather the `ExpertWeights` list that holds
    it, which knows its layer: the same operands, and E4M3 under a tensorwise recipe."""
    for r in ranks:
        for recipe in RECIPES:
            for got, ours in zip(r["torch_fully_shard"][recipe], r[recipe]["gathered"]):
                assert got["type"] == "BlockScaledTensor"
                assert torch.equal(got["payload"], ours["payload"]) and torch.equal(got["d"], ours["d"])
        for got in r["torch_fully_shard"]["tensorwise-delayed"]:
            assert got["type"] == "ScalingTensor" and got["payload_dtype"] == torch.float8_e4m3fn


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_later_gathers_bring_the_trained_experts_operands(ranks, recipe, level):
    for e in range(EXPERTS):
        op = _operand(torch.cat([_of(r, level, recipe)["final_shards"][e] for r in ranks]), recipe)
        for r in ranks:
            got = _of(r, level, recipe)["final_gathered"][e]
            assert torch.equal(got["payload"], op.payload.view(torch.uint8))
            assert torch.equal(got["d"], op.d)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_experts_travel_as_payload_and_scales(ranks, recipe, level):
    """One byte per element (nvfp4: half a byte) and the scales of the shard's rows or blocks, where
    the experts' stored FP16 took two bytes per element."""
    shard_rows = HIDDEN // WORLD
    for r in ranks:
        d_numel = _of(r, level, recipe)["gathered"][0]["d"].numel() // WORLD
        if recipe.startswith("nvfp4"):  # E2M1 two to a byte, one E4M3 byte per 16 x 16 block
            per_expert = shard_rows * IN // 2 + d_numel
        else:
            pow2 = recipe in ("rowwise", "rowwise-wgrad-bf16", "mxfp8")  # E8M0 bytes, else FP32
            per_expert = shard_rows * IN + (1 if pow2 else 4) * d_numel
        assert _of(r, level, recipe)["gathered"][0]["handed"] == EXPERTS * per_expert


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_forward_saves_no_copy_of_a_gathered_expert(ranks, recipe, level):
    """FSDP2 frees the gathered experts after the forward and gathers them again for the backward;
    a copy (an expert's operand, or all of them stacked) saved in the forward would hold them until
    then."""
    for r in ranks:
        assert _of(r, level, recipe)["saved_copies"] == []


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_resharded_expert_holds_nothing(ranks, recipe, level):
    for r in ranks:
        for key in ("gathered", "final_gathered"):
            assert [g["held_after_reshard"] for g in _of(r, level, recipe)[key]] == [0] * EXPERTS


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_first_step_outputs_equal_one_process(ranks, recipe, level):
    for r in ranks:
        assert torch.equal(_of(r, level, recipe)["out"], _of(r, level, recipe)["ref_out"])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_losses_within_one_percent_of_one_process(ranks, recipe, level):
    for r in ranks:
        assert_trains_as_one_process(_of(r, level, recipe))
