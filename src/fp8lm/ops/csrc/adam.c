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

/* A decaying first moment must not stall (see fused.py's `no_stall`): where the old value was
   subnormal and the new one (scaled, about to be rounded) is smaller in magnitude but rounds to a
   magnitude at least as large, it takes the next representable value toward zero instead. */
static void no_stall(int dtype, float *m, const float *m_old, float scale, int64_t len) {
    const float min_normal = format_min_normal(dtype);
    uint16_t codes[BLOCK];
    float rounded[BLOCK];
    encode(dtype, m, codes, len);
    decode(dtype, codes, rounded, len);
    for (int64_t i = 0; i < len; i++) {
        float old = fabsf(m_old[i] * scale);
        if (old < min_normal && fabsf(m[i]) < old && fabsf(rounded[i]) >= old && rounded[i] != 0.0f) {
            uint16_t code = 0;
            encode(dtype, &m[i], &code, 1);
            code -= 1; /* sign-magnitude: one code toward zero */
            m[i] = decode_one(dtype, &code);
        }
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
    float w[BLOCK], g[BLOCK], m[BLOCK], v[BLOCK], m_old[BLOCK];
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
        m_old[i] = mi;
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
        if (dt[2] != F32) no_stall(dt[2], m, m_old, new_sc[1], len);
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

static void update_fn(const void *ctx, int64_t t, int64_t start, int64_t len) { update_block(ctx, t, start, len); }

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
