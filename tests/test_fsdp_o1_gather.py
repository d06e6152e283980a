"""O1 on FSDP2 (gloo ranks, tests/dist_fsdp_o1.py): the FP32 weights of FP8 GEMMs are all-gathered
as E4M3 bytes (1 per element) with one agreed scale, the gathered operand is exactly the cast of
the whole FP32 weight, so training equals one process's bit for bit (same batch on every rank)
and torch's FSDP2 with FP32 all-gathers (own batches); torch's AdamW and Distributed Checkpoint
keep working on the FP32 shards."""

import copy

import pytest
import torch
from torch import nn

import dist_fsdp_o1 as worker
import fp8lm
from dist_launch import run_workers
from fp8lm import E4M3
from fp8lm.distributed import load_fsdp_checkpoint
from fp8lm.distributed.fp32_gather import (
    AutocastGatheredWeight,
    BlockGatheredWeight,
    FP8GatheredWeight,
    fsdp_wire_cast,
    wrap_fp32_weights,
)
from fp8lm.ops.cast import saturating_cast
from fp8lm.scaling import compute_scale

TIMEOUT = 600.0  # FSDP2 workers import torch.distributed's whole stack: slow on a loaded machine
FP8_WEIGHTS = ("0.weight", "2.weight", "4.weight")  # the weights of the FP8 GEMMs; the biases stay FP32


def padded_shard_numel(shape, world: int) -> int:
    rows = -(-shape[0] // world)
    return rows * (shape[1] if len(shape) > 1 else 1)


@pytest.fixture(scope="module")
def same_batch():
    return run_workers("dist_fsdp_o1.py", 2, "same_batch", timeout=TIMEOUT)


@pytest.fixture(scope="module")
def wire():
    return run_workers("dist_fsdp_o1.py", 2, "wire", timeout=TIMEOUT)


@pytest.mark.slow
def test_training_on_the_same_batch_equals_one_process_bit_for_bit(same_batch):
    for r in same_batch:
        assert r["wrapped"] == sorted(FP8_WEIGHTS)
        sharded, single = r["sharded"], r["single"]
        for got, want in zip(sharded["outs"], single["outs"], strict=True):
            assert torch.equal(got, want)
        assert torch.equal(torch.stack(sharded["losses"]), torch.stack(single["losses"]))
        for name, want in single["weights"].items():
            assert want.dtype == torch.float32
            assert torch.equal(sharded["weights"][name], want), name
        # the weights moved: AdamW stepped on the FP32 shards
        assert not torch.equal(sharded["losses"][0], sharded["losses"][-1])


FULL_SHAPES = {
    "0.weight": (32, 16),
    "2.weight": (13, 32),
    "4.weight": (8, 13),
    "0.bias": (32,),
    "2.bias": (13,),
    "4.bias": (8,),
}


@pytest.mark.slow
def test_each_rank_holds_its_fp32_shards(same_batch):
    # the storage of the padded FP32 shards (the wrapped weights' included), once each
    padded = sum(padded_shard_numel(s, len(same_batch)) for s in FULL_SHAPES.values())
    for r in same_batch:
        assert r["memory"]["weights"] == 4 * padded


@pytest.mark.slow
def test_fp8_gemm_weights_cross_as_one_byte_per_element(wire):
    world = len(wire)
    full_shapes = FULL_SHAPES
    assert set(wire[0]["shards"]) == set(full_shapes)
    weights = sum(padded_shard_numel(full_shapes[n], world) for n in FP8_WEIGHTS)
    others = sum(padded_shard_numel(s, world) for n, s in full_shapes.items() if n not in FP8_WEIGHTS)
    for r in wire:
        fp8, fp32 = r["fp8_forward"]["stats"], r["fp32_forward"]["stats"]
        # one all-gather per layer; the E4M3 weights and the FP32 biases each rank hands over
        assert fp8["all_gather_calls"] == fp32["all_gather_calls"] == 3
        assert fp8["all_gather_handed_bytes"] == weights * 1 + others * 4
        assert fp32["all_gather_handed_bytes"] == weights * 4 + others * 4
        for fp8_step, fp32_step in zip(r["fp8"]["stats"], r["fp32"]["stats"], strict=True):
            # the same collectives; forward and backward each gather every weight, 3 bytes less per element
            assert fp8_step["all_gather_calls"] == fp32_step["all_gather_calls"]
            saved = fp32_step["all_gather_handed_bytes"] - fp8_step["all_gather_handed_bytes"]
            assert saved >= 2 * 3 * weights


@pytest.mark.slow
def test_gathered_weight_is_the_e4m3_cast_of_the_whole_fp32_weight(wire):
    whole = torch.cat([r["shards"]["2.weight"] for r in wire])  # 13 rows: 7 and 6
    assert [r["shards"]["2.weight"].shape[0] for r in wire] == [7, 6]
    scale = compute_scale(whole.abs().max(), E4M3)
    for r in wire:
        payload, gathered_scale = r["fp8_forward"]["gathered"]
        assert payload.dtype == torch.float8_e4m3fn
        assert torch.equal(gathered_scale, scale)
        assert torch.equal(payload.view(torch.uint8), saturating_cast(whole, scale, E4M3).view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("run", ["fp8", "fp8_own_scales"])
def test_training_equals_fsdp2_with_fp32_all_gathers(wire, run):
    """With the scales agreed by precompute_fp8_scales, or by each all-gather for its weight."""
    for r in wire:
        fp8, fp32 = r[run], r["fp32"]
        for got, want in zip(fp8["outs"], fp32["outs"], strict=True):
            assert torch.equal(got, want)
        assert torch.equal(torch.stack(fp8["losses"]), torch.stack(fp32["losses"]))
        for name, want in fp32["weights"].items():
            assert torch.equal(fp8["weights"][name], want), name
    own, agreed = wire[0]["fp8_own_scales"]["stats"][0], wire[0]["fp8"]["stats"][0]
    if run == "fp8_own_scales":  # a 4-byte MAX all-reduce per FP8 weight and all-gather
        assert own["all_reduce_calls"] == 2 * len(FP8_WEIGHTS) and agreed["all_reduce_calls"] == 0


@pytest.mark.slow
def test_an_int_reshard_after_forward_keeps_fp32_all_gathers():
    for r in run_workers("dist_fsdp_o1.py", 4, "int_reshard", timeout=TIMEOUT):
        assert r["wrapped"] == []
        assert torch.equal(torch.stack(r["run"]["losses"]), torch.stack(r["default"]["losses"]))


@pytest.mark.slow
def test_checkpoint_saved_and_loaded_resumes_bit_for_bit(tmp_path):
    saved = run_workers("dist_fsdp_o1.py", 2, "save", str(tmp_path), timeout=TIMEOUT)
    loaded = run_workers("dist_fsdp_o1.py", 2, "load", str(tmp_path), timeout=TIMEOUT)
    for s, l in zip(saved, loaded, strict=True):
        for name, value in s["saved"].items():
            assert value.dtype == torch.float32 and torch.equal(l["loaded"][name], value), name
        assert torch.equal(torch.stack(l["losses"]), torch.stack(s["losses"]))
    # plain FP32 tensors in the folder: they load into one process's unsharded O1 model
    model = worker.o1_model()
    load_fsdp_checkpoint(tmp_path / "dcp", model, torch.optim.AdamW(model.parameters(), lr=worker.LR))
    for name, p in model.named_parameters():
        assert type(p.data) is torch.Tensor and torch.equal(p.detach(), saved[0]["saved"][name]), name


# -- the wrapper in one process ---------------------------------------------------------------------


def test_the_wrapper_is_its_fp32_values_to_torch_ops():
    values = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    w = nn.Parameter(FP8GatheredWeight(values.clone()))
    assert isinstance(w, nn.Parameter) and isinstance(w.detach(), FP8GatheredWeight)
    assert w.dtype == torch.float32 and w.shape == (5, 3)
    doubled = w.detach() * 2  # a value op: a plain result
    assert type(doubled) is torch.Tensor and torch.equal(doubled, values * 2)
    assert type(torch.zeros_like(w)) is torch.Tensor  # what optimizer state is made of
    assert isinstance(w.detach().new_zeros((2, 3)), FP8GatheredWeight)  # FSDP2's padding of a shard
    assert torch.equal(w.detach()[1:3].inner, values[1:3])  # a view of the weight stays one


def test_torch_adamw_steps_the_wrapped_values_as_plain_ones():
    values = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    wrapped, plain = nn.Parameter(FP8GatheredWeight(values.clone())), nn.Parameter(values.clone())
    opts = [torch.optim.AdamW([p], lr=0.1, weight_decay=0.1) for p in (wrapped, plain)]
    for _ in range(3):
        for p, opt in zip((wrapped, plain), opts):
            p.grad = grad.clone()
            opt.step()
    assert isinstance(wrapped.detach(), FP8GatheredWeight)
    assert torch.equal(wrapped.detach().inner, plain.detach())
    assert all(type(v) is torch.Tensor for v in opts[0].state[wrapped].values())


def test_the_wrapper_pickles_and_copies_as_itself(tmp_path):
    w = nn.Parameter(FP8GatheredWeight(torch.arange(6.0).reshape(2, 3)))
    torch.save(w, tmp_path / "w.pt")
    for again in (torch.load(tmp_path / "w.pt", weights_only=True), copy.deepcopy(w)):
        assert isinstance(again, nn.Parameter) and isinstance(again.detach(), FP8GatheredWeight)
        assert torch.equal(again.detach().inner, w.detach().inner) and again.requires_grad
    flat, ctx = w.__tensor_flatten__()
    assert torch.equal(
        FP8GatheredWeight.__tensor_unflatten__({"_inner": w.inner}, ctx, w.shape, w.stride()).inner, w.inner
    )


def test_a_wrapped_layer_state_dict_is_plain():
    layer = nn.Linear(4, 3)
    assert wrap_fp32_weights(layer, {id(layer.weight)}) == 1
    assert isinstance(layer.weight.detach(), FP8GatheredWeight)
    state = layer.state_dict()
    assert type(state["weight"]) is torch.Tensor and torch.equal(state["weight"], layer.weight.detach().inner)
    assert isinstance(layer.state_dict(keep_vars=True)["weight"].detach(), FP8GatheredWeight)


def test_a_tied_weight_is_not_wrapped():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    assert wrap_fp32_weights(model, {id(a.weight)}) == 0


def test_only_plain_floating_tensors_are_wrapped():
    with pytest.raises(TypeError, match="FP8GatheredWeight wraps a plain floating-point tensor"):
        FP8GatheredWeight(torch.arange(3))


def test_the_wrapper_traces_under_torch_compile():
    values = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    w = FP8GatheredWeight(values.clone())

    def step(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        w.add_(g, alpha=-0.5)  # an optimizer's in-place update
        return w * 2

    doubled = torch.compile(step, fullgraph=True)(w, torch.ones(4, 3))
    assert torch.equal(w.inner, values - 0.5) and torch.equal(doubled, (values - 0.5) * 2)


# -- the output head under BF16 autocast -------------------------------------------------------------


@pytest.fixture(scope="module")
def autocast_head():
    return run_workers("dist_fsdp_o1.py", 2, "autocast_head", timeout=TIMEOUT)


@pytest.mark.slow
def test_the_head_weight_crosses_in_bf16_under_autocast(autocast_head):
    world = len(autocast_head)
    head = padded_shard_numel(FULL_SHAPES["4.weight"], world)
    whole = torch.cat([r["head_shard"] for r in autocast_head])
    for r in autocast_head:
        assert r["cast_wrapped"] == ["4.weight"] and r["kinds"]["4.weight"] == "AutocastGatheredWeight"
        assert r["kinds"]["2.weight"] == "FP8GatheredWeight"
        # the head's weight: 2 bytes per element instead of 4, the rest as before
        bf16, fp32 = r["forward"]["stats"], r["fp32_forward"]["stats"]
        assert fp32["all_gather_handed_bytes"] - bf16["all_gather_handed_bytes"] == 2 * head
        for bf16_step, fp32_step in zip(r["bf16"]["stats"], r["fp32"]["stats"], strict=True):
            assert bf16_step["all_gather_calls"] == fp32_step["all_gather_calls"]
            assert fp32_step["all_gather_handed_bytes"] - bf16_step["all_gather_handed_bytes"] >= 2 * 2 * head
        payload, scale = r["forward"]["gathered"]
        # what autocast casts the whole FP32 weight to
        assert payload.dtype == torch.bfloat16 and float(scale) == 1.0
        assert torch.equal(payload, whole.to(torch.bfloat16))


@pytest.mark.slow
def test_the_bf16_head_gather_trains_as_the_fp32_one_and_as_one_process(autocast_head):
    for r in autocast_head:
        for run, want in (("bf16", "fp32"), ("same_batch", "single")):
            got, ref = r[run], r[want]
            for a, b in zip(got["outs"], ref["outs"], strict=True):
                assert torch.equal(a, b), run
            assert torch.equal(torch.stack(got["losses"]), torch.stack(ref["losses"])), run
            for name, value in ref["weights"].items():
                assert value.dtype == torch.float32 and torch.equal(got["weights"][name], value), (run, name)
        assert not torch.equal(r["bf16"]["losses"][0], r["bf16"]["losses"][-1])


def test_the_autocast_wrapper_is_its_fp32_values_and_keeps_its_dtype(tmp_path):
    values = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    w = nn.Parameter(AutocastGatheredWeight(values.clone(), torch.float16))
    assert w.dtype == torch.float32 and type(w.detach() * 2) is torch.Tensor
    kept = [w.detach(), w.detach().new_zeros((2, 3)), w.detach()[1:3], copy.deepcopy(w).detach()]
    torch.save(w, tmp_path / "w.pt")
    kept.append(torch.load(tmp_path / "w.pt", weights_only=True).detach())
    for t in kept:
        assert isinstance(t, AutocastGatheredWeight) and t.gather_dtype == torch.float16
    flat, ctx = w.__tensor_flatten__()
    again = AutocastGatheredWeight.__tensor_unflatten__({"_inner": w.inner}, ctx, w.shape, w.stride())
    assert isinstance(again, AutocastGatheredWeight) and again.gather_dtype == torch.float16
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float16"):
        AutocastGatheredWeight(values, torch.float8_e4m3fn)


def test_the_block_wrapper_is_its_fp32_values_and_keeps_its_recipe(tmp_path):
    recipe = fp8lm.Recipe.from_name("mxfp8")
    values = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w = nn.Parameter(BlockGatheredWeight(values.clone(), recipe))
    assert w.dtype == torch.float32 and type(w.detach() * 2) is torch.Tensor
    torch.save(w, tmp_path / "w.pt")
    kept = [w.detach(), w.detach()[1:3], copy.deepcopy(w).detach(), torch.load(tmp_path / "w.pt", weights_only=False)]
    for t in kept:
        assert isinstance(t.detach(), BlockGatheredWeight) and t.detach().recipe == recipe
    flat, ctx = w.__tensor_flatten__()
    again = BlockGatheredWeight.__tensor_unflatten__({"_inner": w.inner}, ctx, w.shape, w.stride())
    assert isinstance(again, BlockGatheredWeight) and again.recipe == recipe and torch.equal(again.inner, values)
    with pytest.raises(ValueError, match="fine-grained recipe"):
        BlockGatheredWeight(values, fp8lm.Recipe.from_name("tensorwise-delayed"))


def test_autocast_wire_is_the_cast_autocast_makes():
    # values that round differently in BF16 and FP16, an overflow to inf and a zero-padded row
    shard = torch.tensor([[1.0 + 2**-9, 3e38], [-(2**-20), 70000.0]])
    for dtype in (torch.bfloat16, torch.float16):
        wire = fsdp_wire_cast(shard, dtype, (5, 2), 2)
        assert wire.dtype == dtype and wire.shape == (3, 2)
        assert torch.equal(wire[:2], shard.to(dtype)) and torch.equal(wire[2], torch.zeros(2, dtype=dtype))


def test_only_the_high_precision_layers_fp32_weights_are_cast_wrapped():
    import fp8lm
    from fp8lm.distributed.fsdp import _autocast_gemm_weights, _fp8_gemm_weights

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model, _ = fp8lm.initialize(model, None, "O1", multiple_of=1)  # the last: the output head
    cast_to = _autocast_gemm_weights(model, torch.bfloat16)
    assert cast_to == {id(model[1].weight): torch.bfloat16}
    assert wrap_fp32_weights(model, _fp8_gemm_weights(model), None, cast_to) == 2
    assert isinstance(model[0].weight.detach(), FP8GatheredWeight)
    assert isinstance(model[1].weight.detach(), AutocastGatheredWeight)
    assert type(model.state_dict()["1.weight"]) is torch.Tensor  # checkpoints: the plain FP32 values


def test_fully_shard_refuses_an_autocast_dtype_it_cannot_gather_in():
    from fp8lm.distributed import fully_shard

    with pytest.raises(ValueError, match="autocast_dtype is the dtype of the torch.autocast"):
        fully_shard(nn.Linear(2, 2), autocast_dtype=torch.float32)
