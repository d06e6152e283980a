/* Multi-tensor Adam/AdamW step over low-precision state, for CPUs.

   One call updates every tensor of a step: it dequantizes weight, gradient and both moments, applies
   the same arithmetic as fp8lm.optim.adam.adam_update (same operation order, float32, no fused
   multiply-add) and stores the results requantized with their new scales, or (write == 0) only
   returns the amaxes of the new values. Work is split across torch's OpenMP threads by element ranges
   and done in blocks that stay in L1: decode each input with a loop specialized to its format
   (codec.h), update, encode.

   Built on first use by fp8lm/ops/native.py with the system C compiler; see that module. */

#include "codec.h"

/* Half the smallest subnormal: a stored v >= 0 rounds to 0 exactly when v * scale <= this. */
static float underflow_threshold(int dtype) {
    switch (dtype) {
        case F16: return 0x1p-25f;
        case BF16: return 0x1p-134f; /* float32's subnormals: 0 for BF16 and FP32 */
        case E4M3: return 0x1p-10f;
        case E5M2: return 0x1p-17f;
        default: return 0.0f; /* 2^-150: v * scale <= it only when v * scale is 0 */
    }
}

typedef struct {
    void *const *ptrs;      /* [n][4]: w, g, m, v payloads (contiguous) */
    const int32_t *dtypes;  /* [n][4] */
    const float *scales;    /* [n][4]: current scales of w, g, m, v (payload = value * scale) */
    const float *new_scales;/* [n][3]: the scales the new w, m, v are stored with */
    const float *hp;        /* [n][8]: lr, beta1, beta2, eps, decay, l2, bias_correction1, bias_correction2_sqrt */
    int write;
    uint32_t *amax;         /* [n][3] this thread's largest magnitude bits of the new w, m, v:
                               unscaled (write == 0) or scaled before rounding (write == 1) */
} Step;

static void update_block(const Step *st, int64_t t, int64_t start, int64_t len) {
    float w[BLOCK], g[BLOCK], m[BLOCK], v[BLOCK];
    const int32_t *dt = st->dtypes + 4 * t;
    void *const *p = st->ptrs + 4 * t;
    const float *sc = st->scales + 4 * t, *hp = st->hp + 8 * t, *new_sc = st->new_scales + 3 * t;
    float *blocks[4] = {w, g, m, v};
    for (int k = 0; k < 4; k++) decode(dt[k], (const char *)p[k] + start * itemsize(dt[k]), blocks[k], len);

    const float inv_w = 1.0f / sc[0], inv_g = 1.0f / sc[1], inv_m = 1.0f / sc[2], inv_v = 1.0f / sc[3];
    const float lr = hp[0], beta1 = hp[1], beta2 = hp[2], eps = hp[3], decay = hp[4], l2 = hp[5];
    const float one_minus_beta1 = 1.0f - beta1, one_minus_beta2 = 1.0f - beta2;
    const float inv_bc2 = 1.0f / hp[7], step_size = lr / hp[6];
    for (int64_t i = 0; i < len; i++) {
        /* Same operations, in the same order, as adam.py's `_updated` and `adam_update`. */
        float wi = w[i] * inv_w, gi = g[i] * inv_g, mi = m[i] * inv_m, vi = v[i] * inv_v;
        gi = gi + l2 * wi;
        wi = wi * decay;
        mi = mi + one_minus_beta1 * (gi - mi);
        vi = vi * beta2 + one_minus_beta2 * gi * gi;
        float denom = sqrtf(vi) * inv_bc2 + eps;
        w[i] = wi - step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
    const int out[3] = {0, 2, 3};
    if (st->write) {
        /* An element whose second moment is stored as 0 loses its first moment (see adam.py). */
        const float sv = new_sc[2], v_zero = underflow_threshold(dt[3]);
        for (int64_t i = 0; i < len; i++) m[i] = v[i] * sv <= v_zero ? 0.0f : m[i];
        for (int k = 0; k < 3; k++) scale_clamp(blocks[out[k]], len, new_sc[k], format_max(dt[out[k]]));
    }
    /* Maxima of the magnitude bits (they order like the values, NaN above inf): integer reductions
       vectorize. With write, of the values about to be rounded: `stored_amax_of` rounds the max. */
    for (int k = 0; k < 3; k++) {
        const uint32_t *x = (const uint32_t *)blocks[out[k]];
        uint32_t mx = st->amax[3 * t + k];
        for (int64_t i = 0; i < len; i++) {
            uint32_t a = x[i] & 0x7FFFFFFFu;
            mx = a > mx ? a : mx;
        }
        st->amax[3 * t + k] = mx;
        if (st->write) encode(dt[out[k]], blocks[out[k]], (char *)p[out[k]] + start * itemsize(dt[out[k]]), len);
    }
}

/* -- the O2 layouts in one fused loop (AVX-512) ------------------------------------------------
   The block path above makes about a dozen passes over L1 per block; for the two layouts O2 gives
   every parameter (an FP16 master with an E4M3 gradient; an FP32 vector with an FP32 gradient, both
   with an E4M3 first and an FP16 second moment) one loop does it all in registers, 16 elements at
   a time, with the same operations in the same order. (An AVX2 version of it, 8 wide, measured
   slower than the block path's auto-vectorized loops.) */
#if defined(__AVX512F__) && defined(__AVX2__)
#define FUSED_STEP(NAME, LOAD_W, LOAD_G, STORE_W)                                                     \
    static int64_t NAME(const Step *st, int64_t t, int64_t start, int64_t len) {                      \
        void *const *p = st->ptrs + 4 * t;                                                            \
        void *const pw = p[0], *const pg = p[1], *const pm = p[2], *const pv = p[3];                  \
        const float *sc = st->scales + 4 * t, *hp = st->hp + 8 * t, *new_sc = st->new_scales + 3 * t; \
        const __m512 inv_w = _mm512_set1_ps(1.0f / sc[0]), inv_g = _mm512_set1_ps(1.0f / sc[1]);      \
        const __m512 inv_m = _mm512_set1_ps(1.0f / sc[2]), inv_v = _mm512_set1_ps(1.0f / sc[3]);      \
        const __m512 beta2 = _mm512_set1_ps(hp[2]), eps = _mm512_set1_ps(hp[3]);                      \
        const __m512 decay = _mm512_set1_ps(hp[4]), l2 = _mm512_set1_ps(hp[5]);                       \
        const __m512 one_minus_beta1 = _mm512_set1_ps(1.0f - hp[1]);                                  \
        const __m512 one_minus_beta2 = _mm512_set1_ps(1.0f - hp[2]);                                  \
        const __m512 inv_bc2 = _mm512_set1_ps(1.0f / hp[7]), step_size = _mm512_set1_ps(hp[0] / hp[6]); \
        const __m512 sw = _mm512_set1_ps(new_sc[0]), sm = _mm512_set1_ps(new_sc[1]);                  \
        const __m512 sv = _mm512_set1_ps(new_sc[2]), v_zero = _mm512_set1_ps(underflow_threshold(F16)); \
        const __m512 max_w = _mm512_set1_ps(format_max(st->dtypes[4 * t]));                           \
        const __m512 max_m = _mm512_set1_ps(format_max(E4M3)), max_v = _mm512_set1_ps(format_max(F16));  \
        __m512i aw = _mm512_setzero_si512(), am = aw, av = aw;                                        \
        int64_t end = start + len / 16 * 16;                                                          \
        for (int64_t i = start; i < end; i += 16) {                                                   \
            __m512 w = _mm512_mul_ps(LOAD_W(pw, i), inv_w);                                           \
            __m512 g = _mm512_mul_ps(LOAD_G(pg, i), inv_g);                                           \
            __m512 m = _mm512_mul_ps(load_e4m3(pm, i), inv_m);                                        \
            __m512 v = _mm512_mul_ps(load_f16(pv, i), inv_v);                                         \
            g = _mm512_add_ps(g, _mm512_mul_ps(l2, w));                                               \
            w = _mm512_mul_ps(w, decay);                                                              \
            m = _mm512_add_ps(m, _mm512_mul_ps(one_minus_beta1, _mm512_sub_ps(g, m)));                \
            v = _mm512_add_ps(_mm512_mul_ps(v, beta2), _mm512_mul_ps(_mm512_mul_ps(one_minus_beta2, g), g)); \
            __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), inv_bc2), eps);             \
            w = _mm512_sub_ps(w, _mm512_mul_ps(step_size, _mm512_div_ps(m, denom)));                  \
            __m512 vs = _mm512_mul_ps(v, sv);                                                         \
            m = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(vs, v_zero, _CMP_NLE_UQ), m);                  \
            w = clamp16(_mm512_mul_ps(w, sw), max_w);                                                 \
            m = clamp16(_mm512_mul_ps(m, sm), max_m);                                                 \
            v = clamp16(vs, max_v);                                                                   \
            aw = magnitude_max16(aw, w), am = magnitude_max16(am, m), av = magnitude_max16(av, v);    \
            STORE_W(pw, i, w);                                                                        \
            store_e4m3(pm, i, m);                                                                     \
            store_f16(pv, i, v);                                                                      \
        }                                                                                             \
        uint32_t *amax = st->amax + 3 * t;                                                            \
        uint32_t mx[3] = {_mm512_reduce_max_epu32(aw), _mm512_reduce_max_epu32(am), _mm512_reduce_max_epu32(av)}; \
        for (int k = 0; k < 3; k++) amax[k] = mx[k] > amax[k] ? mx[k] : amax[k];                      \
        return end - start;                                                                           \
    }

FUSED_STEP(fused_f16_master, load_f16, load_e4m3, store_f16)
FUSED_STEP(fused_f32_vector, load_f32, load_f32, store_f32)
#endif

/* Elements of the block done by a fused loop (a multiple of 16; the rest goes through the block path). */
static int64_t fused_part(const Step *st, int64_t t, int64_t start, int64_t len) {
#if defined(__AVX512F__) && defined(__AVX2__)
    const int32_t *dt = st->dtypes + 4 * t;
    if (st->write && dt[2] == E4M3 && dt[3] == F16) {
        if (dt[0] == F16 && dt[1] == E4M3) return fused_f16_master(st, t, start, len);
        if (dt[0] == F32 && dt[1] == F32) return fused_f32_vector(st, t, start, len);
    }
#endif
    (void)st, (void)t, (void)start, (void)len;
    return 0;
}

/* The calling thread's share of the concatenated elements of all tensors, cut at multiples of
   BLOCK; `fn` is called per block (tensor, start, length) within one tensor. */
typedef void (*BlockFn)(const void *ctx, int64_t t, int64_t start, int64_t len);

static void for_each_block(int64_t n_tensors, const int64_t *numels, int64_t total, const void *ctx, BlockFn fn) {
    int64_t lo, hi, offset = 0;
    thread_range(total, &lo, &hi);
    for (int64_t t = 0; t < n_tensors && offset < hi; offset += numels[t], t++) {
        int64_t a = lo > offset ? lo - offset : 0;
        int64_t b = hi - offset < numels[t] ? hi - offset : numels[t];
        for (int64_t s = a; s < b; s += BLOCK) fn(ctx, t, s, b - s < BLOCK ? b - s : BLOCK);
    }
}

static void update_fn(const void *ctx, int64_t t, int64_t start, int64_t len) {
    int64_t done = fused_part(ctx, t, start, len);
    if (done < len) update_block(ctx, t, start + done, len - done);
}

/* write == 0: amax_out[n][3] = amaxes of the new w, m, v (NaN where one is NaN), nothing stored.
   write == 1: the new w, m, v stored; amax_out[n][3] = the amaxes of the stored payloads (what
   `stored_amax` would return for them next step).
   Returns 0, or -1 (nothing done) when the work buffers cannot be allocated. */
int adam_step(int64_t n_tensors, void *const *ptrs, const int32_t *dtypes, const int64_t *numels,
              const float *scales, const float *new_scales, const float *hp, int write, float *amax_out,
              int n_threads) {
    int64_t total = 0;
    for (int64_t t = 0; t < n_tensors; t++) total += numels[t];
    n_threads = threads_for(total, n_threads);
    size_t per = (size_t)n_tensors * 3;
    uint32_t *amax = calloc(per * n_threads, sizeof(uint32_t));
    if (!amax) return -1;
    int used = 1;
#pragma omp parallel num_threads(n_threads)
    {
        int i = omp_get_thread_num();
        Step st = {ptrs, dtypes, scales, new_scales, hp, write, amax + per * i};
        for_each_block(n_tensors, numels, total, &st, update_fn);
        if (i == 0) used = omp_get_num_threads();
    }
    const int out[3] = {0, 2, 3};
    for (size_t j = 0; j < per; j++) {
        uint32_t mx = 0;
        for (int i = 0; i < used; i++) mx = amax[per * i + j] > mx ? amax[per * i + j] : mx;
        float y = f32_of(mx); /* NaN where one was NaN */
        amax_out[j] = write && y == y ? stored_amax_of(dtypes[4 * (j / 3) + out[j % 3]], y) : y;
    }
    free(amax);
    return 0;
}

/* -- stored amaxes --------------------------------------------------------------------------- */

typedef struct {
    void *const *ptrs;
    const int32_t *dtypes;
    uint32_t *codes; /* [n] this thread's largest magnitude codes */
} Amax;

static void amax_fn(const void *ctx, int64_t t, int64_t start, int64_t len) {
    const Amax *am = ctx;
    int d = am->dtypes[t];
    uint32_t code = max_magnitude_code(d, (const char *)am->ptrs[t] + start * itemsize(d), len);
    am->codes[t] = code > am->codes[t] ? code : am->codes[t];
}

/* out[t] = max |x| of tensor t as float32 (NaN or inf where one is held). Returns 0, or -1. */
int stored_amax(int64_t n_tensors, void *const *ptrs, const int32_t *dtypes, const int64_t *numels, float *out,
                int n_threads) {
    int64_t total = 0;
    for (int64_t t = 0; t < n_tensors; t++) total += numels[t];
    n_threads = threads_for(total, n_threads);
    uint32_t *codes = calloc((size_t)n_tensors * n_threads, sizeof(uint32_t));
    if (!codes) return -1;
    int used = 1;
#pragma omp parallel num_threads(n_threads)
    {
        int i = omp_get_thread_num();
        Amax am = {ptrs, dtypes, codes + (size_t)n_tensors * i};
        for_each_block(n_tensors, numels, total, &am, amax_fn);
        if (i == 0) used = omp_get_num_threads();
    }
    for (int64_t t = 0; t < n_tensors; t++) {
        uint32_t mx = 0;
        for (int i = 0; i < used; i++) mx = codes[(size_t)n_tensors * i + t] > mx ? codes[(size_t)n_tensors * i + t] : mx;
        out[t] = amax_of_code(dtypes[t], mx);
    }
    free(codes);
    return 0;
}
