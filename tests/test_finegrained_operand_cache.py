"""A fine-grained recipe's weight operands are quantized once per change of the weight, as the
tensorwise operand is cast once: the micro-batches of one optimizer step (and evaluation
batches) reuse them, with the same bytes, so outputs and gradients are those of a layer that
quantizes its weight in every forward."""

import copy

import pytest
import torch
from torch import nn

import fp8lm
import fp8lm.nn.finegrained as layer_gemms
from fp8lm.tensor import fsdp_gathered, fsdp_unsharded

RECIPES = ("rowwise", "blockwise", "mxfp8", "nvfp4")
SQUARE = ("blockwise", "nvfp4")  # one quantization of the weight serves both its GEMMs


def recipe(name: str, backend: str = "scaled_mm") -> fp8lm.Recipe:
    # On the CPU the FP8 GEMM backend is asked for, as it is chosen on a GPU: torch._scaled_mm
    # where it takes the operands, the exact emulation of the same operands elsewhere.
    return fp8lm.Recipe.from_name(name).replace(backend=backend)


@pytest.fixture
def weight_quantizations(monkeypatch) -> list:
    """The dims along which layers quantized a weight, in order."""
    calls: list = []
    real = layer_gemms.quantize_operand

    def counted(x, recipe, role, dim=1, *args, **kwargs):
        if role == "weight":
            calls.append(dim)
        return real(x, recipe, role, dim, *args, **kwargs)

    monkeypatch.setattr(layer_gemms, "quantize_operand", counted)
    return calls


def micro_batch(layer: nn.Module, seed: int) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and the weight gradient accumulated so far, of one micro-batch."""
    x = torch.randn(4, 32, 128, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    torch.manual_seed(seed)  # nvfp4's stochastic rounding of the output gradient
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().square().mean().backward()
    return y.detach(), x.grad, layer.weight.grad.dequantize().clone()


@pytest.mark.parametrize("name", RECIPES)
def test_micro_batches_quantize_the_weight_once_with_the_same_results(weight_quantizations, name):
    torch.manual_seed(0)
    kept = fp8lm.nn.FP8Linear(128, 64, recipe=recipe(name))
    anew = copy.deepcopy(kept)
    once = 1 if name in SQUARE else 2  # the forward's operand, and the input gradient's
    for seed in range(3):
        before = len(weight_quantizations)
        kept_results = micro_batch(kept, seed)
        assert weight_quantizations[before:] == ([1] if name in SQUARE else [1, 0])[: once if seed == 0 else 0]
        anew._weight_operand.clear()  # as a layer without the cache
        for a, b in zip(kept_results, micro_batch(anew, seed)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", RECIPES)
def test_a_change_of_the_weight_quantizes_it_again(weight_quantizations, name):
    """An optimizer step, an in-place op and a load each change what the GEMMs read."""
    torch.manual_seed(0)
    layer = fp8lm.nn.FP8Linear(128, 64, recipe=recipe(name))
    opt = fp8lm.optim.FP8AdamW(layer.parameters(), lr=1e-2)
    micro_batch(layer, 0)
    opt.step()
    changes = {
        "optimizer step": lambda: None,
        "in-place op": lambda: layer.weight.data.mul_(0.5),
        "load": lambda: layer.load_state_dict({k: v * 2 for k, v in layer.state_dict().items()}),
    }
    for what, change in changes.items():
        change()
        before = len(weight_quantizations)
        results = micro_batch(layer, 1)
        assert weight_quantizations[before:], f"the weight was not quantized again after a {what}"
        fresh = copy.deepcopy(layer)  # a copy starts with no kept operands
        fresh.weight.grad = None
        layer.weight.grad = None
        for a, b in zip(micro_batch(layer, 2), micro_batch(fresh, 2)):
            assert torch.equal(a, b), what
        assert results[0].shape == (4, 32, 64)


def test_evaluation_batches_reuse_the_operand(weight_quantizations):
    layer = fp8lm.nn.FP8Linear(128, 64, recipe=recipe("mxfp8"))
    x = torch.randn(8, 128)
    with torch.no_grad():
        first = layer(x)
        assert torch.equal(layer(x), first)
    assert weight_quantizations == [1]  # no input gradient: one operand, made once


@pytest.mark.parametrize("backend", ["emulated", "auto"])  # "auto": the emulation on the CPU
def test_only_an_fp8_gemm_backend_keeps_operands(weight_quantizations, backend):
    """As for the tensorwise operand: the emulation's layers quantize in every forward."""
    layer = fp8lm.nn.FP8Linear(128, 64, recipe=recipe("blockwise", backend))
    micro_batch(layer, 0)
    micro_batch(layer, 1)
    assert weight_quantizations == [1, 1]


def test_a_plain_weight_keeps_no_operand(weight_quantizations):
    """A plain parameter (O1's FP32 weight) can change through ``.data`` without a new version:
    a kept operand could go stale unseen, so none is kept."""
    layer = fp8lm.nn.FP8Linear(128, 64, bias=False, recipe=recipe("rowwise"))
    layer.weight = nn.Parameter(layer.weight.dequantize())
    layer.weight.grad = None
    x = torch.randn(8, 128)
    with torch.no_grad():
        first = layer(x)
        layer.weight.data = layer.weight.data * 2  # no in-place op: the version stays
        assert torch.equal(layer(x), first * 2)  # rowwise scales are powers of two: exact
    assert weight_quantizations == [1, 1]


def test_a_weight_fsdp2_gathered_in_its_own_format_keeps_no_operand(weight_quantizations):
    """Such a weight's payload is FSDP2's all-gather buffer, freed after each use: operands kept
    of it would hold the unsharded weight between steps. (Made here as FSDP2 makes it: the
    gathered ScalingTensor, wrapped in a parameter.)"""
    layer = fp8lm.nn.FP8Linear(128, 64, recipe=recipe("mxfp8"))
    stored = layer.weight.detach()
    wire = stored.payload.reshape(-1).view(torch.uint8)
    gathered, _ = fsdp_gathered((wire,), (stored.payload.dtype, stored.scale), torch.float32)
    layer.weight = nn.Parameter(gathered.view(64, 128))
    assert fsdp_unsharded(layer.weight) and not fsdp_unsharded(stored)
    with torch.no_grad():
        layer(torch.randn(8, 128))
        layer(torch.randn(8, 128))
    assert weight_quantizations == [1, 1]
    assert layer._weight_operand.operands(layer.weight) == {}


def test_torch_compile_quantizes_in_the_graph(weight_quantizations):
    """A compiled forward quantizes the weight in its graph and keeps nothing."""
    layer = fp8lm.nn.FP8Linear(128, 64, recipe=recipe("rowwise"))
    x = torch.randn(8, 128)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
    assert layer._weight_operand.operands(layer.weight) != {}  # the eager call's
    layer._weight_operand.clear()
    with torch.no_grad():
        compiled(x)
    assert layer._weight_operand.operands(layer.weight) == {}


@pytest.mark.parametrize("name", ["blockwise", "mxfp8", "nvfp4"])
def test_experts_keep_their_operands_too(weight_quantizations, name):
    """An FP8GroupedLinear's blockwise, mxfp8 and nvfp4 experts (one fine-grained GEMM each) keep
    their weights' operands as FP8Linear does: each expert's weight is quantized once, an
    expert without tokens not at all, with the results of experts that quantize in every forward."""
    torch.manual_seed(0)
    kept = fp8lm.nn.FP8GroupedLinear(4, 128, 64, recipe=recipe(name))
    anew = copy.deepcopy(kept)
    counts = [48, 0, 16, 64]  # 128 tokens; the second expert gets none

    def micro_batch(layer, seed):
        x = torch.randn(128, 128, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        torch.manual_seed(seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x, counts)
        y.float().square().mean().backward()
        return y.detach(), x.grad, *(w.grad.dequantize().clone() for w in layer.weight)

    per_expert = 1 if name in SQUARE else 2
    for seed in range(3):
        before = len(weight_quantizations)
        kept_results = micro_batch(kept, seed)
        assert len(weight_quantizations) - before == (3 * per_expert if seed == 0 else 0)
        for cache in anew._weight_operands:
            cache.clear()
        for a, b in zip(kept_results, micro_batch(anew, seed)):
            assert torch.equal(a, b)
    assert kept.kept_operands() and fp8lm.memory_report(kept)["weight_operands"] > 0
    kept.load_state_dict(kept.state_dict())
    assert kept.kept_operands() == []


@pytest.mark.parametrize("name", ["tensorwise-delayed", *RECIPES])
def test_keep_weight_operands_off_keeps_nothing_with_the_same_results(name):
    """``keep_weight_operands = False`` (a hook point, as ``fp8_enabled``): every forward makes the
    weight's operands anew and nothing stays between forwards (switched off after a forward,
    what was kept goes at the next), for the same outputs and gradients."""
    torch.manual_seed(0)
    kept = fp8lm.nn.FP8Linear(128, 64, recipe=recipe(name))
    anew = copy.deepcopy(kept)
    micro_batch(anew, 0)
    assert anew.kept_operands()
    anew.zero_grad(set_to_none=True)
    anew.keep_weight_operands = False
    for seed in range(2):
        for a, b in zip(micro_batch(kept, seed), micro_batch(anew, seed)):
            assert torch.equal(a, b)
        assert anew.kept_operands() == [] and kept.kept_operands()
    assert fp8lm.memory_report(anew)["weight_operands"] == 0


@pytest.mark.parametrize("name", ["tensorwise-delayed", "rowwise", "blockwise"])
def test_experts_keep_nothing_with_keep_weight_operands_off(name):
    torch.manual_seed(0)
    layer = fp8lm.nn.FP8GroupedLinear(4, 128, 64, recipe=recipe(name))
    x = torch.randn(64, 128)
    with torch.no_grad():
        first = layer(x, [16, 16, 16, 16])
        assert layer.kept_operands()
        layer.keep_weight_operands = False
        assert torch.equal(layer(x, [16, 16, 16, 16]), first)
    assert layer.kept_operands() == []
