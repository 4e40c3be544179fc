#include "dot.h"

#include <math.h>

#include "simd.h"

void wdot_quantize(const float *x, size_t n, size_t cols, wqvec *out) {
    size_t blocks = cols / 32;
    out->cols = cols;
    for (size_t t = 0; t < n; t++)
        for (size_t b = 0; b < blocks; b++) {
            const float *xb = x + t * cols + 32 * b;
            int16_t *q = out->q + t * cols + 32 * b;
            float peak = 0.0f;
            for (size_t j = 0; j < 32; j++) peak = fmaxf(peak, fabsf(xb[j]));
            float d = peak / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (size_t j = 0; j < 32; j++) {
                q[j] = (int16_t)lrintf(xb[j] * inv);
                sum += q[j];
            }
            out->d[t * blocks + b] = d;
            out->sum[t * blocks + b] = d * (float)sum;
        }
}

/* ------------------------------------------------------------ plain C */

/* Integer products are exact, so how a block's sum is formed does not
 * matter; the float steps after it are what differ from the AVX2 path. */
static int32_t q4_1_block(const uint8_t *nib, const int16_t *q) {
    int32_t dot = 0;
    for (int k = 0; k < 16; k++) dot += (nib[k] & 15) * q[k] + (nib[k] >> 4) * q[k + 16];
    return dot;
}

static int32_t q8_block(const int8_t *w, const int16_t *q) {
    int32_t dot = 0;
    for (int k = 0; k < 32; k++) dot += w[k] * q[k];
    return dot;
}

/* One row and one token. */
static float q4_1_plain(const uint8_t *nib, const float *scale, const float *min, const wqvec *x,
                        size_t token) {
    float sum = 0.0f;
    size_t blocks = x->cols / 32;
    const int16_t *q = x->q + token * x->cols;
    const float *d = x->d + token * blocks, *xs = x->sum + token * blocks;
    for (size_t b = 0; b < blocks; b++)
        sum += scale[b] * d[b] * (float)q4_1_block(nib + 16 * b, q + 32 * b) + min[b] * xs[b];
    return sum;
}

static float q8_plain(const int8_t *codes, const float *scale, const wqvec *x, size_t token) {
    float sum = 0.0f;
    size_t blocks = x->cols / 32;
    const int16_t *q = x->q + token * x->cols;
    const float *d = x->d + token * blocks;
    for (size_t b = 0; b < blocks; b++)
        sum += scale[b] * d[b] * (float)q8_block(codes + 32 * b, q + 32 * b);
    return sum;
}

static void f32_plain(const float *row, const float *x, size_t cols, size_t n, float *out,
                      size_t out_stride) {
    for (size_t t = 0; t < n; t++) {
        float sum = 0.0f;
        for (size_t c = 0; c < cols; c++) sum += row[c] * x[t * cols + c];
        out[t * out_stride] = sum;
    }
}

/* ---------------------------------------------------------------- AVX2 */

#ifdef WSIMD_AVX2
/* Eight blocks at a time: each block's 32 products become one exact int32
 * (vpmaddwd pairs 16-bit codes into 32-bit lanes without overflow, as
 * |w| <= 128 and |q| <= 32767), then the eight block sums are scaled and
 * accumulated as one vector.  A last group of fewer than eight blocks has
 * its missing lanes zeroed (masked loads never touch memory past the row). */
WSIMD_TARGET static __m256i madd_block(__m256i lo, __m256i hi, const int16_t *q) {
    const __m256i *v = (const __m256i *)(const void *)q;
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(v)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256(v + 1)));
}

/* Lanes [0, count) of eight. */
WSIMD_TARGET static __m256i first_lanes(size_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* dots[t][i] = the int32 lanes of block b+i's products for token first+t,
 * i < count; zeros for the lanes of a short last group.  row: q4_1 nibbles
 * (16 bytes a block) or q8 codes (32 bytes a block). */
WSIMD_TARGET static inline void group_products(int q4_1, const uint8_t *row, const wqvec *x,
                                               size_t first, size_t n, size_t b, size_t count,
                                               __m256i dots[][8]) {
    const __m128i low4 = _mm_set1_epi8(15);
    for (size_t i = 0; i < 8; i++) {
        if (i == count) {
            for (size_t t = 0; t < n; t++)
                for (size_t k = i; k < 8; k++) dots[t][k] = _mm256_setzero_si256();
            return;
        }
        __m256i lo, hi;
        if (q4_1) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)(row + 16 * (b + i)));
            lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
            hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        } else {
            __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)(row + 32 * (b + i)));
            lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
            hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
        }
        for (size_t t = 0; t < n; t++)
            dots[t][i] = madd_block(lo, hi, x->q + (first + t) * x->cols + 32 * (b + i));
    }
}

WSIMD_TARGET static void q4_1_avx2(const uint8_t *nib, const float *scale, const float *min,
                                   const wqvec *x, size_t first, size_t n, float *out,
                                   size_t out_stride) {
    size_t blocks = x->cols / 32;
    __m256 acc[WDOT_TOKENS], off[WDOT_TOKENS];
    __m256i dots[WDOT_TOKENS][8];
    for (size_t t = 0; t < n; t++) acc[t] = off[t] = _mm256_setzero_ps();
    for (size_t b = 0; b < blocks; b += 8) {
        size_t count = blocks - b < 8 ? blocks - b : 8;
        __m256i lanes = first_lanes(count);
        group_products(1, nib, x, first, n, b, count, dots);
        __m256 s = _mm256_maskload_ps(scale + b, lanes), mn = _mm256_maskload_ps(min + b, lanes);
        for (size_t t = 0; t < n; t++) {
            const float *d = x->d + (first + t) * blocks + b, *xs = x->sum + (first + t) * blocks + b;
            __m256 sums = _mm256_cvtepi32_ps(wsimd_hsum8_epi32(dots[t]));
            acc[t] = _mm256_fmadd_ps(sums, _mm256_mul_ps(s, _mm256_maskload_ps(d, lanes)), acc[t]);
            off[t] = _mm256_fmadd_ps(mn, _mm256_maskload_ps(xs, lanes), off[t]);
        }
    }
    for (size_t t = 0; t < n; t++) out[t * out_stride] = wsimd_hsum(acc[t]) + wsimd_hsum(off[t]);
}

WSIMD_TARGET static void q8_avx2(const int8_t *codes, const float *scale, const wqvec *x,
                                 size_t first, size_t n, float *out, size_t out_stride) {
    size_t blocks = x->cols / 32;
    __m256 acc[WDOT_TOKENS];
    __m256i dots[WDOT_TOKENS][8];
    for (size_t t = 0; t < n; t++) acc[t] = _mm256_setzero_ps();
    for (size_t b = 0; b < blocks; b += 8) {
        size_t count = blocks - b < 8 ? blocks - b : 8;
        __m256i lanes = first_lanes(count);
        group_products(0, (const uint8_t *)codes, x, first, n, b, count, dots);
        __m256 s = _mm256_maskload_ps(scale + b, lanes);
        for (size_t t = 0; t < n; t++) {
            const float *d = x->d + (first + t) * blocks + b;
            __m256 sums = _mm256_cvtepi32_ps(wsimd_hsum8_epi32(dots[t]));
            acc[t] = _mm256_fmadd_ps(sums, _mm256_mul_ps(s, _mm256_maskload_ps(d, lanes)), acc[t]);
        }
    }
    for (size_t t = 0; t < n; t++) out[t * out_stride] = wsimd_hsum(acc[t]);
}

WSIMD_TARGET static void f32_avx2(const float *row, const float *x, size_t cols, size_t n,
                                  float *out, size_t out_stride) {
    __m256 acc[WDOT_TOKENS];
    size_t c = 0;
    for (size_t t = 0; t < n; t++) acc[t] = _mm256_setzero_ps();
    for (; c + 8 <= cols; c += 8) {
        __m256 w = _mm256_loadu_ps(row + c);
        for (size_t t = 0; t < n; t++)
            acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * cols + c), acc[t]);
    }
    for (size_t t = 0; t < n; t++) {
        float sum = wsimd_hsum(acc[t]);
        for (size_t k = c; k < cols; k++) sum += row[k] * x[t * cols + k];
        out[t * out_stride] = sum;
    }
}
#endif

void wdot_q4_1(const uint8_t *nibbles, const float *scale, const float *min, const wqvec *x,
               size_t first, size_t n, float *out, size_t out_stride) {
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) {
        q4_1_avx2(nibbles, scale, min, x, first, n, out, out_stride);
        return;
    }
#endif
    for (size_t t = 0; t < n; t++) out[t * out_stride] = q4_1_plain(nibbles, scale, min, x, first + t);
}

void wdot_q8(const int8_t *codes, const float *scale, const wqvec *x, size_t first, size_t n,
             float *out, size_t out_stride) {
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) {
        q8_avx2(codes, scale, x, first, n, out, out_stride);
        return;
    }
#endif
    for (size_t t = 0; t < n; t++) out[t * out_stride] = q8_plain(codes, scale, x, first + t);
}

void wdot_f32(const float *row, const float *x, size_t cols, size_t n, float *out,
              size_t out_stride) {
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) {
        f32_avx2(row, x, cols, n, out, out_stride);
        return;
    }
#endif
    f32_plain(row, x, cols, n, out, out_stride);
}
