"""nvfp4's FP4 GEMM path (compute capability 10.0+): E2M1 elements packed two to a byte, E4M3
block scales in cuBLAS's blocked layout, the per-tensor scales in the epilogue; and the same
packed form as the layers save nvfp4 operands for the backward.

No GPU runs here, so the call is checked the way cuBLAS reads it: a float64 kernel written from
the formats' definitions (the E2M1 code table, the 128 x 4 tile layout of the scales) stands in
for ``torch.nn.functional.scaled_mm`` and must give the emulation's result."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fp8lm
from fp8lm.ops import finegrained, nvfp4
from fp8lm.ops.finegrained import (
    block_mm,
    nvfp4_blocked_scales,
    nvfp4_scales_fit,
    quantize_operand,
    takes_nvfp4_scaled_mm,
)

NVFP4 = fp8lm.Recipe.from_name("nvfp4")


def e2m1_value(code: int) -> float:
    """OCP MX v1.0's E2M1: sign, two exponent bits (bias 1), one mantissa bit; exponent 0 is
    subnormal (0 or 0.5)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def test_unpack_reads_every_byte_as_two_e2m1_codes_the_first_in_the_low_bits():
    every = torch.arange(256, dtype=torch.uint8)
    values = nvfp4.unpack_e2m1(every.view(torch.float4_e2m1fn_x2))
    expected = torch.tensor([[e2m1_value(b & 15), e2m1_value(b >> 4)] for b in range(256)]).flatten()
    assert torch.equal(values, expected)
    assert torch.equal(torch.signbit(values), torch.signbit(expected))  # -0 is code 8
    # Packing is its inverse: every byte comes back, negative zeros included, from float values
    # or from E4M3 bytes (read by integer operations), and the E4M3 unpacking gives those bytes.
    e4m3 = values.to(torch.float8_e4m3fn)
    assert torch.equal(nvfp4.pack_e2m1(values).view(torch.uint8), every)
    assert torch.equal(nvfp4.pack_e2m1(e4m3).view(torch.uint8), every)
    assert torch.equal(nvfp4.unpack_e2m1_as_e4m3(every).view(torch.uint8), e4m3.view(torch.uint8))


def test_pack_takes_a_quantized_payload_along_its_last_dim_and_refuses_an_odd_one():
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    op = quantize_operand(x, NVFP4, "input")
    packed = nvfp4.pack_e2m1(op.payload)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (48, 32) and packed.is_contiguous()
    assert torch.equal(nvfp4.unpack_e2m1(packed), op.payload.float())
    transposed = nvfp4.pack_e2m1(op.payload.t())  # a view: packed along its own last dim
    assert transposed.is_contiguous() and torch.equal(nvfp4.unpack_e2m1(transposed), op.payload.t().float())
    with pytest.raises(ValueError, match="last dim must be even"):
        nvfp4.pack_e2m1(torch.zeros(4, 3))


def operand_pairs(m: int = 64, k: int = 96, n: int = 64, recipe=NVFP4, seed: int = 0):
    """The three GEMMs of a (k -> n) layer on m tokens, as `fine_grained_linear` quantizes them."""
    gen = torch.Generator().manual_seed(seed)
    x, w, g = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(m, n, generator=gen)
    w_op = quantize_operand(w, recipe, "weight")
    return {
        "forward": (quantize_operand(x, recipe, "input"), w_op.t()),
        "input_grad": (quantize_operand(g, recipe, "grad_output", generator=gen), w_op),
        "weight_grad": (
            quantize_operand(g, recipe, "grad_output", dim=0, generator=gen).t(),
            quantize_operand(x, recipe, "input", dim=0),
        ),
    }


def test_the_fp4_gemm_takes_the_three_gemms_of_nvfp4_and_nothing_else():
    for name, (a, b) in operand_pairs().items():
        assert a.tensor_scale is not None and b.tensor_scale is not None, name
        assert nvfp4_scales_fit(a, b, torch.bfloat16) and nvfp4_scales_fit(a, b, torch.float32), name
        assert not nvfp4_scales_fit(a, b, torch.float16), name
        assert not takes_nvfp4_scaled_mm(a, b, torch.bfloat16), name  # a CPU tensor: no FP4 kernel
    a, b = operand_pairs(k=80)["forward"]  # K = 80: 40 bytes packed, not a multiple of 16
    assert not nvfp4_scales_fit(a, b, torch.bfloat16)
    for other in ("rowwise", "blockwise", "mxfp8"):
        a, b = operand_pairs(k=128, recipe=fp8lm.Recipe.from_name(other))["forward"]
        assert a.tensor_scale is None and not nvfp4_scales_fit(a, b, torch.bfloat16), other


def blocked_index(rows: int, cols: int) -> torch.Tensor:
    """Where cuBLAS's blocked layout keeps the scale of row r, column c: a grid of 128 x 4 tiles,
    row-major, each stored as 32 rows of 16 bytes (row r at r % 32, byte 4 * (r // 32 % 4) + c % 4)."""
    tiles_c = -(-cols // 4)
    return torch.tensor(
        [
            [((r // 128) * tiles_c + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4 for c in range(cols)]
            for r in range(rows)
        ]
    )


def unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) E4M3 scales of a blocked layout."""
    return flat.view(torch.uint8)[blocked_index(rows, cols)].view(torch.float8_e4m3fn)


def test_blocked_scales_are_the_stored_e4m3_scales_a_square_blocks_on_each_of_its_rows():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200, 64, generator=gen) * torch.logspace(-3, 3, 200).unsqueeze(1)
    for role, block_rows in (("input", 1), ("weight", 16)):
        op = quantize_operand(x, NVFP4, role)
        s_enc, _ = nvfp4.tensor_scales(x.abs().amax())
        padded = torch.cat((x, torch.zeros(8, 64)))  # 200 rows: the last 16-row block is partial
        amax = padded.abs().reshape(208 // block_rows, block_rows, 4, 16).amax(dim=(1, 3))
        stored = (amax / 6 * s_enc).clamp(max=448).to(torch.float8_e4m3fn)  # nvfp4's definition
        flat = nvfp4_blocked_scales(op)
        assert flat.dtype == torch.float8_e4m3fn and flat.numel() == 256 * 4  # padded to 128 x 4 tiles
        expected = stored.repeat_interleave(block_rows, dim=0)[:200].view(torch.uint8)
        assert torch.equal(unswizzle(flat, 200, 4).view(torch.uint8), expected), role
        padding = torch.ones(flat.numel(), dtype=torch.bool)
        padding[blocked_index(200, 4).flatten()] = False
        assert not bool(flat.view(torch.uint8)[padding].any())


def reference_fp4_gemm(calls: list):
    """A float64 stand-in for ``F.scaled_mm`` with NVFP4 operands, from the formats' definitions."""

    def scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a, swizzle_b, output_dtype):
        two_level = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
        assert scale_recipe_a == scale_recipe_b == two_level
        assert swizzle_a == swizzle_b == [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
        assert mat_a.dtype == mat_b.dtype == torch.float4_e2m1fn_x2
        assert mat_a.is_contiguous() and mat_b.t().is_contiguous()  # row-major times column-major
        calls.append(output_dtype)

        def values(packed: torch.Tensor, blocked: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
            rows, k = packed.shape[0], packed.shape[1] * 2
            codes = torch.stack((packed.view(torch.uint8) & 15, packed.view(torch.uint8) >> 4), -1).reshape(rows, k)
            elements = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)[codes.long()]
            scales = unswizzle(blocked, rows, k // 16).to(torch.float64).repeat_interleave(16, dim=1)
            return elements * scales * tensor_scale.to(torch.float64)

        a = values(mat_a, scale_a[0], scale_a[1])
        b = values(mat_b.t(), scale_b[0], scale_b[1]).t()
        return (a @ b).to(output_dtype)

    return scaled_mm


@pytest.fixture
def fp4_kernel(monkeypatch) -> list:
    """The FP4 path taken on CPU operands, with `reference_fp4_gemm` as the kernel."""
    calls: list = []
    monkeypatch.setattr(finegrained, "takes_nvfp4_scaled_mm", nvfp4_scales_fit)
    monkeypatch.setattr(F, "scaled_mm", reference_fp4_gemm(calls))
    return calls


@pytest.mark.parametrize("scale_rule", ["max6", "4over6"])
def test_the_fp4_gemm_computes_the_emulations_product(fp4_kernel, scale_rule):
    """Packing, the blocked scales and the tensor scales, as cuBLAS reads them, give the exact
    emulation's product (FP32 rounding apart), with and without a bias added before the one rounding."""
    recipe = NVFP4.replace(nvfp4_scale_rule=scale_rule)
    bias = torch.randn(160)
    for a, b in operand_pairs(m=160, k=96, n=64, recipe=recipe).values():
        for out_dtype, add in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, bias)):
            n_add = None if add is None else add[: b.payload.shape[1]]
            exact = block_mm(a, b, out_dtype, n_add, backend="emulated")
            fast = block_mm(a, b, out_dtype, n_add, backend="scaled_mm")
            rtol = 2**-7 if out_dtype == torch.bfloat16 else 1e-5  # one BF16 ulp: rounded from float64 here
            torch.testing.assert_close(fast, exact, rtol=rtol, atol=1e-5 * float(exact.abs().max()))
    assert len(fp4_kernel) == 9 and torch.bfloat16 in fp4_kernel
    assert fp4_kernel.count(torch.float32) == 6  # FP32 out where asked, and where a bias is added


def test_a_layer_runs_its_three_gemms_on_the_fp4_gemm(fp4_kernel, monkeypatch):
    """An nvfp4 FP8Linear's forward, input-gradient and weight-gradient GEMMs all take the FP4
    GEMM (the operands saved for the backward keep their tensor scales), each the emulation's
    product of its operands. (Whole-layer outputs are not compared: a one-ulp change in the
    forward moves nvfp4's output-gradient scales, and its coarse rounding then moves whole elements.)"""
    real, products = finegrained.nvfp4_scaled_mm, []

    def checked(a, b, out_dtype, bias=None):
        got = real(a, b, out_dtype, bias)
        products.append((got, block_mm(a, b, out_dtype, bias, backend="emulated")))
        return got

    monkeypatch.setattr(finegrained, "nvfp4_scaled_mm", checked)
    torch.manual_seed(0)
    layer = fp8lm.nn.FP8Linear(64, 32, recipe=NVFP4.replace(backend="scaled_mm"))
    x = torch.randn(2, 32, 64, requires_grad=True)  # 64 tokens: the weight gradient's K
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).sum().backward()
    assert len(fp4_kernel) == len(products) == 3  # forward, input gradient, weight gradient
    for got, exact in products:
        torch.testing.assert_close(got, exact, rtol=2**-7, atol=1e-5 * float(exact.abs().max()))
    assert x.grad is not None and bool(x.grad.isfinite().all()) and layer.weight.grad is not None


def test_every_e2m1_value_times_every_e4m3_scale_is_exact_in_bf16():
    """What lets the Triton kernel (`fp8lm.ops.triton_nvfp4`) multiply decoded tiles on BF16
    tensor cores exactly: E2M1 (2 significant bits) times E4M3 (4) fits BF16's 8."""
    elements = nvfp4.unpack_e2m1(torch.arange(256, dtype=torch.uint8)).to(torch.float64).unique()
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    products = (elements[:, None] * scales[None, :]).flatten()
    products = products[~products.isnan()]
    assert torch.equal(products.to(torch.bfloat16).to(torch.float64), products)


def test_a_stored_operand_comes_back_bit_for_bit():
    """`pack_nvfp4_operand` / `unpack_nvfp4_operand` (how an nvfp4 layer saves its operands for the
    backward): payload, scales and tensor scale as quantized, over outliers, zeros and an odd
    last dim (kept unpacked); a tensor holding NaN stays NaN (E2M1 has no NaN: its NaN elements
    come back as 6, and every scale of it is NaN)."""
    from fp8lm.ops.finegrained import pack_nvfp4_operand, unpack_nvfp4_operand

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-20, 20, 96)
    x[:, :16] = 0.0
    nan = torch.randn(32, 48, generator=gen)
    nan[1, 2] = float("nan")
    cases = [
        quantize_operand(x, NVFP4, "input", dim=0),  # the weight gradient's input: 16 x 1 blocks
        quantize_operand(x, NVFP4, "weight"),  # 16 x 16 blocks
        quantize_operand(x[:, :33], NVFP4, "grad_output", generator=gen),  # an odd last dim
        quantize_operand(torch.zeros(16, 32), NVFP4, "input"),
    ]
    with_nan = quantize_operand(nan, NVFP4, "input")
    back = unpack_nvfp4_operand(*pack_nvfp4_operand(with_nan), with_nan.block)
    assert bool(back.d.isnan().all()) and bool(back.dequantize().isnan().all())
    for op in cases:
        payload, scales, tensor_scale = pack_nvfp4_operand(op)
        assert payload.dtype == (torch.float8_e4m3fn if op.payload.shape[1] % 2 else torch.uint8)
        assert scales.dtype == torch.float8_e4m3fn and scales.shape == op.d.shape
        back = unpack_nvfp4_operand(payload, scales, tensor_scale, op.block)
        assert torch.equal(back.payload.view(torch.uint8), op.payload.view(torch.uint8))
        assert torch.equal(back.d.view(torch.int32), op.d.view(torch.int32))
        assert back.block == op.block and back.tensor_scale is op.tensor_scale


def test_a_layer_saves_its_nvfp4_operands_packed():
    """An nvfp4 FP8Linear saves for the backward its input (along the tokens) and weight as NVFP4
    stores them: half a byte per element and an E4M3 byte per block, 5,648 bytes here where E4M3
    payload bytes with float32 scales took 12,328."""
    from fp8lm.train.measure import saved_tensor_bytes

    torch.manual_seed(0)
    layer = fp8lm.nn.FP8Linear(64, 32, bias=False, recipe="nvfp4")
    x = torch.randn(128, 64, requires_grad=True)
    saved = saved_tensor_bytes(lambda: layer(x).sum(), exclude=layer.parameters())
    input_bytes = 128 * 64 // 2 + 128 // 16 * 64 + 4  # packed, 16 x 1 block scales, tensor scale
    weight_bytes = 32 * 64 // 2 + (32 // 16) * (64 // 16) + 4  # packed, 16 x 16 block scales
    assert saved == input_bytes + weight_bytes == 5648


@pytest.mark.slow
def test_the_compiled_packing_gives_the_eager_bytes():
    """What runs off the CPU as one compiled function each (`FUSED_QUANTIZE`): the packing and
    unpacking of saved operands and the FP4 GEMM's operand layouts, compiled by inductor here for
    the CPU, give the eager bytes (none of them returns a float4 buffer, for which inductor
    generates no code)."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    torch._dynamo.reset()
    pack = torch.compile(finegrained._pack_nvfp4, dynamic=True)
    unpack = torch.compile(finegrained._unpack_nvfp4, dynamic=True)
    layout = torch.compile(finegrained._nvfp4_gemm_operand, dynamic=True)
    for op in (quantize_operand(x, NVFP4, "input", dim=0), quantize_operand(x, NVFP4, "weight")):
        packed, eager = pack(op), finegrained._pack_nvfp4(op)
        assert torch.equal(packed[0], eager[0]) and torch.equal(packed[1].view(torch.uint8), eager[1].view(torch.uint8))
        values, d = unpack(*eager)
        eager_values, eager_d = finegrained._unpack_nvfp4(*eager)
        assert torch.equal(values.view(torch.uint8), eager_values.view(torch.uint8)) and torch.equal(d, eager_d)
        for blocked in (True, False):
            assert all(
                torch.equal(a, b) for a, b in zip(layout(op, blocked), finegrained._nvfp4_gemm_operand(op, blocked))
            )


def _layer_step(layer_recipe, seed: int = 0):
    """One forward and backward of an nvfp4 layer under BF16 autocast: output, input gradient,
    weight gradient (payload bytes and scale), bias gradient."""
    torch.manual_seed(seed)
    layer = fp8lm.nn.FP8Linear(64, 32, recipe=layer_recipe)
    x = torch.randn(2, 48, 64, requires_grad=True)  # 96 tokens: the weight gradient's K
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).sum().backward()
    grad = layer.weight.grad
    assert isinstance(grad, fp8lm.ScalingTensor)
    return y.detach(), x.grad, grad.payload.view(torch.uint8), grad.scale, layer.bias.grad


@pytest.mark.parametrize("kernel", ["cublas", "triton"])
@pytest.mark.parametrize("scale_rule", ["max6", "4over6"])
def test_a_layer_quantizes_straight_into_the_fp4_layout_with_the_same_bits(fp4_kernel, monkeypatch, kernel, scale_rule):
    """Where the FP4 GEMM takes all three of a layer's GEMMs, each operand is quantized straight
    into the kernel's layout (`quantize_fp4`) and the backward's are saved so, instead of E4M3
    operands laid out before each GEMM: the kernel reads the same bytes, so the layer gives the
    same output and gradients, bit for bit, stochastic rounding included."""
    from fp8lm.nn import finegrained as layer_gemms

    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setattr(finegrained, "takes_nvfp4_scaled_mm", lambda a, b, out_dtype: False)
        monkeypatch.setattr(finegrained, "takes_triton_nvfp4_mm", nvfp4_scales_fit)
    recipe = NVFP4.replace(backend="scaled_mm", nvfp4_scale_rule=scale_rule)
    taken = []
    monkeypatch.setattr(layer_gemms, "fp4_gemm_kernel", lambda device: None)
    laid_out_per_gemm = _layer_step(recipe)
    monkeypatch.setattr(layer_gemms, "fp4_gemm_kernel", lambda device: taken.append(kernel) or kernel)
    straight = _layer_step(recipe)
    assert taken == [kernel]
    if kernel == "cublas":
        assert len(fp4_kernel) == 6  # three GEMMs on each path
    for a, b in zip(straight, laid_out_per_gemm):
        assert torch.equal(a, b)


def test_the_fp4_layout_path_is_taken_only_where_every_gemm_fits(monkeypatch):
    """80 tokens: the weight gradient's K (80) is no multiple of 32, so the layer keeps the
    E4M3 operands (and `block_mm`'s choice per GEMM); the emulation, a BF16 weight-gradient GEMM
    and other recipes never take it."""
    from fp8lm.nn import finegrained as layer_gemms

    monkeypatch.setattr(layer_gemms, "fp4_gemm_kernel", lambda device: "cublas")
    fast = NVFP4.replace(backend="scaled_mm")
    x = torch.zeros(96, 64)
    weight = torch.Size((32, 64))
    assert layer_gemms._fp4_kernel(x, weight, fast, "scaled_mm", torch.bfloat16) == "cublas"
    assert layer_gemms._fp4_kernel(torch.zeros(80, 64), weight, fast, "scaled_mm", torch.bfloat16) is None
    assert layer_gemms._fp4_kernel(x, weight, fast, "scaled_mm", torch.float16) is None
    assert layer_gemms._fp4_kernel(x, weight, NVFP4, "emulated", torch.bfloat16) is None
    bf16_wgrad = fast.replace(weight_grad_gemm="bf16")
    assert layer_gemms._fp4_kernel(x, weight, bf16_wgrad, "scaled_mm", torch.bfloat16) is None
    mxfp8 = fp8lm.Recipe.from_name("mxfp8").replace(backend="scaled_mm")
    assert layer_gemms._fp4_kernel(x, weight, mxfp8, "scaled_mm", torch.bfloat16) is None


@pytest.mark.slow
def test_the_compiled_fp4_quantization_gives_the_eager_bytes():
    """`quantize_fp4` as it runs off the CPU, one function compiled by inductor (here for the
    CPU): the eager bytes for a stored weight laid out both ways and for an input along the
    tokens. A stochastically rounded output gradient draws inductor's noise, not eager's: the
    same scales, and each element one of the two E2M1 values around it (within one step of the
    nearest rounding). It compiles: passing ``generator=None`` on to ``torch.rand`` did not, with
    dynamic shapes."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(64, 96, generator=gen)
    scale = torch.tensor(2.0**4)
    stored = (w * scale).bfloat16()
    x = torch.randn(96, 64, generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(finegrained._quantize_fp4, dynamic=True)
    cases = [
        (stored, "weight", 1, scale, True),
        (x, "input", 0, None, False),
        (x, "grad_output", 0, None, False),
    ]
    for blocked in (True, False):
        for tensor, role, dim, stored_scale, both in cases:
            block = finegrained.operand_block(NVFP4, role, tensor.shape, dim)
            args = (tensor, NVFP4, role, block, dim, blocked, stored_scale, both)
            torch.manual_seed(0)
            got = compiled(*args)
            torch.manual_seed(0)
            want = finegrained._quantize_fp4(*args)
            assert len(got) == len(want) == (2 if both else 1)
            for g, e in zip(got, want):
                assert torch.equal(g[1].view(torch.uint8), e[1].view(torch.uint8)) and torch.equal(g[2], e[2]), role
                if role != "grad_output":
                    assert torch.equal(g[0], e[0]), role
                    continue
                nearest = nvfp4.unpack_e2m1(finegrained._quantize_fp4(tensor, NVFP4, "input", *args[3:])[0][0])
                rounded = nvfp4.unpack_e2m1(g[0])
                step = torch.where(nearest.abs() >= 4, 2.0, torch.where(nearest.abs() >= 2, 1.0, 0.5))
                assert bool(((rounded - nearest).abs() <= step).all()) and not torch.equal(rounded, nearest)


def test_fullgraph_compile_of_the_fp4_layout_path_gives_the_eager_numbers(fp4_kernel, monkeypatch):
    """The FP4 layout path (`quantize_fp4`, `fp4_mm`, the laid-out saves) traces into one graph
    with ``torch.compile(fullgraph=True)`` and gives the eager output and gradients (aot_eager,
    the float64 stand-in for cuBLAS's kernel)."""
    from fp8lm.nn import finegrained as layer_gemms

    def no_block_gemm(*args, **kwargs):
        raise AssertionError("the FP4 layout path multiplies with fp4_mm only")

    monkeypatch.setattr(layer_gemms, "fp4_gemm_kernel", lambda device: "cublas")
    monkeypatch.setattr(layer_gemms, "block_mm", no_block_gemm)
    torch.manual_seed(0)
    layer = fp8lm.nn.FP8Linear(64, 32, recipe=NVFP4.replace(backend="scaled_mm"))
    x = torch.randn(2, 48, 64, requires_grad=True)

    def step(run):
        torch.manual_seed(1)  # the same stochastic rounding noise
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(x)
        y.float().square().sum().backward()
        grads = (x.grad.clone(), layer.weight.grad.dequantize().clone())
        x.grad, layer.weight.grad = None, None
        return y.detach(), grads

    eager_y, eager_grads = step(layer)
    assert len(fp4_kernel) == 3

    class Uncounted(list):  # a list.append in the traced kernel would be a side effect in a graph
        def append(self, _):
            pass

    monkeypatch.setattr(F, "scaled_mm", reference_fp4_gemm(Uncounted()))
    torch._dynamo.reset()
    compiled_y, compiled_grads = step(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    assert torch.equal(compiled_y, eager_y)
    assert all(torch.equal(a, b) for a, b in zip(compiled_grads, eager_grads))


def test_the_fp4_layout_weight_is_quantized_once_per_change_of_the_weight(fp4_kernel, monkeypatch):
    """On the FP4 path, too, the weight's operands (its 16 x 16 blocks, laid out for both its
    GEMMs) are quantized once and serve the following micro-batches, with the same results as
    a layer that quantizes them in every forward."""
    from fp8lm.nn import finegrained as layer_gemms

    monkeypatch.setattr(layer_gemms, "fp4_gemm_kernel", lambda device: "cublas")
    roles, real = [], layer_gemms.quantize_fp4
    monkeypatch.setattr(
        layer_gemms,
        "quantize_fp4",
        lambda x, recipe, role, *a, **k: roles.append(role) or real(x, recipe, role, *a, **k),
    )
    torch.manual_seed(0)
    kept = fp8lm.nn.FP8Linear(64, 32, recipe=NVFP4.replace(backend="scaled_mm"))
    anew = copy.deepcopy(kept)

    def micro_batch(layer, seed):
        x = torch.randn(2, 48, 64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        torch.manual_seed(seed)  # the same stochastic rounding
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().pow(2).sum().backward()
        return y.detach(), x.grad, layer.weight.grad.dequantize().clone()

    for seed in range(3):
        roles.clear()
        kept_results = micro_batch(kept, seed)
        assert roles.count("weight") == (1 if seed == 0 else 0)
        anew._weight_operand.clear()
        for a, b in zip(kept_results, micro_batch(anew, seed)):
            assert torch.equal(a, b)
