/* FP8/FP16/BF16 <-> float32 conversions shared by the CPU kernels (cast.c, adam.c).

   Exact decoding and round-to-nearest-even encoding with the results of torch's own conversions,
   written so that the compiler vectorizes them: FP16 through the F16C instructions; E4M3/E5M2 by
   moving their bits into FP16's layout (decoding) or by integer rounding of the float32 bits
   (encoding). Work is done in blocks of BLOCK elements that stay in L1. */

#ifndef FP8LM_CODEC_H
#define FP8LM_CODEC_H

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, F16 = 1, BF16 = 2, E4M3 = 3, E5M2 = 4 };
enum { BLOCK = 512 };

static inline float f32_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float format_max(int dtype) {
    switch (dtype) {
        case F16: return 65504.0f;
        case BF16: return f32_of(0x7F7F0000u);
        case E4M3: return 448.0f;
        case E5M2: return 57344.0f;
        default: return f32_of(0x7F7FFFFFu);
    }
}

/* The smallest normal magnitude (float32's for F32). */
static inline float format_min_normal(int dtype) {
    switch (dtype) {
        case F16: return 0x1p-14f;
        case BF16: return 0x1p-126f;
        case E4M3: return 0x1p-6f;
        case E5M2: return 0x1p-14f;
        default: return 0x1p-126f;
    }
}

/* -- decoding: payload -> float, exact ------------------------------------------------------- */

/* FP16 <-> float32 through the F16C instructions (the compiler does not vectorize _Float16 casts). */
static inline void halves_to_floats(const uint16_t *h, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) {
        _Float16 x;
        memcpy(&x, h + i, 2);
        dst[i] = (float)x;
    }
}

static inline void floats_to_halves(const float *src, uint16_t *h, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) {
        _Float16 x = (_Float16)src[i];
        memcpy(h + i, &x, 2);
    }
}

/* Payload -> float, exactly. */
static inline void decode(int dtype, const void *src, float *dst, int64_t n) {
    uint16_t h[BLOCK];
    const uint8_t *b = src;
    switch (dtype) {
        case F32: memcpy(dst, src, (size_t)n * 4); break;
        case F16: halves_to_floats(src, dst, n); break;
        case BF16: {
            const uint16_t *s = src;
            for (int64_t i = 0; i < n; i++) dst[i] = f32_of((uint32_t)s[i] << 16);
            break;
        }
        case E4M3: /* E4M3 bits moved into FP16's layout read 2^8 too small (bias 7 vs 15), subnormals too */
            for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)(((b[i] & 0x7F) << 7) | ((b[i] & 0x80) << 8));
            halves_to_floats(h, dst, n);
            for (int64_t i = 0; i < n; i++) { /* 0x7F/0xFF: its only NaN, selected by a mask */
                uint32_t is_nan = 0u - (uint32_t)((b[i] & 0x7F) == 0x7F);
                dst[i] = f32_of((bits_of(dst[i] * 256.0f) & ~is_nan) | (0x7FC00000u & is_nan));
            }
            break;
        case E5M2: /* E5M2 is the upper byte of FP16 */
            for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)(b[i] << 8);
            halves_to_floats(h, dst, n);
            break;
    }
}

static inline float decode_one(int dtype, const void *src) {
    float x;
    decode(dtype, src, &x, 1);
    return x;
}

/* -- encoding: float (already within the format's range, or NaN) -> payload, round to nearest even */

/* FP8 with `mbits` mantissa bits and exponent bias `bias`. Normal values: round the float32 bits at
   the mantissa cut, then rebias the exponent. Subnormals (below 2^(1 - bias)): adding a constant
   whose ulp is the subnormal step lets the FPU round; the code is the difference of the bits. */
static inline uint8_t fp8_code(float y, int mbits, int bias, uint8_t nan_code) {
    uint32_t u = bits_of(y);
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t sign = (u >> 24) & 0x80u;
    int cut = 23 - mbits;
    float magic = f32_of((uint32_t)(127 + 23 + 1 - bias - mbits) << 23); /* 2^23 subnormal steps */
    uint32_t normal = ((a + ((1u << (cut - 1)) - 1) + ((a >> cut) & 1)) >> cut) - ((uint32_t)(127 - bias) << mbits);
    uint32_t subnormal = bits_of(f32_of(a) + magic) - bits_of(magic);
    /* selections by masks, not branches: the loops calling this vectorize */
    uint32_t is_sub = 0u - (uint32_t)(a < ((uint32_t)(127 + 1 - bias) << 23));
    uint32_t code = (subnormal & is_sub) | (normal & ~is_sub);
    uint32_t is_nan = 0u - (uint32_t)(a > 0x7F800000u);
    code = ((uint32_t)nan_code & is_nan) | (code & ~is_nan);
    return (uint8_t)(code | sign);
}

static inline void encode(int dtype, const float *src, void *dst, int64_t n) {
    switch (dtype) {
        case F32: memcpy(dst, src, (size_t)n * 4); break;
        case F16: floats_to_halves(src, dst, n); break;
        case BF16: {
            uint16_t *d = dst;
            for (int64_t i = 0; i < n; i++) {
                uint32_t u = bits_of(src[i]);
                uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1)) >> 16;
                d[i] = (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
            }
            break;
        }
        case E4M3: {
            uint8_t *d = dst;
            for (int64_t i = 0; i < n; i++) d[i] = fp8_code(src[i], 3, 7, 0x7F);
            break;
        }
        case E5M2: {
            uint8_t *d = dst;
            for (int64_t i = 0; i < n; i++) d[i] = fp8_code(src[i], 2, 15, 0x7F);
            break;
        }
    }
}

static inline int itemsize(int dtype) { return dtype == F32 ? 4 : (dtype == E4M3 || dtype == E5M2) ? 1 : 2; }

/* x * scale saturated at +-fmax. An infinite x becomes NaN, not +-fmax: saturated, an inf would
   pass every later finiteness check as a finite value. NaN compares false: it stays NaN. */
static inline void scale_clamp(float *x, int64_t n, float scale, float fmax) {
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] * scale;
        y = y < -fmax ? -fmax : (y > fmax ? fmax : y);
        x[i] = (bits_of(x[i]) & 0x7FFFFFFFu) == 0x7F800000u ? NAN : y;
    }
}

/* The largest magnitude code of a payload (sign cleared): for every format here the magnitude bits
   order like the values, NaN codes above inf, so it decodes (`amax_of_code`) to the exact amax. */
static inline uint32_t max_magnitude_code(int dtype, const void *payload, int64_t len) {
    if (itemsize(dtype) == 1) {
        const uint8_t *x = payload;
        uint8_t mx = 0;
        for (int64_t i = 0; i < len; i++) { uint8_t c = x[i] & 0x7F; mx = c > mx ? c : mx; }
        return mx;
    }
    if (itemsize(dtype) == 2) {
        const uint16_t *x = payload;
        uint16_t mx = 0;
        for (int64_t i = 0; i < len; i++) { uint16_t c = x[i] & 0x7FFF; mx = c > mx ? c : mx; }
        return mx;
    }
    const uint32_t *x = payload;
    uint32_t mx = 0;
    for (int64_t i = 0; i < len; i++) { uint32_t c = x[i] & 0x7FFFFFFFu; mx = c > mx ? c : mx; }
    return mx;
}

static inline float amax_of_code(int dtype, uint32_t code) {
    if (dtype == E4M3 && code == 0x7F) return NAN; /* E4M3's only non-finite code */
    uint8_t c8 = (uint8_t)code;
    uint16_t c16 = (uint16_t)code;
    return dtype == F32 ? f32_of(code) : decode_one(dtype, itemsize(dtype) == 1 ? (const void *)&c8 : (const void *)&c16);
}

/* The amax of a payload whose largest pre-rounding magnitude was `y`: rounding is monotonic, so
   it is `y` stored and read back. */
static inline float stored_amax_of(int dtype, float y) {
    uint32_t code = 0;
    encode(dtype, &y, &code, 1);
    return decode_one(dtype, &code);
}


/* -- 16 lanes at a time (AVX-512): the fused loops of cast.c ------------------------- */
#if defined(__AVX512F__) && defined(__AVX2__)
/* `fp8_code` for 16 lanes (FP8 with `mbits` mantissa bits and exponent bias `bias`), as int32 lanes. */
static inline __m512i fp8_codes16(__m512 y, int mbits, int bias) {
    const int cut = 23 - mbits;
    __m512i u = _mm512_castps_si512(y);
    __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, cut), _mm512_set1_epi32(1));
    __m512i normal = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((1 << (cut - 1)) - 1)), odd), cut),
        _mm512_set1_epi32((127 - bias) << mbits));
    __m512 magic = _mm512_set1_ps(f32_of((uint32_t)(127 + 23 + 1 - bias - mbits) << 23));
    __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), magic)),
                                         _mm512_castps_si512(magic));
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, _mm512_set1_epi32((127 + 1 - bias) << 23)),
                                           normal, subnormal);
    code = _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), code, _mm512_set1_epi32(0x7F));
    return _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80)));
}

static inline __m512 clamp16(__m512 y, __m512 fmax) {
    /* max/min return their second operand when one is NaN: NaN stays NaN, like `scale_clamp`. */
    return _mm512_min_ps(fmax, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), fmax), y));
}

/* NaN in the lanes where `x` is +-inf (see `scale_clamp`), `y` elsewhere. */
static inline __m512 nan_where_inf16(__m512 x, __m512 y) {
    __mmask16 inf = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_ps(y, inf, _mm512_set1_ps(NAN));
}

static inline __m512i magnitude_max16(__m512i acc, __m512 y) {
    return _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7FFFFFFF)));
}

#endif

/* The calling OpenMP thread's share [lo, hi) of `total` elements, cut at multiples of BLOCK. */
static inline void thread_range(int64_t total, int64_t *lo, int64_t *hi) {
    int64_t blocks = (total + BLOCK - 1) / BLOCK;
    int i = omp_get_thread_num(), nt = omp_get_num_threads();
    *lo = blocks * i / nt * BLOCK;
    *hi = blocks * (i + 1) / nt * BLOCK;
    if (*hi > total) *hi = total;
}

/* Threads: torch's OpenMP pool (the same libgomp), at most one per 16 blocks of work. */
static inline int threads_for(int64_t total, int n_threads) {
    int64_t useful = total / (BLOCK * 16);
    if (useful < n_threads) n_threads = (int)useful;
    return n_threads < 1 ? 1 : n_threads;
}

#endif
