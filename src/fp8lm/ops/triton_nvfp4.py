"""A Triton GEMM of nvfp4 operands, for GPUs without FP4 tensor cores (compute capability 8.9 and
9.0: an H100, an H200), as the custom op ``torch.ops.fp8lm.triton_nvfp4_mm`` (optional: needs
``triton``, the ``fp8lm[triton]`` extra).

`triton_nvfp4_mm(a, b, out_dtype, bias)` multiplies two nvfp4 operands (`fp8lm.ops.finegrained`:
``a`` (M, K) in 1 x 16 or 16 x 16 blocks, ``b`` (K, N) in 16 x 1 or 16 x 16) from what NVIDIA's
FP4 GEMM reads, not from dequantized FP32 copies: the E2M1 elements packed two to a byte along K
(0.5 bytes per element) and one E4M3 scale byte per 16 elements. Each program decodes a tile of
each operand with integer and exact float operations (an E2M1 value times its E4M3 block scale
has at most 6 significant bits, so it is exact in BF16), multiplies the tiles in BF16 with FP32
accumulation (`tl.dot`; in FP32 under the interpreter, whose BF16 dot computes wrong values, with
the same exact products), and applies the two per-tensor scales, the bias and the one rounding to
``out_dtype`` at the end: the emulation's product (`fp8lm.ops.finegrained.block_mm`) up to the
order of the FP32 sums. It runs wherever Triton does: on a GPU, and on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, how the tests run it).
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["AVAILABLE", "triton_nvfp4_mm"]

AVAILABLE = importlib.util.find_spec("triton") is not None

if AVAILABLE:
    import triton  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,import-untyped,unused-ignore]

    @triton.jit
    def _e2m1_value(code):
        """The E2M1 value (float32) of 4-bit codes (int32): magnitudes 0, 0.5, 1, 1.5 (codes 0-3),
        2, 3, 4 (4-6), 6 (7); bit 3 the sign."""
        m = (code & 7).to(tl.float32)
        v = tl.where(m < 4.0, m * 0.5, tl.where(m < 7.0, m - 2.0, 6.0))
        return tl.where((code & 8) != 0, -v, v)

    @triton.jit
    def _e4m3_value(bits):
        """The ``float8_e4m3fn`` value (float32) of bytes (int32), from the bits: ``m * 2**-9`` for
        exponent 0, ``(8 + m) * 2**(e - 10)`` above, NaN for 0x7F and 0xFF."""
        e = (bits >> 3) & 15
        m = (bits & 7).to(tl.float32)
        power = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(e - 10), exact
        v = tl.where(e == 0, m * 0.001953125, (m + 8.0) * power)
        v = tl.where((bits & 0x7F) == 0x7F, float("nan"), v)
        return tl.where((bits & 0x80) != 0, -v, v)

    @triton.jit
    def _tile(packed_ptr, scale_ptr, rows, offs_r, offs_k, half_k, blocks_k):
        """Rows ``offs_r`` and elements ``offs_k`` of an operand as the float32 values
        ``e2m1 * sb``, each exact in BF16 (rows past ``rows`` are zeros)."""
        inside = (offs_r < rows)[:, None]
        byte = tl.load(packed_ptr + offs_r[:, None] * half_k + (offs_k // 2)[None, :], mask=inside, other=0)
        code = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[None, :]) & 15  # the first element in the low bits
        sb = tl.load(scale_ptr + offs_r[:, None] * blocks_k + (offs_k // 16)[None, :], mask=inside, other=0)
        return _e2m1_value(code) * _e4m3_value(sb.to(tl.int32))

    @triton.jit
    def _nvfp4_mm_kernel(
        a_ptr,
        sa_ptr,
        b_ptr,
        sb_ptr,
        ts_a_ptr,
        ts_b_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        HAS_BIAS: tl.constexpr,
        BF16_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = _tile(a_ptr, sa_ptr, M, offs_m, offs_k, K // 2, K // 16)
            b = _tile(b_ptr, sb_ptr, N, offs_n, offs_k, K // 2, K // 16)
            if BF16_DOT:  # exact conversions (module doc): the BF16 tensor cores' products are exact
                acc += tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)), out_dtype=tl.float32)
            else:  # the interpreter (its BF16 dot is wrong): the same exact products in FP32
                acc += tl.dot(a, tl.trans(b), input_precision="ieee", out_dtype=tl.float32)
        acc = acc * (tl.load(ts_a_ptr) * tl.load(ts_b_ptr))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        inside = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=inside)

    @torch.library.triton_op("fp8lm::triton_nvfp4_mm", mutates_args=())
    def _nvfp4_mm_op(
        a_packed: torch.Tensor,
        a_scales: torch.Tensor,
        b_packed: torch.Tensor,
        b_scales: torch.Tensor,
        a_tensor_scale: torch.Tensor,
        b_tensor_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        (m, half_k), n = a_packed.shape, b_packed.shape[0]
        out = torch.empty((m, n), dtype=out_dtype, device=a_packed.device)
        if m and n:
            block_k = 64 if half_k % 32 == 0 else 32
            kernel = torch.library.wrap_triton(_nvfp4_mm_kernel)
            grid = (triton.cdiv(m, 64), triton.cdiv(n, 64))
            kernel[grid](
                a_packed,
                a_scales,
                b_packed,
                b_scales,
                a_tensor_scale,
                b_tensor_scale,
                a_tensor_scale if bias is None else bias,
                out,
                m,
                n,
                2 * half_k,
                HAS_BIAS=bias is not None,
                BF16_DOT=a_packed.device.type != "cpu",
                BLOCK_M=64,
                BLOCK_N=64,
                BLOCK_K=block_k,
            )
        return out


def triton_nvfp4_mm(a, b, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``values(a) @ values(b) (+ bias)`` as ``out_dtype`` for nvfp4 `BlockOperand`\\ s that
    `fp8lm.ops.finegrained.nvfp4_scales_fit` takes, by the Triton kernel (module doc); needs
    ``triton``."""
    from .finegrained import FP4Operand, fp4_mm, nvfp4_row_operand, nvfp4_scales_fit

    if not AVAILABLE:
        raise RuntimeError("triton_nvfp4_mm needs Triton: pip install 'fp8lm[triton]'")
    if not nvfp4_scales_fit(a, b, out_dtype):
        raise ValueError("triton_nvfp4_mm takes nvfp4 operands blocked along K, K a multiple of 32, M and N of 16")
    a_fp4 = FP4Operand(*nvfp4_row_operand(a), a.tensor_scale)
    bt_fp4 = FP4Operand(*nvfp4_row_operand(b.t()), b.tensor_scale)
    return fp4_mm(a_fp4, bt_fp4, out_dtype, bias, "triton")
