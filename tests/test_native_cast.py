"""The C cast kernels against torch's own conversions, bit for bit: every FP16 value, the edges of
each format (ties, subnormals, saturation, inf, NaN) and sizes that split over threads and blocks."""

import pytest
import torch

from fp8lm.ops import native
from fp8lm.ops.cast import _eager_cast

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernels")

OUT_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16]
FMAX = {d: float(torch.finfo(d).max) for d in OUT_DTYPES}  # the saturation bound of each format


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b):
    """Equal bit patterns, except that any NaN equals any NaN (their payload bits are not specified)."""
    nan = torch.isnan(a.float())
    return torch.equal(nan, torch.isnan(b.float())) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _edge_values():
    finfo = {d: torch.finfo(d) for d in OUT_DTYPES}
    vals = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan")]
    for f in finfo.values():
        tiny = f.smallest_normal
        vals += [f.max, -f.max, f.max * 1.0625, f.max * 1.5, tiny, tiny / 2, tiny / 3, tiny * 0.75, tiny * 1.5]
    # Ties between neighbouring E4M3 / E5M2 values (round half to even) and their neighbours.
    for mant in (8, 4):
        for k in range(1, 2 * mant):
            vals += [(1 + (k + 0.5) / (2 * mant)) * s for s in (1.0, -1.0, 2.0**-8, 2.0**5)]
    return torch.tensor(vals, dtype=torch.float32)


@pytest.mark.parametrize("dst", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 2.0**9])
def test_cast_equals_torch_on_format_edges(src, dst, scale):
    x = _edge_values().to(src)
    out, amax, _ = native.cast(x, scale, dst, with_amax=True)
    assert _same(out, _eager_cast(x, torch.tensor(scale), FMAX[dst], dst))
    assert torch.isnan(amax)  # the edge values include a NaN
    finite = x[torch.isfinite(x.float())]
    _, amax, _ = native.cast(finite.contiguous(), scale, dst, with_amax=True)
    assert amax.item() == finite.float().abs().max().item()


@pytest.mark.parametrize("dst", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16], ids=str)
def test_cast_of_every_16_bit_value(src, dst):
    """Every FP16 / BF16 bit pattern; BF16 takes the AVX-512 loop where the CPU has it, with the
    read-back and the amax."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(src)
    for scale in (1.0, 2.0**-3, 2.0**4):
        out, amax, deq = native.cast(x, scale, dst, with_amax=True, dequantized=torch.bfloat16, scale_inv=1 / scale)
        assert _same(out, _eager_cast(x, torch.tensor(scale), FMAX[dst], dst))
        assert _same(deq, (out.to(torch.float32) / scale).to(torch.bfloat16))
        assert torch.isnan(amax)  # NaN bit patterns are among them


@pytest.mark.parametrize("n", [1, 511, 513, 100_003, 1 << 20])
def test_cast_and_amax_split_over_blocks_and_threads(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 8 * 1e3
    x[n // 2] = -7777.0  # the amax sits in one thread's share only
    out, amax, _ = native.cast(x, 2.0**-4, torch.float8_e4m3fn, with_amax=True)
    assert _same(out, _eager_cast(x, torch.tensor(2.0**-4), 448.0, torch.float8_e4m3fn))
    assert amax.item() == 7777.0


@pytest.mark.parametrize("src", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("scale_inv", [1.0, 2.0**-20, 2.0**30])
def test_upcast_of_every_fp8_code(src, dst, scale_inv):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(src).repeat(3)  # 768: two blocks
    got = native.upcast(codes, scale_inv, dst)
    assert _same(got, (codes.to(torch.float32) * scale_inv).to(dst))


def test_saturating_cast_uses_the_kernel_only_where_it_applies():
    """Non-contiguous input, several scales and autograd keep to torch's ops, with the same results."""
    from fp8lm.formats import E4M3
    from fp8lm.ops.cast import saturating_cast

    x = torch.randn(64, 32)
    one_scale = torch.tensor(4.0)
    for inp, scale in ((x.t(), one_scale), (x, torch.full((64, 1), 4.0)), (x, one_scale)):
        assert _same(saturating_cast(inp, scale, E4M3), _eager_cast(inp, scale, 448.0, torch.float8_e4m3fn))


def test_wrapper_subclasses_keep_to_torch_ops(tmp_path):
    """A DTensor's data pointer is not its values: the kernels must not take one (a fine-grained
    recipe's operands under tensor parallelism reach `upcast` as DTensors; a kernel crashed there)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from fp8lm.ops.cast import upcast

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
        payload = DTensor.from_local(codes, init_device_mesh("cpu", (1,)), [Replicate()], run_check=False)
        assert native.supports(codes) and not native.supports(payload)
        got = upcast(payload, torch.ones(()), torch.float32)
        assert _same(got.full_tensor(), codes.to(torch.float32))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fmt_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("deq", [torch.bfloat16, torch.float32], ids=str)
def test_cast_reads_back_the_stored_values(fmt_dtype, deq):
    """The dequantized output equals the payload upcast by torch, in the same call as the cast."""
    x = torch.cat([_edge_values(), torch.randn(3000) * 50])
    scale = 2.0**-3
    out, _, got = native.cast(x, scale, fmt_dtype, with_amax=False, dequantized=deq, scale_inv=1 / scale)
    assert _same(out, _eager_cast(x, torch.tensor(scale), FMAX[fmt_dtype], fmt_dtype))
    assert _same(got, (out.to(torch.float32) / scale).to(deq))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str
)
def test_amax_is_exact(dtype):
    from fp8lm.ops.cast import amax

    x = (torch.randn(70_001) * 30).clamp(-440, 440).to(dtype)
    assert native.amax(x).item() == x.float().abs().max().item() == amax(x).item()
    x[123] = float("nan")
    assert torch.isnan(native.amax(x))
