"""The CPU emulation of fine-grained quantization as one `torch.library` op while torch.compile
traces (`fp8lm::quantize_blocks`, its stochastic twin for nvfp4's output gradient): the eager
quantization's bits through the op's arguments, its fake tensors and schema (`opcheck`), and a
compiled layer that calls it in place of the traced ops."""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

import fp8lm
from fp8lm.nn import FP8Linear
from fp8lm.ops import finegrained
from fp8lm.recipe import RECIPES

FINE = [name for name, recipe in RECIPES.items() if recipe.fine_grained]
ROLES = ("input", "weight", "grad_output")


def _sample() -> torch.Tensor:
    """Rows of different magnitude, a shape no block divides, a zero row and a subnormal one."""
    x = torch.randn(37, 150, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 37)[:, None]
    x[5] = 0.0
    x[6] = 1e-40
    return x


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", FINE)
def test_the_op_gives_the_eager_quantization(name, role, dim):
    recipe, x = RECIPES[name], _sample()
    block = finegrained.operand_block(recipe, role, x.shape, dim)
    torch.manual_seed(3)  # nvfp4's stochastic rounding of grad_output: the same draws
    expected = finegrained._quantize(x, recipe, role, block, None)
    torch.manual_seed(3)
    got = finegrained._opaque_quantize(x, recipe, role, block, None)
    assert got[0].dtype == expected[0].dtype
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(got[1], expected[1])
    assert (got[2] is None) == (expected[2] is None)
    if expected[2] is not None:
        assert torch.equal(got[2], expected[2])


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tensor_amax", [False, True])
@pytest.mark.parametrize("name", ["rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_opcheck(name, tensor_amax, transposed):
    rule = finegrained._QuantizeRule.of(RECIPES[name], "input")
    amax = torch.tensor(50.0) if tensor_amax else None
    x = _sample().t().contiguous().t() if transposed else _sample()  # the fake's strides: the eager ones
    args = (x, rule.granularity, rule.dtype, rule.scale_rule, rule.nvfp4_scale_rule, 1, 16, amax)
    torch.library.opcheck(torch.ops.fp8lm.quantize_blocks.default, args)
    # the stochastic one draws anew on each call: its fake tensors and schema only
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.fp8lm.quantize_blocks_stochastic.default, args, test_utils=checks)


@pytest.mark.parametrize("transposed", [False, True])
def test_opcheck_dequantize(transposed):
    recipe = RECIPES["blockwise"]
    x = _sample().t().contiguous().t() if transposed else _sample()  # the GEMM reads operands both ways
    block = finegrained.operand_block(recipe, "weight", x.shape, 1)
    payload, d, _ = finegrained._quantize(x, recipe, "weight", block, None)
    payload = payload.t().contiguous().t() if transposed else payload
    # not test_schema: its dispatch mode does not let `upcast`'s bit rebuild view FP8 bytes as
    # integers (fp8lm::upcast says so); what it checks of aliasing is checked here
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fp8lm.dequantize_blocks.default, (payload, d, *block), test_utils=checks)
    got = torch.ops.fp8lm.dequantize_blocks(payload, d, *block)
    expected = finegrained._dequantize(payload, d, block)
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    assert got.untyped_storage().data_ptr() not in (
        payload.untyped_storage().data_ptr(),
        d.untyped_storage().data_ptr(),
    )


def _compiled_op_counts(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    counts = {"forward": 0, "backward": 0}

    def counting(graph_name):
        def compiler(gm, example_inputs):
            counts[graph_name] += sum(1 for n in gm.graph.nodes if "fp8lm.quantize_blocks" in str(n.target))
            return gm.forward

        return compiler

    backend = aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"))
    torch.compile(layer, fullgraph=True, backend=backend)(x).sum().backward()
    return counts


@pytest.mark.parametrize("traced", [False, True])
def test_a_compiled_cpu_layer_quantizes_with_the_op_unless_told_to_trace(traced, monkeypatch):
    monkeypatch.setattr(finegrained, "CPU_QUANTIZE_OP", not traced)
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = FP8Linear(96, 64, recipe="nvfp4")
    counts = _compiled_op_counts(layer, torch.randn(40, 96, requires_grad=True))
    if traced:
        assert counts == {"forward": 0, "backward": 0}
    else:
        # forward: the input and the weight for the forward GEMM, the input along the tokens for
        # the weight gradient; backward: the output gradient both ways (the weight's operand for
        # the input gradient is its forward one, transposed: 16 x 16 blocks)
        assert counts == {"forward": 3, "backward": 2}


@pytest.mark.slow  # inductor compiles C++ (about 10 s a recipe on 2 cores)
@pytest.mark.parametrize("recipe", ["blockwise", "nvfp4"])
def test_inductor_compiles_a_layer_no_block_divides_to_the_eager_bits(recipe):
    """in_features 150: the last block of each row is partial. Traced, inductor's CPU code read
    wrong values in the dequantization (all outputs wrong); nvfp4's stochastic rounding drew
    inductor's own noise."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = FP8Linear(150, 70, recipe=recipe)
    x = torch.randn(2, 40, 150, requires_grad=True)

    def step(module):
        torch.manual_seed(1)
        y = module(x)
        y.square().sum().backward()
        grads = x.grad.clone(), layer.weight.grad.clone()
        x.grad = layer.weight.grad = None
        return y.detach(), grads

    eager_y, eager_grads = step(layer)
    compiled_y, compiled_grads = step(torch.compile(layer, fullgraph=True, backend="inductor"))
    assert torch.equal(compiled_y, eager_y)
    assert torch.equal(compiled_grads[0], eager_grads[0])
    assert torch.equal(compiled_grads[1], eager_grads[1])


def test_fake_quantize_compiles_to_its_eager_values():
    """`fp8lm.fake_quantize` compiled on the CPU (through the ops) gives its eager values, where
    the blocks do not divide the shape too."""
    x = _sample()
    torch._dynamo.reset()
    for name in ("blockwise", "mxfp8", "nvfp4"):
        eager = fp8lm.fake_quantize(x, name, "weight")
        compiled = torch.compile(lambda t, n=name: fp8lm.fake_quantize(t, n, "weight"), fullgraph=True)(x)
        assert torch.equal(compiled, eager), name
