/* Group-scaled casts for CPUs: one scale per group of `group` consecutive elements.

   The FP8-saved activations (fp8lm/nn/saved.py) keep each token's features in E4M3 with one
   power-of-two scale per group of columns. Its torch expression takes six passes over the data
   (amax, multiply, clamp, and torch's element-at-a-time FP8 conversion on CPUs); these kernels take
   one pass each, with the results of that expression bit for bit (tests/test_native_groups.py):

   group_amax:   amax[g] = max |src| over group g (NaN where the group holds one; inf where it
                 holds an inf and no NaN), exact: an integer max of the magnitude bits.
   group_cast:   dst = round-to-nearest-even(clamp(src * scale[g], +-max of dst's format)); NaN
                 stays NaN (a group holding inf or NaN has a NaN scale from its caller).
   group_upcast: dst = src * (1 / scale[g]) in dst's dtype, exactly (FP8 values times a power of two).

   The scales themselves (a power of two per amax) are computed by the caller in torch, so they are
   the torch path's to the bit. Built with cast.c and adam.c; see fp8lm/ops/native.py. */

#include "codec.h"

/* Work is cut into chunks of whole groups, at most BLOCK elements long where a group is shorter
   than that (one group otherwise), so that each loop runs over many elements whatever the group
   size: a loop per group of 32 would cost more in overhead than in work. */
static inline int64_t groups_per_chunk(int64_t group) { return group >= BLOCK ? 1 : BLOCK / group; }

static inline uint32_t magnitude_max(const float *x, int64_t n, uint32_t mx) {
    /* magnitude bits order like the values, NaN above inf: an integer max that vectorizes */
    const uint32_t *bits = (const uint32_t *)x;
    for (int64_t k = 0; k < n; k++) {
        uint32_t a = bits[k] & 0x7FFFFFFFu;
        mx = a > mx ? a : mx;
    }
    return mx;
}

int group_amax(const void *src, int src_dtype, int64_t n_groups, int64_t group, float *amax, int n_threads) {
    n_threads = threads_for(n_groups * group, n_threads);
    const int in_size = itemsize(src_dtype);
    const int64_t per = groups_per_chunk(group), chunks = (n_groups + per - 1) / per;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        float buf[BLOCK];
        int64_t g0 = c * per, g1 = g0 + per < n_groups ? g0 + per : n_groups;
        if (group <= BLOCK) {
            decode(src_dtype, (const char *)src + g0 * group * in_size, buf, (g1 - g0) * group);
            for (int64_t g = g0; g < g1; g++) {
                uint32_t mx = magnitude_max(buf + (g - g0) * group, group, 0);
                amax[g] = mx > 0x7F800000u ? NAN : f32_of(mx);
            }
            continue;
        }
        uint32_t mx = 0;
        for (int64_t s = 0; s < group; s += BLOCK) {
            int64_t n = group - s < BLOCK ? group - s : BLOCK;
            decode(src_dtype, (const char *)src + (g0 * group + s) * in_size, buf, n);
            mx = magnitude_max(buf, n, mx);
        }
        amax[g0] = mx > 0x7F800000u ? NAN : f32_of(mx);
    }
    return 0;
}

static inline void scale_by(float *x, int64_t n, float factor) {
    for (int64_t i = 0; i < n; i++) x[i] *= factor;
}

/* dst = the encoding of (decoded src) * factor[g] for every group g, clamped to +-fmax (inf -> NaN)
   when `clamp` (a cast); factor[g] = scales[g] (cast) or 1 / scales[g] (upcast). */
static void group_scaled(const void *src, int src_dtype, int64_t n_groups, int64_t group, const float *scales,
                         int invert, void *dst, int dst_dtype, int clamp, int n_threads) {
    n_threads = threads_for(n_groups * group, n_threads);
    const float fmax = format_max(dst_dtype);
    const int in_size = itemsize(src_dtype), out_size = itemsize(dst_dtype);
    const int64_t per = groups_per_chunk(group), chunks = (n_groups + per - 1) / per;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        float buf[BLOCK];
        int64_t g0 = c * per, g1 = g0 + per < n_groups ? g0 + per : n_groups;
        int64_t piece = group < BLOCK ? group : BLOCK; /* elements per piece: one group or one block */
        int64_t end = group <= BLOCK ? (g1 - g0) * group : group;
        for (int64_t s = 0; s < end; s += (group <= BLOCK ? end : BLOCK)) {
            int64_t n = group <= BLOCK ? end : (end - s < BLOCK ? end - s : BLOCK), at = g0 * group + s;
            decode(src_dtype, (const char *)src + at * in_size, buf, n);
            for (int64_t k = 0; k < n; k += piece) {
                int64_t g = (at + k) / group, m = n - k < piece ? n - k : piece;
                float factor = invert ? 1.0f / scales[g] : scales[g];
                if (clamp)
                    scale_clamp(buf + k, m, factor, fmax);
                else
                    scale_by(buf + k, m, factor);
            }
            encode(dst_dtype, buf, (char *)dst + at * out_size, n);
        }
    }
}

int group_cast(const void *src, int src_dtype, int64_t n_groups, int64_t group, const float *scales, void *dst,
               int dst_dtype, int n_threads) {
    group_scaled(src, src_dtype, n_groups, group, scales, 0, dst, dst_dtype, 1, n_threads);
    return 0;
}

int group_upcast(const void *src, int src_dtype, int64_t n_groups, int64_t group, const float *scales, void *dst,
                 int dst_dtype, int n_threads) {
    group_scaled(src, src_dtype, n_groups, group, scales, 1, dst, dst_dtype, 0, n_threads);
    return 0;
}
