/* Saturating scaled casts and exact upcasts between float formats, for CPUs.

   fp8_cast: dst = round-to-nearest-even(clamp(src * scale, +-max of dst's format)) (inf -> NaN), with the exact
   amax of src taken in the same pass: what fp8lm.ops.cast.saturating_cast_with_amax computes, one
   read of src and no temporaries (torch's eager path makes four passes; inductor's code converts
   FP8 one element at a time on CPUs without AVX-512 FP8 support and costs ~40 us of guards a call).
   fp8_upcast: dst = src * scale_inv, exactly (every FP8 value is a BF16 value).

   Built on first use by fp8lm/ops/native.py with the system C compiler; see that module. */

#include "codec.h"

enum { MAX_THREADS = 256 };

/* -- training's casts in one fused loop (AVX-512) ------------------------------------------------
   BF16 or float32 in, E4M3 or E5M2 out, with the amax and the BF16 read-back: the casts of FP8
   layers' inputs, weights and output gradients. 16 elements at a time in registers, the same
   results as the block path below. Returns the number of elements done (a multiple of 16). */
#if defined(__AVX512F__) && defined(__AVX2__)
static inline __m512 load_bf16(const void *p, int64_t i) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* FP8 codes (int32 lanes) -> their float values, NaN code included. */
static inline __m512 fp8_values16(__m512i code, int e4m3) {
    __m256i c = _mm512_cvtepi32_epi16(code);
    if (!e4m3) return _mm512_cvtph_ps(_mm256_slli_epi16(c, 8)); /* E5M2 is the upper byte of FP16 */
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 7),
                                _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8));
    __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(code, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7F));
    return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN));
}

/* float32 -> BF16 bits, round to nearest even (NaN -> 0x7FC0), as in `encode`. */
static inline __m256i bf16_bits16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}

static int64_t fused_cast(const void *src, int src_dtype, int64_t lo, int64_t hi, float scale, void *dst, int dst_dtype,
                          int want_amax, uint32_t *amax_bits, void *deq, int deq_dtype, float deq_scale_inv) {
    if (!((src_dtype == BF16 || src_dtype == F32) && (dst_dtype == E4M3 || dst_dtype == E5M2) &&
          (deq == NULL || deq_dtype == BF16)))
        return 0;
    const int e4m3 = dst_dtype == E4M3, mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const __m512 s = _mm512_set1_ps(scale), fmax = _mm512_set1_ps(format_max(dst_dtype));
    const __m512 inv = _mm512_set1_ps(deq_scale_inv);
    __m512i mx = _mm512_setzero_si512();
    int64_t end = lo + (hi - lo) / 16 * 16;
    for (int64_t i = lo; i < end; i += 16) {
        __m512 x = src_dtype == BF16 ? load_bf16(src, i) : _mm512_loadu_ps((const float *)src + i);
        if (want_amax) mx = magnitude_max16(mx, x);
        __m512i code = fp8_codes16(nan_where_inf16(x, clamp16(_mm512_mul_ps(x, s), fmax)), mbits, bias);
        _mm_storeu_si128((__m128i *)((uint8_t *)dst + i), _mm512_cvtepi32_epi8(code));
        if (deq)
            _mm256_storeu_si256((__m256i *)((uint16_t *)deq + i), bf16_bits16(_mm512_mul_ps(fp8_values16(code, e4m3), inv)));
    }
    uint32_t m = _mm512_reduce_max_epu32(mx);
    *amax_bits = m > *amax_bits ? m : *amax_bits;
    return end - lo;
}
#else
static int64_t fused_cast(const void *src, int src_dtype, int64_t lo, int64_t hi, float scale, void *dst, int dst_dtype,
                          int want_amax, uint32_t *amax_bits, void *deq, int deq_dtype, float deq_scale_inv) {
    (void)src, (void)src_dtype, (void)lo, (void)hi, (void)scale, (void)dst, (void)dst_dtype, (void)want_amax;
    (void)amax_bits, (void)deq, (void)deq_dtype, (void)deq_scale_inv;
    return 0;
}
#endif

/* amax_out may be NULL (no amax wanted). deq (NULL for none) receives the stored values read back,
   dst * deq_scale_inv as deq_dtype: what an emulated FP8 GEMM multiplies, without a second pass.
   Returns 0. */
int fp8_cast(const void *src, int src_dtype, int64_t n, float scale, void *dst, int dst_dtype, float *amax_out,
             void *deq, int deq_dtype, float deq_scale_inv, int n_threads) {
    uint32_t maxima[MAX_THREADS] = {0};
    n_threads = threads_for(n, n_threads > MAX_THREADS ? MAX_THREADS : n_threads);
    const float fmax = format_max(dst_dtype);
    const int in_size = itemsize(src_dtype), out_size = itemsize(dst_dtype);
#pragma omp parallel num_threads(n_threads)
    {
        float buf[BLOCK];
        uint32_t mx = 0;
        int64_t lo, hi;
        thread_range(n, &lo, &hi);
        lo += fused_cast(src, src_dtype, lo, hi, scale, dst, dst_dtype, amax_out != NULL, &mx, deq, deq_dtype,
                         deq_scale_inv);
        for (int64_t s = lo; s < hi; s += BLOCK) {
            int64_t len = hi - s < BLOCK ? hi - s : BLOCK;
            decode(src_dtype, (const char *)src + s * in_size, buf, len);
            if (amax_out) {
                /* Magnitude bits order like the values, NaN above inf: an integer max that vectorizes. */
                const uint32_t *bits = (const uint32_t *)buf;
                for (int64_t k = 0; k < len; k++) {
                    uint32_t a = bits[k] & 0x7FFFFFFFu;
                    mx = a > mx ? a : mx;
                }
            }
            scale_clamp(buf, len, scale, fmax);
            encode(dst_dtype, buf, (char *)dst + s * out_size, len);
            if (deq) {
                decode(dst_dtype, (const char *)dst + s * out_size, buf, len);
                for (int64_t k = 0; k < len; k++) buf[k] *= deq_scale_inv;
                encode(deq_dtype, buf, (char *)deq + s * itemsize(deq_dtype), len);
            }
        }
        maxima[omp_get_thread_num()] = mx;
    }
    if (amax_out) {
        uint32_t mx = 0;
        for (int i = 0; i < n_threads; i++) mx = maxima[i] > mx ? maxima[i] : mx;
        *amax_out = f32_of(mx);
    }
    return 0;
}

int fp8_upcast(const void *src, int src_dtype, int64_t n, float scale_inv, void *dst, int dst_dtype, int n_threads) {
    n_threads = threads_for(n, n_threads > MAX_THREADS ? MAX_THREADS : n_threads);
    const int in_size = itemsize(src_dtype), out_size = itemsize(dst_dtype);
#pragma omp parallel num_threads(n_threads)
    {
        float buf[BLOCK];
        int64_t lo, hi;
        thread_range(n, &lo, &hi);
        for (int64_t s = lo; s < hi; s += BLOCK) {
            int64_t len = hi - s < BLOCK ? hi - s : BLOCK;
            decode(src_dtype, (const char *)src + s * in_size, buf, len);
            for (int64_t k = 0; k < len; k++) buf[k] *= scale_inv;
            encode(dst_dtype, buf, (char *)dst + s * out_size, len);
        }
    }
    return 0;
}
