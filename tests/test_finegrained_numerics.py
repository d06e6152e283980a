"""Fine-grained quantization (`fp8lm.fake_quantize`, `fp8lm.ops.finegrained`) against float64
references of each recipe's spec written here: every representable value of the element format
enumerated, nearest-even picked by search, scales found by search over powers of two."""

import math

import pytest
import torch

import fp8lm
from fp8lm.ops.finegrained import quantize_operand
from fp8lm.ops.hadamard import hadamard_matrix, random_hadamard, random_signs


def _grid(mbits: int, ebits: int, bias: int, codes: int) -> torch.Tensor:
    """The non-negative values of a float format, by code (0 .. codes-1), in float64."""
    values = []
    for code in range(codes):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if e == 0:
            values.append(m / 2**mbits * 2.0 ** (1 - bias))
        else:
            values.append((1 + m / 2**mbits) * 2.0 ** (e - bias))
    return torch.tensor(values, dtype=torch.float64)


GRIDS = {  # finite codes only: E4M3's 0x7F is NaN, E5M2's 0x7C and above inf/NaN
    "E4M3": _grid(3, 4, 7, 127),
    "E5M2": _grid(2, 5, 15, 124),
    "E2M1": _grid(1, 2, 1, 8),
}


def to_f32(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to float32 (to nearest even), kept as float64."""
    return v.to(torch.float32).to(torch.float64)


def round_to(v: torch.Tensor, fmt: str, noise: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``v`` rounded to the format (saturating; nearest even, or up with probability the
    distance from the value below); NaN stays NaN, zeros keep their sign."""
    grid = GRIDS[fmt]
    a = v.abs().clamp(max=float(grid[-1]))
    hi = torch.searchsorted(grid, a.nan_to_num(0.0)).clamp(max=len(grid) - 1)
    lo = torch.where(grid[hi] == a, hi, (hi - 1).clamp(min=0))
    below, above = grid[lo], grid[hi]
    frac = torch.where(above > below, (a - below) / (above - below), torch.zeros_like(a))
    if noise is None:
        up = (frac > 0.5) | ((frac == 0.5) & (lo % 2 == 1))
    else:
        up = noise.double() < frac
    out = torch.where(up, above, below)
    return torch.where(v.isnan(), v, torch.copysign(out, v))


def pow2_ceil_ref(amax: float, fmax: float) -> float:
    e = math.frexp(amax)[1] - math.frexp(fmax)[1] - 2
    while amax > fmax * 2.0**e:
        e += 1
    return 2.0 ** min(max(e, -127), 127)


def pow2_floor_ref(amax: float, fmax: float) -> float:
    e = math.floor(math.log2(amax)) + 1
    while 2.0**e > amax:
        e -= 1
    emax = 8 if fmax == 448 else 15
    return 2.0 ** min(max(e - emax, -127), 127)


def amax_over_max_ref(amax: float, fmax: float) -> float:
    return max(float(to_f32(torch.tensor(amax / fmax, dtype=torch.float64))), 2.0**-149)


def scale_ref(rule, amax: float, fmax: float) -> float:
    if amax == 0:
        return 1.0
    if not math.isfinite(amax):
        return math.nan
    return rule(amax, fmax)


def blockwise_ref(x: torch.Tensor, block: tuple[int, int], rule, fmt: str) -> torch.Tensor:
    """float64 values of ``x`` quantized in ``block``s: d per block by ``rule``, q = fmt(f32(x / d))."""
    fmax = float(GRIDS[fmt][-1])
    out = torch.empty_like(x, dtype=torch.float64)
    for i in range(0, x.shape[0], block[0]):
        for j in range(0, x.shape[1], block[1]):
            part = x[i : i + block[0], j : j + block[1]].double()
            d = scale_ref(rule, float(part.abs().max()), fmax)
            q = round_to(to_f32(part / d), fmt)
            out[i : i + block[0], j : j + block[1]] = to_f32(q * d)
    return out


def nvfp4_ref(
    x: torch.Tensor, block: tuple[int, int], noise: torch.Tensor | None = None, four_over_six: bool = False
) -> torch.Tensor:
    """NVIDIA's NVFP4 (each block's amax to 6) or, with ``four_over_six``, arXiv 2512.02010's: the
    tensor scale from 6 * 256, each block's amax to 6 or to 4, whichever rounds the block (to
    nearest) with the smaller squared error, ties to 6; then ``noise``'s rounding with that scale."""
    x = x.double()
    amax = float(x.abs().max())
    if not math.isfinite(amax):
        return torch.full_like(x, math.nan)
    base = 6.0 * (256.0 if four_over_six else 448.0)
    s_enc = 1.0 if amax == 0 else min(float(to_f32(torch.tensor(base / amax))), 3.4028234663852886e38)
    s_dec = float(to_f32(torch.tensor(1.0 / s_enc)))

    def scale(part: torch.Tensor, element_max: float) -> float:
        sb = to_f32(to_f32(torch.tensor(float(part.abs().max()) / element_max)) * s_enc)
        return float(to_f32(round_to(sb, "E4M3") * s_dec))

    def values(part: torch.Tensor, d: float, n: torch.Tensor | None = None) -> torch.Tensor:
        v = torch.zeros_like(part) if d == 0 else to_f32(part / d)
        return to_f32(round_to(v, "E2M1", n) * d)

    out = torch.empty_like(x)
    for i in range(0, x.shape[0], block[0]):
        for j in range(0, x.shape[1], block[1]):
            part = x[i : i + block[0], j : j + block[1]]
            d = scale(part, 6.0)
            if four_over_six:
                d4 = scale(part, 4.0)
                if float((values(part, d4) - part).square().sum()) < float((values(part, d) - part).square().sum()):
                    d = d4
            n = None if noise is None else noise[i : i + block[0], j : j + block[1]]
            out[i : i + block[0], j : j + block[1]] = values(part, d, n)
    return out


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=0, equal_nan=True)
    finite = ~expected.isnan()
    assert torch.equal(actual.double()[finite].signbit(), expected[finite].signbit())


def hostile(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values over 60 binades by row, plus zeros, a zero block, ties, subnormal-range values,
    saturating values, inf and NaN in their own rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 2.0 ** torch.randint(-30, 30, (rows, 1), generator=g).float()
    x[0] = 0.0
    x[1, : cols // 2] = 0.0
    x[2] = torch.tensor([448.0, 1.0625, -1.1875, 2.0**-10, 3 * 2.0**-10, 2.0**-12, 464.0, -0.0] * cols)[:cols]
    x[3] = torch.tensor([3.0, 5.0, 0.25, 0.75, 1.25, 1.75, 2.5, 6.0] * cols)[:cols] * 2.0**5
    x[4, 3] = float("inf")
    x[5, 7] = float("nan")
    x[6, -1] = float("-inf")
    x[7] = 1e-40  # float32 subnormals
    return x


RULES = {"pow2_ceil": pow2_ceil_ref, "pow2_floor": pow2_floor_ref, "amax_over_max": amax_over_max_ref}
CASES = [  # recipe, role, block, scale rule, element format
    ("rowwise", "input", (1, 300), "pow2_ceil", "E4M3"),
    ("rowwise", "grad_output", (1, 300), "pow2_ceil", "E4M3"),
    ("blockwise", "input", (1, 128), "amax_over_max", "E4M3"),
    ("blockwise", "weight", (128, 128), "amax_over_max", "E4M3"),
    ("mxfp8", "input", (1, 32), "pow2_floor", "E4M3"),
    ("mxfp8", "weight", (1, 32), "pow2_floor", "E4M3"),
    ("tensorwise-current", "grad_output", (150, 300), "pow2_ceil", "E5M2"),
]


@pytest.mark.parametrize("name, role, block, rule, fmt", CASES)
@pytest.mark.parametrize("rows", [150, 37])
def test_fake_quantize_matches_the_float64_reference(name, role, block, rule, fmt, rows):
    x = hostile(rows, 300, seed=rows)  # 300: no multiple of 128, 32 or 16
    expected = blockwise_ref(x, (block[0] if block[0] < 150 else rows, block[1]), RULES[rule], fmt)
    assert_bits_equal(fp8lm.fake_quantize(x, name, role), expected)


@pytest.mark.parametrize(
    "recipe, rule",
    [
        (fp8lm.Recipe.from_name("blockwise").replace(pow2_scales=True), "pow2_ceil"),
        (fp8lm.Recipe.from_name("mxfp8").replace(mx_rounding="rceil"), "pow2_ceil"),
        (fp8lm.Recipe.from_name("mxfp8").replace(grad_output_format="E5M2"), "pow2_floor"),
    ],
)
def test_scale_options_match_the_reference(recipe, rule):
    x = hostile(40, 200, seed=3)
    fmt = recipe.grad_output_format.name
    expected = blockwise_ref(x, (1, recipe.block), RULES[rule], fmt)
    assert_bits_equal(fp8lm.fake_quantize(x, recipe, "grad_output"), expected)


def test_mx_scales_saturate_where_rceil_does_not():
    x = torch.tensor([[500.0] + [1.0] * 31])  # amax 500: floor scale 1, so 500 saturates to 448
    assert fp8lm.fake_quantize(x, "mxfp8", "input")[0, 0] == 448.0
    rceil = fp8lm.Recipe.from_name("mxfp8").replace(mx_rounding="rceil")
    assert fp8lm.fake_quantize(x, rceil, "input")[0, 0] == 512.0  # scale 2: 250 -> 256


@pytest.mark.parametrize("role, block", [("input", (1, 16)), ("weight", (16, 16))])
@pytest.mark.parametrize("rows", [48, 37])
def test_nvfp4_matches_the_reference(role, block, rows):
    x = hostile(rows, 200, seed=5)
    x[4:7] = 1.0  # no inf/NaN: one would make the whole tensor NaN (tested below)
    assert_bits_equal(fp8lm.fake_quantize(x, "nvfp4", role), nvfp4_ref(x, block))


def test_nvfp4_stochastic_rounding_of_gradients_matches_the_reference():
    x = hostile(37, 200, seed=6)
    x[4:7] = 1.0
    got = fp8lm.fake_quantize(x, "nvfp4", "grad_output", generator=torch.Generator().manual_seed(11))
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(11))
    assert_bits_equal(got, nvfp4_ref(x, (1, 16), noise))
    nearest = nvfp4_ref(x, (1, 16))
    assert not torch.equal(got.double().nan_to_num(), nearest.nan_to_num())  # the noise does something


FOUR_OVER_SIX = fp8lm.Recipe.from_name("nvfp4").replace(nvfp4_scale_rule="4over6")


@pytest.mark.parametrize("role, block", [("input", (1, 16)), ("weight", (16, 16))])
@pytest.mark.parametrize("rows", [48, 37])
def test_four_over_six_matches_the_reference(role, block, rows):
    x = hostile(rows, 200, seed=7)
    x[4:7] = 1.0
    got = fp8lm.fake_quantize(x, FOUR_OVER_SIX, role)
    assert_bits_equal(got, nvfp4_ref(x, block, four_over_six=True))
    assert not torch.equal(got.double(), nvfp4_ref(x, block))  # it is not NVIDIA's rule


def test_four_over_six_stochastic_rounding_matches_the_reference():
    x = hostile(37, 200, seed=8)
    x[4:7] = 1.0
    got = fp8lm.fake_quantize(x, FOUR_OVER_SIX, "grad_output", generator=torch.Generator().manual_seed(12))
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(12))
    assert_bits_equal(got, nvfp4_ref(x, (1, 16), noise, four_over_six=True))


def test_four_over_six_scales_each_block_to_whichever_of_4_and_6_holds_it():
    # amax 1.5: s_enc = 6 * 256 / 1.5 = 1024, so d = 256 / 1024 = 0.25 (to 6) or 384 / 1024 = 0.375 (to 4)
    x = torch.tensor([[1.5] + [1.125] * 15, [1.5] + [0.5] * 15])
    # row 0: 1.125 / 0.375 = 3 is on E2M1's grid, 1.125 / 0.25 = 4.5 is not (it rounds to 4: 1.0);
    # row 1: 0.5 / 0.25 = 2 is on it, 0.5 / 0.375 = 1.33 is not. Each row keeps the exact scale.
    assert torch.equal(fp8lm.fake_quantize(x, FOUR_OVER_SIX, "input"), x)
    assert fp8lm.fake_quantize(x, "nvfp4", "input")[0, 1] == 1.0  # NVIDIA's rule: always to 6


def test_four_over_six_shards_quantize_as_the_whole_weight():
    """What FSDP2 relies on: a shard of whole 16 x 16 blocks, quantized with the whole tensor's
    amax, gets the whole weight's scales and values (each block chooses from its own values)."""
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.01, 3, 48)
    whole = quantize_operand(w, FOUR_OVER_SIX, "weight").dequantize()
    for rows in (slice(0, 32), slice(32, 64)):
        shard = quantize_operand(w[rows], FOUR_OVER_SIX, "weight", tensor_amax=w.abs().amax())
        assert torch.equal(shard.dequantize(), whole[rows])


def test_stochastic_rounding_is_unbiased():
    x = torch.full((4000, 16), 0.7)
    x[:, 0] = 6.0  # block amax 6: d = 1 exactly, 0.7 lies between 0.5 and 1
    got = fp8lm.fake_quantize(x, "nvfp4", "grad_output", generator=torch.Generator().manual_seed(0))
    values = got[:, 1:]
    assert set(values.unique().tolist()) == {0.5, 1.0}
    assert abs(values.mean().item() - 0.7) < 0.005  # 60k draws: standard error ~0.001


def test_nvfp4_non_finite_tensor_reads_as_nan():
    x = torch.ones(4, 32)
    x[1, 2] = float("inf")
    assert fp8lm.fake_quantize(x, "nvfp4", "input").isnan().all()


def test_e2m1_rounding_table():
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.5, -0.25, -5.5, 0.0, 0.5, 1.5, 3.0, 4.0]])
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 4.0, -0.0, -6.0, 0.0, 0.5, 1.5, 3.0, 4.0]
    got = fp8lm.fake_quantize(x, "nvfp4", "input")  # amax 6: s_enc 448, block scale 448, d = 1
    assert got[0].tolist() == expected and got[0, 9].signbit()


def test_a_block_with_inf_or_nan_reads_as_nan_and_no_other():
    x = torch.randn(3, 256)
    x[1, 5] = float("inf")
    for name, width in (("blockwise", 128), ("mxfp8", 32), ("rowwise", 256)):
        got = fp8lm.fake_quantize(x, name, "input")
        assert got[1, :width].isnan().all() and not got[1, width:].isnan().any() and not got[[0, 2]].isnan().any()


@pytest.mark.parametrize("name", ["rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_quantizing_along_dim_0_is_quantizing_the_transpose(name):
    recipe = fp8lm.Recipe.from_name(name)
    x = torch.randn(70, 45) * torch.logspace(-3, 3, 45)
    along_0 = quantize_operand(x, recipe, "input", dim=0)
    assert torch.equal(along_0.dequantize(), fp8lm.fake_quantize(x.t(), recipe, "input").t())
    assert along_0.payload.dtype == torch.float8_e4m3fn and along_0.payload.shape == x.shape


def test_outputs_keep_the_dtype_and_shape():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    got = fp8lm.fake_quantize(x, "blockwise", "input")
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(
        got, fp8lm.fake_quantize(x.reshape(6, 64).float(), "blockwise", "input").bfloat16().reshape(x.shape)
    )


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="unknown role 'bias': use one of input, weight, grad_output"):
        fp8lm.fake_quantize(torch.ones(4), "rowwise", "bias")
    with pytest.raises(ValueError, match="a weight must be 2-D"):
        fp8lm.fake_quantize(torch.ones(2, 2, 2), "blockwise", "weight")
    with pytest.raises(ValueError, match="unknown recipe"):
        fp8lm.fake_quantize(torch.ones(4), "rowwize", "input")


def test_hadamard_matrix_is_the_signed_sylvester_matrix():
    h = torch.tensor([[1.0]], dtype=torch.float64)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    expected = h * torch.tensor(random_signs(7), dtype=torch.float64) / 4
    m = hadamard_matrix(7)
    assert torch.equal(m.double(), expected)
    assert torch.equal(m.double() @ m.double().t(), torch.eye(16, dtype=torch.float64))
    assert random_signs(7) != random_signs(8) and set(random_signs(7)) == {-1, 1}


def test_random_hadamard_is_exact_on_small_integers_and_keeps_products():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (37, 5), generator=g).float()
    got = random_hadamard(x, seed=3)
    assert got.shape == (48, 5)
    padded = torch.cat([x, torch.zeros(11, 5)]).double()
    expected = torch.block_diag(*[hadamard_matrix(3).double()] * 3) @ padded
    assert torch.equal(got.double(), expected)
    y = torch.randn(37, 6, generator=g)
    product = random_hadamard(y, seed=3).t() @ got
    torch.testing.assert_close(product, y.t() @ x, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, role",
    [
        (fp8lm.Recipe.from_name("blockwise"), "weight"),
        (fp8lm.Recipe.from_name("nvfp4"), "input"),
        (FOUR_OVER_SIX, "weight"),
    ],
)
def test_the_compiled_quantization_gives_the_eager_bits(recipe, role):
    """What runs off the CPU (`FUSED_QUANTIZE`), compiled by inductor here for the CPU: the same
    payload, scales and values as the eager ops. The recipes whose scales divide by numbers that
    are not powers of two, and Four Over Six's choice (a minute each: one compile per function)."""
    from fp8lm.ops import finegrained

    x = hostile(150, 200, seed=9)
    x[4:7] = 1.0
    block = finegrained.operand_block(recipe, role, x.shape, 1)
    torch._dynamo.reset()
    payload, d, tensor_scale = torch.compile(finegrained._quantize, dynamic=True)(x, recipe, role, block, None)
    eager_payload, eager_d, eager_tensor_scale = finegrained._quantize(x, recipe, role, block, None)
    assert torch.equal(payload.view(torch.uint8), eager_payload.view(torch.uint8))
    assert torch.equal(d.nan_to_num(), eager_d.nan_to_num())
    if recipe.granularity == "nvfp4":  # its per-tensor decode scale, which the FP4 GEMM applies
        assert torch.equal(tensor_scale, eager_tensor_scale)
    else:
        assert tensor_scale is None and eager_tensor_scale is None
    values = torch.compile(finegrained._dequantize, dynamic=True)(payload, d, block)
    assert torch.equal(values.nan_to_num(), finegrained._dequantize(eager_payload, eager_d, block).nan_to_num())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_the_compiled_quantization_along_dim_0_writes_the_gemms_layout(name):
    """Off the CPU an operand quantized along dim 0 is written column-major, the layout an FP8
    GEMM reads it in, by the same compiled function (inductor here, for the CPU): the eager bits
    in the other memory order. A stored weight's values (payload / scale) are read inside it.
    The bias is added to an FP32 GEMM result and rounded once by one compiled function too."""
    from fp8lm.ops import finegrained

    recipe = fp8lm.Recipe.from_name(name)
    x = hostile(96, 160, seed=4)
    scale = torch.tensor(2.0**-3)
    payload = (x * scale).bfloat16()
    block = finegrained.operand_block(recipe, "weight", x.shape, 0)
    torch._dynamo.reset()
    compiled = torch.compile(finegrained._quantize_laid_out, dynamic=True)
    got, d, _ = compiled(payload, recipe, "weight", block, None, scale, True)
    values = payload.to(torch.float32) / scale
    want, want_d, _ = finegrained._quantize(values, recipe, "weight", block, None)
    assert got.t().is_contiguous() and not got.is_contiguous()
    nan = want.isnan()  # inductor may give a NaN the other sign bit: the same NaN to every reader
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])
    assert torch.equal(d.nan_to_num(), want_d.nan_to_num())
    op = finegrained.BlockOperand(want, want_d, block).t()  # requantized along the other dim
    column_block = finegrained.operand_block(recipe, "weight", op.payload.shape, 0)
    again = torch.compile(finegrained._requantize, dynamic=True)(op, recipe, "weight", column_block, True)
    eager = finegrained._requantize(op, recipe, "weight", column_block, True)
    nan = eager[0].isnan()
    assert again[0].t().is_contiguous() and torch.equal(again[0].isnan(), nan)
    assert torch.equal(again[0].view(torch.uint8)[~nan], eager[0].view(torch.uint8)[~nan])
    out, bias = torch.randn(64, 48, dtype=torch.float64).float(), torch.randn(48)
    biased = torch.compile(finegrained._add_bias, dynamic=True)(out, bias, torch.bfloat16)
    assert torch.equal(biased, (out + bias).to(torch.bfloat16))


def test_the_hadamard_matrix_is_exact_in_bf16_and_fp16():
    """What lets CUDA multiply a BF16 operand by it without upcasting (`random_hadamard`): the
    entries +-1/4 of the 16 x 16 matrix are the float32 ones in BF16 and FP16 too."""
    exact = hadamard_matrix(7)
    assert exact.abs().eq(0.25).all()
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(hadamard_matrix(7, dtype=dtype).float(), exact)


@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_requantizing_an_operand_is_quantizing_its_values(name):
    """An FSDP2-gathered weight's operand for its other GEMM (`requantize_operand`): the bits of
    `quantize_operand` of its values, from one function that needs no float32 copy of them."""
    from fp8lm.ops.finegrained import requantize_operand

    recipe = fp8lm.Recipe.from_name(name)
    op = quantize_operand(hostile(96, 160, seed=2), recipe, "weight", dim=1)
    got, want = requantize_operand(op, recipe, "weight", 0), quantize_operand(op.dequantize(), recipe, "weight", 0)
    assert got.block == want.block
    assert torch.equal(got.payload.view(torch.uint8), want.payload.view(torch.uint8))
    assert torch.equal(got.d.nan_to_num(), want.d.nan_to_num())
