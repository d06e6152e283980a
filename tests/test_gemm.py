import pytest
import torch

from fp8lm.ops.gemm import FP8Operand, choose_backend, fp8_mm, scaled_mm_supported, upcast

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def all_codes(dtype):
    return torch.arange(256, dtype=torch.uint8).view(dtype)


def random_operand(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 8
    data = x.clamp(-448, 448).to(dtype).to(device)
    scale_inv = torch.tensor(2.0 ** (seed % 7 - 3), device=device)
    return FP8Operand(data, scale_inv)


def exact(op: FP8Operand) -> torch.Tensor:
    """float64 reference of an operand's values (torch's own conversion)."""
    return op.data.to(torch.float64) * op.scale_inv.double()


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_inv", [1.0, 2.0**-20, 2.0**10, 2.0**100])
def test_upcast_is_exact_for_every_code(dtype, out, scale_inv):
    codes = all_codes(dtype)
    s = torch.tensor(scale_inv)
    ref = (codes.to(torch.float64) * scale_inv).to(out)  # exact: FP8 * 2^k fits BF16/FP32 here
    got = upcast(codes, s, out)
    assert got.dtype == out
    assert torch.equal(got.isnan(), ref.isnan())
    finite = ~ref.isnan()
    assert torch.equal(got[finite], ref[finite])


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_upcast_finite_hint_skips_the_check_but_nonfinite_codes_propagate(dtype):
    codes = all_codes(dtype)
    ref = codes.to(torch.float32)
    got = upcast(codes, torch.tensor(1.0), torch.float32)  # finite unknown: detected
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())
    clean = codes[torch.isfinite(ref)]
    assert torch.equal(upcast(clean, torch.tensor(1.0), torch.float32, finite=True), clean.to(torch.float32))


def test_operand_transpose_shares_the_cached_upcast():
    op = random_operand((8, 4), torch.float8_e4m3fn, 1)
    a = op.dequantize(torch.bfloat16)
    b = op.t().dequantize(torch.bfloat16)
    assert b.shape == (4, 8) and b.data_ptr() == a.data_ptr()
    assert torch.equal(b, a.t())


def test_operand_rejects_non_fp8():
    with pytest.raises(TypeError, match="float8"):
        FP8Operand(torch.zeros(4, 4), torch.tensor(1.0))
    with pytest.raises(TypeError, match="2-D"):
        FP8Operand(torch.zeros(4, dtype=torch.float8_e4m3fn), torch.tensor(1.0))


# Unit roundoff of the accumulator. CPU kernels accumulate in FP32. Hopper's FP8 tensor cores
# accumulate with fewer mantissa bits (DeepSeek-V3 reports ~14); measured on an H200 with
# torch._scaled_mm: errors up to 5e-5 of the result for K=13, so CUDA gets 2^-13.
ACCUMULATOR_EPS = {"cpu": torch.finfo(torch.float32).eps, "cuda": 2.0**-13}


def summation_bound(a: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """|fl(a @ b) - a @ b| <= K * eps * (|a| @ |b|) for any summation order."""
    k = a.shape[1]
    return k * eps * (a.abs() @ b.abs())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "a_dtype,b_dtype", [(torch.float8_e4m3fn,) * 2, (torch.float8_e5m2, torch.float8_e4m3fn), (torch.float8_e5m2,) * 2]
)
@pytest.mark.parametrize("shape", [(64, 512, 48), (7, 13, 5)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_and_emulation_agree_within_fp32_summation_error(device, a_dtype, b_dtype, shape, out_dtype):
    """Both backends compute the same exact products of the same FP8 operands and accumulate them
    in FP32; they may differ only in summation order (and, for a BF16 output, in the final
    rounding of that sum). So each is compared with a float64 product of the dequantized FP8
    operands: within K*eps32*(|a|@|b|) for FP32 output, plus half a BF16 ulp of the exact result
    for BF16 output. Two results inside that bound are equal within FP32 summation-order error.
    (On CUDA the accumulator of the FP8 tensor cores is coarser: see ACCUMULATOR_EPS.)"""
    if device == "cpu":
        assert scaled_mm_supported("cpu")
    m, k, n = shape
    a = random_operand((m, k), a_dtype, 1, device)
    b = random_operand((n, k), b_dtype, 2, device).t()  # (k, n), column-major like a weight
    ref = exact(a) @ exact(b)
    bound = summation_bound(exact(a), exact(b), ACCUMULATOR_EPS[device])
    if out_dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8  # one BF16 rounding of the (summed) result
    results = {backend: fp8_mm(a, b, out_dtype, backend=backend) for backend in ("scaled_mm", "emulated")}
    for backend, out in results.items():
        assert out.dtype == out_dtype and out.shape == (m, n)
        err = (out.double() - ref).abs()
        assert bool((err <= bound).all()), f"{backend}: max excess {(err - bound).max().item()}"
    assert not torch.equal(ref, torch.zeros_like(ref))


@pytest.mark.parametrize("backend", ["scaled_mm", "emulated"])
def test_bias_is_added(backend):
    a = random_operand((16, 32), torch.float8_e4m3fn, 3)
    b = random_operand((16, 32), torch.float8_e4m3fn, 4).t()
    bias = torch.randn(16)
    with_bias = fp8_mm(a, b, torch.float32, bias=bias, backend=backend)
    without = fp8_mm(a, b, torch.float32, backend=backend)
    torch.testing.assert_close(with_bias, without + bias, rtol=1e-6, atol=1e-5)


def test_backend_choice():
    assert choose_backend("cpu") == "emulated"  # measured faster on CPU (module docstring)
    assert choose_backend("cpu", "scaled_mm") == "scaled_mm"
    assert not scaled_mm_supported("meta")
    with pytest.raises(ValueError, match="auto, scaled_mm, emulated"):
        choose_backend("cpu", "cublas")
    with pytest.raises(ValueError, match="no FP8 kernel"):
        choose_backend("meta", "scaled_mm")


def test_bad_shapes_and_dtypes_are_refused():
    a = random_operand((4, 8), torch.float8_e4m3fn, 5)
    with pytest.raises(ValueError, match="cannot be multiplied"):
        fp8_mm(a, a, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_mm(a, a.t(), torch.int32)
