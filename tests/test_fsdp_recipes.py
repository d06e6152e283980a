"""FSDP2 with the fine-grained recipes (2 gloo ranks, tests/dist_fsdp_recipes.py): each rank
sends its rows of the weight as the recipe's E4M3 operand with the scales of its rows or blocks;
the gathered operand is `fake_quantize(weight, recipe, "weight")` bit for bit, the bytes are the
payload and the scales, the first step's outputs are one process's, and a few training steps
stay within 1 % of one process (the ranks' batches as its micro-batches). A weight whose shards would split its blocks
is gathered in its stored FP16 (exact). The same at O1 (plain FP32 weights, `BlockGatheredWeight`
shards; torch's AdamW), where a weight whose shards would split its blocks travels in FP32."""

import pytest
import torch

import fp8lm
from dist_fsdp_recipes import HIDDEN, IN, LEVELS, OUT, RECIPES, assert_trains_as_one_process
from dist_fsdp_recipes import level_results as _of
from dist_launch import run_workers
from fp8lm.block_tensor import shards_whole_blocks
from fp8lm.ops.finegrained import quantize_operand

WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    return run_workers("dist_fsdp_recipes.py", WORLD, timeout=900.0)


def _blocked(recipe: str, rows: int, cols: int) -> bool:
    return shards_whole_blocks(fp8lm.Recipe.from_name(recipe), (rows, cols), WORLD)


@pytest.mark.slow
def test_one_rank_trains_as_the_unsharded_model():
    """On one rank FSDP2 skips the all-gather and reads only the first of its inputs: the weights
    stay in their stored format there (a recipe's payload and scales would not reach the layer)."""
    (res,) = run_workers("dist_fsdp_recipes.py", 1, "one_rank", timeout=600.0)
    for level in LEVELS:
        for recipe in RECIPES:
            assert res[level][recipe] == {"out_equal": True, "grads_equal": True}, (level, recipe)


def test_which_shards_hold_whole_blocks():
    recipe = fp8lm.Recipe.from_name
    assert shards_whole_blocks(recipe("blockwise"), (256, 64), 2)
    assert not shards_whole_blocks(recipe("blockwise"), (96, 64), 2)  # 48 rows a shard
    assert not shards_whole_blocks(recipe("blockwise"), (384, 64), 2)  # 192 rows
    assert shards_whole_blocks(recipe("blockwise"), (200, 64), 1)
    assert shards_whole_blocks(recipe("rowwise"), (96, 64), 2)
    assert shards_whole_blocks(recipe("mxfp8"), (6, 64), 3)
    assert not shards_whole_blocks(recipe("mxfp8"), (7, 64), 2)  # uneven: FSDP2 pads a shard
    assert shards_whole_blocks(recipe("nvfp4"), (96, 64), 2)
    assert not shards_whole_blocks(recipe("nvfp4"), (40, 64), 2)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_gathered_weight_is_the_recipes_operand_bit_for_bit(ranks, recipe, level):
    for r in ranks:
        for i, (rows, cols) in enumerate([(HIDDEN, IN), (OUT, HIDDEN)]):
            got, weight = _of(r, level, recipe)["gathered"][i], _of(r, level, recipe)["weights"][i]
            if not _blocked(recipe, rows, cols):  # the stored values, exact
                stored = torch.float16 if level == "O2" else torch.float32
                assert got["type"] == ("ScalingTensor" if level == "O2" else "Parameter")
                assert got["payload_dtype"] == stored
                continue
            assert got["type"] == "BlockScaledTensor"
            op = quantize_operand(weight, fp8lm.Recipe.from_name(recipe), "weight", dim=1)
            assert got["block"] == op.block
            assert torch.equal(got["payload"], op.payload.view(torch.uint8))
            assert torch.equal(got["d"], op.d)
            assert torch.equal(got["values"], fp8lm.fake_quantize(weight, recipe, "weight"))


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_later_gathers_bring_the_trained_weights_operand(ranks, recipe, level):
    """Four optimizer steps later FSDP2 has refilled the gathered payload and scale bytes in place;
    the weight it gives is the operand of the trained weight (the concatenated shards)."""
    for i, (rows, cols) in enumerate([(HIDDEN, IN), (OUT, HIDDEN)]):
        if not _blocked(recipe, rows, cols):
            continue
        weight = torch.cat([_of(r, level, recipe)["final_shards"][i] for r in ranks])
        op = quantize_operand(weight, fp8lm.Recipe.from_name(recipe), "weight", dim=1)
        for r in ranks:
            got = _of(r, level, recipe)["final_gathered"][i]
            assert torch.equal(got["payload"], op.payload.view(torch.uint8))
            assert torch.equal(got["d"], op.d)


@pytest.mark.slow
def test_mxfp8_scales_moved_in_training_so_stale_ones_would_show(ranks):
    first, final = ranks[0]["mxfp8"]["gathered"][0]["d"], ranks[0]["mxfp8"]["final_gathered"][0]["d"]
    assert not torch.equal(first, final)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_all_gather_sends_the_payload_and_the_scales(ranks, recipe, level):
    for r in ranks:
        for i, (rows, cols) in enumerate([(HIDDEN, IN), (OUT, HIDDEN)]):
            got = _of(r, level, recipe)["gathered"][i]
            shard_rows = rows // WORLD
            bias = 4 * shard_rows  # the FP32 bias shard travels in the same all-gather
            if recipe.startswith("nvfp4") and _blocked(recipe, rows, cols):  # E2M1 two to a byte, E4M3 block scales
                assert got["packed"]
                assert got["handed"] == shard_rows * cols // 2 + got["d"].numel() // WORLD + bias
            elif _blocked(recipe, rows, cols):
                pow2 = recipe in ("rowwise", "rowwise-wgrad-bf16", "mxfp8")  # E8M0 bytes, else FP32
                scales = (1 if pow2 else 4) * got["d"].numel() // WORLD
                assert got["handed"] == shard_rows * cols + scales + bias
            else:  # the stored values: FP16 at O2, FP32 at O1
                assert got["handed"] == (2 if level == "O2" else 4) * shard_rows * cols + bias


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_precomputed_scales_leave_the_gather_no_all_reduce(ranks, recipe, level):
    """`precompute_fp8_scales` agrees every gathered weight's scale, and nvfp4's per-tensor amax,
    in one all-reduce for the model: the all-gathers themselves reduce nothing (up to commit
    eae2fe7 each nvfp4 weight's gather, forward and backward, all-reduced its amax)."""
    for r in ranks:
        for key in ("gathered", "final_gathered"):
            assert [g["all_reduces"] for g in _of(r, level, recipe)[key]] == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_forward_saves_no_copy_of_a_gathered_weight(ranks, recipe, level):
    """The backward's weight operand is the gathered one, which FSDP2 frees after the forward and
    gathers again for the backward; rowwise and mxfp8 requantize it along out_features there. A
    copy saved in the forward would hold every layer's unsharded weight until its backward."""
    assert any(_blocked(recipe, rows, cols) for rows, cols in [(HIDDEN, IN), (OUT, HIDDEN)])
    for r in ranks:
        assert _of(r, level, recipe)["saved_copies"] == []


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_resharded_weight_holds_nothing(ranks, recipe, level):
    """Once FSDP2 reshards, the gathered weight holds no bytes: its payload and scales are views
    of the all-gather buffers FSDP2 frees (E8M0 and E4M3 scale bytes are decoded for each use,
    not kept decoded on the weight between steps)."""
    for r in ranks:
        for i, (rows, cols) in enumerate([(HIDDEN, IN), (OUT, HIDDEN)]):
            if _blocked(recipe, rows, cols):
                assert _of(r, level, recipe)["gathered"][i]["held_after_reshard"] == 0
                assert _of(r, level, recipe)["final_gathered"][i]["held_after_reshard"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_first_step_outputs_equal_one_process(ranks, recipe, level):
    for r in ranks:
        assert torch.equal(_of(r, level, recipe)["out"], _of(r, level, recipe)["ref_out"])


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_losses_within_one_percent_of_one_process(ranks, recipe, level):
    for r in ranks:
        assert_trains_as_one_process(_of(r, level, recipe))
