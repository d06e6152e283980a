/* Saturating scaled casts and exact upcasts between float formats, for CPUs.

   fp8_cast: dst = round-to-nearest-even(clamp(src * scale, +-max of dst's format)), with the exact
   amax of src taken in the same pass: what fp8lm.ops.cast.saturating_cast_with_amax computes, one
   read of src and no temporaries (torch's eager path makes four passes; inductor's code converts
   FP8 one element at a time on CPUs without AVX-512 FP8 support and costs ~40 us of guards a call).
   fp8_upcast: dst = src * scale_inv, exactly (every FP8 value is a BF16 value).

   Built on first use by fp8lm/ops/native.py with the system C compiler; see that module. */

#include "codec.h"

enum { MAX_THREADS = 256 };

static void block_range(int64_t n, int64_t *lo, int64_t *hi) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    int i = omp_get_thread_num(), nt = omp_get_num_threads();
    *lo = blocks * i / nt * BLOCK;
    *hi = blocks * (i + 1) / nt * BLOCK;
    if (*hi > n) *hi = n;
}

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
        block_range(n, &lo, &hi);
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
        block_range(n, &lo, &hi);
        for (int64_t s = lo; s < hi; s += BLOCK) {
            int64_t len = hi - s < BLOCK ? hi - s : BLOCK;
            decode(src_dtype, (const char *)src + s * in_size, buf, len);
            for (int64_t k = 0; k < len; k++) buf[k] *= scale_inv;
            encode(dst_dtype, buf, (char *)dst + s * out_size, len);
        }
    }
    return 0;
}
