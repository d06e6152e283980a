"""`BlockScaledTensor` (the weight FSDP2 gathers in a fine-grained recipe's blocks) on its own:
what keeps its payload and scales, what reads its values, what it refuses, and the layer paths
that read it (the recipe's GEMMs with the gathered operand; a layer fallen back to high
precision)."""

import pytest
import torch
import torch.nn.functional as F

import fp8lm
from fp8lm.block_tensor import BlockScaledTensor
from fp8lm.nn import FP8Linear
from fp8lm.ops.finegrained import quantize_operand


def _weight(recipe: str = "mxfp8") -> tuple[torch.Tensor, BlockScaledTensor]:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    op = quantize_operand(w, fp8lm.Recipe.from_name(recipe), "weight", dim=1)
    return w, BlockScaledTensor(op.payload, op.d, op.block)


def test_views_of_the_whole_keep_payload_and_scales_and_values_are_the_operands():
    w, t = _weight()
    assert t.shape == (64, 96) and t.dtype == torch.float32
    for view in (t.detach(), torch.ops.aten.alias(t), t.view(64, 96), t.as_strided((64, 96), (96, 1))):
        assert isinstance(view, BlockScaledTensor) and view.operand.payload.data_ptr() == t.operand.payload.data_ptr()
    p = torch.nn.Parameter(t)  # as FSDP2 wraps a gathered weight
    assert isinstance(p, BlockScaledTensor) and p.requires_grad
    assert torch.equal(t.dequantize(), fp8lm.fake_quantize(w, "mxfp8", "weight"))
    assert torch.equal(t * 2, 2 * fp8lm.fake_quantize(w, "mxfp8", "weight"))  # a value op: plain
    assert not isinstance(t[:3], BlockScaledTensor)  # part of it: the values


def test_in_place_writes_are_refused_in_one_line():
    _, t = _weight()
    with pytest.raises(NotImplementedError, match="read-only"):
        t.add_(1.0)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_a_layer_multiplies_the_gathered_operand_as_its_own(recipe):
    """An FP8Linear whose weight is the gathered BlockScaledTensor of its own weight computes what
    it computes from the weight (forward bit for bit), and its weight gradient flows."""
    torch.manual_seed(0)
    layer = FP8Linear(128, 128, recipe=recipe)
    x = torch.randn(32, 128)
    ref = layer(x)
    values = layer.weight.dequantize()
    op = quantize_operand(values, layer.recipe, "weight", dim=1)
    layer.weight = torch.nn.Parameter(BlockScaledTensor(op.payload, op.d, op.block))
    y = layer(x)
    assert torch.equal(y, ref)
    y.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (128, 128)


def test_a_layer_in_high_precision_reads_its_values():
    torch.manual_seed(0)
    w, t = _weight()
    weight = torch.nn.Parameter(t)
    x = torch.randn(4, 96, requires_grad=True)
    y = F.linear(x, weight)
    assert torch.equal(y, F.linear(x, fp8lm.fake_quantize(w, "mxfp8", "weight")))
    y.sum().backward()
    assert weight.grad is not None and weight.grad.shape == (64, 96) and x.grad is not None


def test_a_packed_nvfp4_weight_is_its_operand_and_survives_flattening():
    """nvfp4 gathers its E2M1 elements packed two to a byte: the tensor presents the unpacked
    shape, its operand is `quantize_operand`'s (tensor scale included), and it flattens with it."""
    from fp8lm.ops import nvfp4

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    op = quantize_operand(w, fp8lm.Recipe.from_name("nvfp4"), "weight", dim=1)
    t = BlockScaledTensor(nvfp4.pack_e2m1_bytes(op.payload), op.d, op.block, tensor_scale=op.tensor_scale)
    assert t.shape == (64, 96) and t.stride() == (96, 1)
    got = t.operand
    assert torch.equal(got.payload.view(torch.uint8), op.payload.view(torch.uint8))
    assert torch.equal(got.d, op.d) and got.block == op.block and torch.equal(got.tensor_scale, op.tensor_scale)
    assert torch.equal(t.detach().dequantize(), fp8lm.fake_quantize(w, "nvfp4", "weight"))
    names, meta = t.__tensor_flatten__()
    assert names == ["_data", "_d", "_tensor_scale"]
    back = BlockScaledTensor.__tensor_unflatten__({n: getattr(t, n) for n in names}, meta, t.shape, t.stride())
    assert back.shape == (64, 96) and torch.equal(back.operand.tensor_scale, op.tensor_scale)


def test_a_gathered_nvfp4_weight_is_saved_as_the_packed_bytes_it_holds():
    """The input-gradient GEMM's weight is saved as the packed elements and scale bytes the
    gathered nvfp4 weight holds (FSDP2 frees them after the forward; a repacked copy would stay
    until the backward), and the layer computes what it computes from the same operand unpacked
    with float32 scales (packed anew), bit for bit."""
    from fp8lm.ops import nvfp4

    torch.manual_seed(0)
    layer = FP8Linear(128, 96, recipe="nvfp4")
    op = quantize_operand(layer.weight.dequantize(), layer.recipe, "weight", dim=1)
    scale_bytes = nvfp4.stored_block_scales(op.d, op.tensor_scale)  # as gathered: E4M3 bytes
    packed = BlockScaledTensor(nvfp4.pack_e2m1_bytes(op.payload), scale_bytes, op.block, tensor_scale=op.tensor_scale)
    unpacked = BlockScaledTensor(op.payload, op.d, op.block, tensor_scale=op.tensor_scale)
    x, g = torch.randn(32, 128), torch.randn(32, 96)
    results = []
    for weight in (unpacked, packed):
        layer.weight = torch.nn.Parameter(weight)
        xi = x.clone().requires_grad_()
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(xi)
        torch.manual_seed(1)  # the output gradient's stochastic rounding
        y.backward(g)
        results.append((y, xi.grad, layer.weight.grad, saved))
    assert all(t.untyped_storage().data_ptr() in results[1][3] for t in packed.held)
    assert unpacked._data.untyped_storage().data_ptr() not in results[0][3]  # packed anew
    for got, want in zip(results[1][:3], results[0][:3]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8"])
def test_a_gathered_weight_holds_only_the_all_gather_buffers(recipe):
    """FSDP2 frees a gathered weight by freeing its all-gather buffers, so every inner tensor of
    the BlockScaledTensor `gathered` builds is a view of them: E8M0 scale bytes stay bytes and
    are decoded for each use, not kept decoded (a float32 copy would outlive the buffers). Its
    operand is `quantize_operand`'s of the whole weight."""
    from fp8lm.block_tensor import gather_inputs, gathered

    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(3))
    r = fp8lm.Recipe.from_name(recipe)
    inputs, metadata = gather_inputs(w, r, None)
    outputs = tuple(t.clone() for t in inputs)  # one rank's all-gather
    t, _ = gathered(outputs, metadata, torch.float32)
    buffers = {o.untyped_storage().data_ptr() for o in outputs}
    names, _ = t.__tensor_flatten__()
    assert all(getattr(t, name).untyped_storage().data_ptr() in buffers for name in names)
    op, got = quantize_operand(w, r, "weight", dim=1), t.operand
    assert torch.equal(got.payload.view(torch.uint8), op.payload.view(torch.uint8))
    assert got.d.dtype == torch.float32 and torch.equal(got.d, op.d)
