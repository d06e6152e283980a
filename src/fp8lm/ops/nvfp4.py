"""NVFP4 numerics: E2M1 elements with two-level scales (an E4M3 scale per block, an FP32 one per
tensor), as NVIDIA's NVFP4 recipe.

E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. With ``amax_t`` the tensor's amax and
``amax_b`` a block's, all arithmetic in float32:

- tensor: ``s_enc = 6 * 448 / amax_t`` (at most float32's max; 1 for a tensor of zeros, NaN for
  one holding inf or NaN), ``s_dec = 1 / s_enc``;
- block: ``sb = e4m3(amax_b / 6 * s_enc)`` (the stored E4M3 scale, round to nearest even,
  saturating), ``d = sb * s_dec``;
- element: ``q = e2m1(x / d)`` (0 where ``d`` is 0), saturating at 6, rounded to nearest even or,
  given uniform ``noise`` in [0, 1), stochastically: up with probability equal to the distance
  from the grid point below, over the spacing.

The values the GEMM sees are ``q * d``. Elements are kept in an E4M3 payload (every E2M1 value is
an E4M3 value), one byte each; `pack_e2m1` packs them two to a byte as ``torch.float4_e2m1fn_x2``
holds them (the first of each pair in the low four bits), the form NVIDIA's FP4 GEMM reads, and
`unpack_e2m1` reads them back.

Four Over Six (``scale_rule="4over6"``, arXiv 2512.02010): E2M1 has no value between 4 and 6, so
a block scaled to 6 rounds its values in (4, 6) by up to a sixth. Each block is also scaled to 4
(``sb = e4m3(amax_b / 4 * s_enc)``, its largest value then lands on 4 and the grid above 4 is not
used) and keeps whichever of the two scales gives the smaller squared error of its values,
rounded to nearest (ties keep 6). The tensor scale is ``s_enc = 6 * 256 / amax_t`` so that the
largest block's scale to 4, 384, still fits E4M3. The choice depends on the values alone;
stochastic rounding then rounds with the chosen scale, so it stays unbiased.
"""

from __future__ import annotations

import torch

from .blocks import per_block

__all__ = [
    "E2M1_MAX",
    "round_e2m1",
    "tensor_scales",
    "block_scales",
    "decoded_block_scales",
    "stored_block_scales",
    "scaled",
    "four_over_six",
    "TENSOR_SCALE_BASE",
    "e2m1_codes",
    "pack_e2m1",
    "pack_e2m1_bytes",
    "unpack_e2m1",
    "unpack_e2m1_as_e4m3",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
TENSOR_SCALE_BASE = E2M1_MAX * E4M3_MAX
# 4over6 (`fp8lm.recipe.NVFP4_SCALE_RULES`): the largest block scale to 6 is 256, to 4 is 384
FOUR_OVER_SIX_TENSOR_SCALE_BASE = E2M1_MAX * 256.0
_FLOAT32_MAX = torch.finfo(torch.float32).max


def round_e2m1(v: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """``v`` (float32) on the E2M1 grid, saturating at 6: to nearest even, or stochastically with
    ``noise`` (uniform in [0, 1), ``v``'s shape). NaN stays NaN; the sign of zero is kept."""
    a = v.abs().clamp(max=E2M1_MAX)
    quantum = _e2m1_spacing(a)
    r = a / quantum  # exact
    if noise is None:
        n = torch.round(r)  # half to even
    else:
        low = torch.floor(r)
        # 1 exactly where noise < r - low: a float difference is 0 only between equal floats and
        # keeps the sign of the exact one (a comparison's bool would need a slow conversion on CPU).
        n = low + torch.ceil((r - low) - noise)
    return torch.copysign(n * quantum, v)


def _e2m1_spacing(a: torch.Tensor) -> torch.Tensor:
    """The E2M1 grid's spacing around ``a`` (float32, 0 <= a <= 6): 0.5 below 2, 1 in [2, 4), 2
    from 4, i.e. 2**(floor(log2(a)) - 1), at least 0.5. Built from the float32 exponent field
    with integer operations (exact, and several times faster on CPU than ``frexp``)."""
    field = (a.view(torch.int32) >> 23) - 1
    return (field.clamp(126, 128) << 23).view(torch.float32)


def tensor_scales(amax: torch.Tensor, scale_rule: str = "max6") -> tuple[torch.Tensor, torch.Tensor]:
    """``(s_enc, s_dec)`` of a tensor of amax ``amax`` (float32) under ``scale_rule`` (see the
    module doc)."""
    base = TENSOR_SCALE_BASE if scale_rule == "max6" else FOUR_OVER_SIX_TENSOR_SCALE_BASE
    # A tensor divided, not a number: torch computes ``number / tensor`` as a product with the
    # reciprocal, rounded twice.
    s_enc = (torch.full_like(amax, base) / amax).clamp(max=_FLOAT32_MAX)
    s_enc = torch.where(amax == 0, torch.ones_like(s_enc), s_enc)
    s_enc = torch.where(torch.isfinite(amax), s_enc, torch.full_like(s_enc, float("nan")))
    return s_enc, s_enc.reciprocal()


def block_scales(
    amax: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor, element_max: float = E2M1_MAX
) -> torch.Tensor:
    """``d`` of each block of amax ``amax`` (float32) under the tensor scales ``s_enc``, ``s_dec``:
    the block's amax mapped to ``element_max`` (6, or 4 for Four Over Six's other candidate)."""
    stored = (amax / element_max * s_enc).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    return decoded_block_scales(stored, s_dec)


def decoded_block_scales(stored: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """``d`` of blocks whose stored E4M3 scales are ``stored`` under the tensor scale ``s_dec``."""
    return stored.to(torch.float32) * s_dec


def stored_block_scales(d: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """The stored E4M3 scales of blocks of scale ``d``, `decoded_block_scales` reversed exactly:
    ``d / s_dec`` is the E4M3 value up to float32 rounding, which the cast undoes (as long as
    ``d`` is a normal float32: a tensor amax above about 1e-32)."""
    return (d / s_dec).to(torch.float8_e4m3fn)


def scaled(xb: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``x / d`` of a `fp8lm.ops.blocks.to_blocks` view ``xb`` and its blocks' ``d`` (float32; 0
    where ``d`` is 0): what `round_e2m1` rounds."""
    d_b = per_block(d)
    v = xb.to(torch.float32) / d_b
    return torch.where(d_b == 0, torch.zeros_like(v), v)


def four_over_six(xb: torch.Tensor, d6: torch.Tensor, d4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Four Over Six's ``d`` per block, and the block's values rounded to nearest with it
    (`round_e2m1` of `scaled`): of a `fp8lm.ops.blocks.to_blocks` view ``xb`` and its candidate
    scales ``d6`` (amax to 6) and ``d4`` (amax to 4), the one whose nearest-rounded values
    ``e2m1(x / d) * d`` (float32, as the GEMM sees them) are closer to ``x``: the sum of squared
    errors in float64 (exact enough that the choice is the float64 one), ties to ``d6``."""
    x64 = xb.to(torch.float64)

    def candidate(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = round_e2m1(scaled(xb, d))
        return q, ((q * per_block(d)).to(torch.float64) - x64).square().sum(dim=(1, 3))

    (q6, error6), (q4, error4) = candidate(d6), candidate(d4)
    four = error4 < error6
    return torch.where(four, d4, d6), torch.where(per_block(four), q4, q6)


def e2m1_codes(payload: torch.Tensor) -> torch.Tensor:
    """The 4-bit E2M1 codes (uint8, 0-15: sign, two exponent bits, one mantissa bit) of a payload
    holding E2M1 values (any float dtype; what `round_e2m1` gives). Magnitudes 0, 0.5, 1, 1.5 are
    codes 0-3 (twice the value), 2, 3, 4 are 4-6 (the value plus 2), 6 is 7; the sign of zero is
    kept. E2M1 has no NaN: a NaN element (only ever in a block whose scale is NaN too, so its
    values stay NaN) packs as code 7. An E4M3 payload is read from its bytes through a table
    (torch converts float8 on CPU one element at a time)."""
    if payload.dtype == torch.float8_e4m3fn:
        return _lookup("codes", payload.view(torch.uint8))
    return _codes_of_values(payload)


def _codes_of_values(payload: torch.Tensor) -> torch.Tensor:
    v = payload.to(torch.float32)
    a = v.abs()
    magnitude = torch.where(a < 2, a * 2, torch.where(a < E2M1_MAX, a + 2, torch.full_like(a, 7.0)))
    return magnitude.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def _build_table(name: str) -> torch.Tensor:
    """``"codes"``: the E2M1 code of each E4M3 byte (256); ``"pairs"``: the two E4M3 bytes of the
    two codes in each packed byte (256 x 2)."""
    every = torch.arange(256, dtype=torch.uint8)
    if name == "codes":
        return _codes_of_values(every.view(torch.float8_e4m3fn))
    return unpack_e2m1(every).to(torch.float8_e4m3fn).view(torch.uint8).view(256, 2)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _lookup(name: str, index: torch.Tensor) -> torch.Tensor:
    """The entries of table ``name`` (`_build_table`: one copy per device, or a constant of the
    graph torch.compile traces) at the bytes ``index``: ``index``'s shape, plus the table's row
    shape."""
    key = (name, index.device)
    if torch.compiler.is_compiling():
        table = _build_table(name).to(index.device)
    else:
        if key not in _TABLES:
            _TABLES[key] = _build_table(name).to(index.device)
        table = _TABLES[key]
    rows = torch.index_select(table, 0, index.flatten().to(torch.int32))
    return rows.view(*index.shape, *table.shape[1:])


def pack_e2m1(payload: torch.Tensor) -> torch.Tensor:
    """A payload of E2M1 values (..., K), K even, packed two to a byte along its last dim:
    (..., K / 2) ``torch.float4_e2m1fn_x2``, contiguous, element ``2i`` in the low four bits of
    byte ``i``."""
    return pack_e2m1_bytes(payload).view(torch.float4_e2m1fn_x2)


def pack_e2m1_bytes(payload: torch.Tensor) -> torch.Tensor:
    """`pack_e2m1` as uint8 bytes: the form compiled functions return (inductor generates no code
    for ``torch.float4_e2m1fn_x2`` buffers)."""
    if payload.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: the last dim must be even, got shape {tuple(payload.shape)}")
    codes = e2m1_codes(payload)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values (..., 2 K) of ``packed`` (..., K), `pack_e2m1`'s result (its uint8 or
    ``torch.float4_e2m1fn_x2`` bytes)."""
    bytes_ = packed.view(torch.uint8)
    codes = torch.stack((bytes_ & 15, bytes_ >> 4), dim=-1).flatten(-2).to(torch.int64)
    values = torch.tensor(_E2M1_VALUES, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -values, values)


def unpack_e2m1_as_e4m3(packed: torch.Tensor) -> torch.Tensor:
    """`unpack_e2m1` as the E4M3 payload (``torch.float8_e4m3fn``) that `pack_e2m1` packed: each
    byte's two E4M3 bytes from a table."""
    pairs = _lookup("pairs", packed.view(torch.uint8))
    return pairs.flatten(-2).view(torch.float8_e4m3fn)
