import pytest
import torch

import fp8lm
from fp8lm.formats import format_of


@pytest.mark.parametrize(
    "fmt, dtype, fmax, nbytes",
    [
        (fp8lm.E4M3, torch.float8_e4m3fn, 448.0, 1),
        (fp8lm.E5M2, torch.float8_e5m2, 57344.0, 1),
        (fp8lm.FP16, torch.float16, 65504.0, 2),
        (fp8lm.BF16, torch.bfloat16, torch.finfo(torch.bfloat16).max, 2),
        (fp8lm.FP32, torch.float32, torch.finfo(torch.float32).max, 4),
    ],
)
def test_format_attributes(fmt, dtype, fmax, nbytes):
    assert fmt.dtype == dtype
    assert fmt.max == fmax == torch.finfo(dtype).max
    assert fmt.bytes == nbytes == torch.empty((), dtype=dtype).element_size()


def test_format_of_accepts_names_dtypes_and_formats():
    assert format_of("e4m3") is fp8lm.E4M3
    assert format_of(torch.float8_e5m2) is fp8lm.E5M2
    assert format_of(fp8lm.FP16) is fp8lm.FP16


@pytest.mark.parametrize("bad", ["E3M4", torch.int8, 3])
def test_format_of_rejects_unknown(bad):
    with pytest.raises(ValueError, match="unknown format.*E4M3, E5M2, FP16, BF16, FP32"):
        format_of(bad)


def test_smallest_values():
    assert fp8lm.E4M3.min_normal == 2.0**-6 and fp8lm.E4M3.min_subnormal == 2.0**-9
    assert fp8lm.E5M2.min_normal == 2.0**-14 and fp8lm.E5M2.min_subnormal == 2.0**-16
    assert fp8lm.FP16.min_subnormal == 2.0**-24
    # Half the smallest subnormal rounds (to even) to zero; just above it does not.
    half = torch.tensor([fp8lm.E4M3.min_subnormal / 2, fp8lm.E4M3.min_subnormal * 0.51])
    assert half.to(torch.float8_e4m3fn).float().tolist() == [0.0, fp8lm.E4M3.min_subnormal]
