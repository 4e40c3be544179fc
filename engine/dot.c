#include "dot.h"

#include <math.h>

#include "simd.h"

/* One block of 32: codes, d and d * sum of codes.  The AVX2 version below
 * gives the same bits (the same products, and conversion rounds to nearest
 * even as lrintf does). */
static void quantize_block(const float *x, int16_t *q, float *d_out, float *sum_out) {
    float peak = 0.0f;
    for (size_t j = 0; j < 32; j++) peak = fmaxf(peak, fabsf(x[j]));
    float d = peak / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (size_t j = 0; j < 32; j++) {
        q[j] = (int16_t)lrintf(x[j] * inv);
        sum += q[j];
    }
    *d_out = d;
    *sum_out = d * (float)sum;
}

#ifdef WSIMD_AVX2
WSIMD_TARGET static void quantize_block_avx2(const float *x, int16_t *q, float *d_out,
                                             float *sum_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], peak = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, v[k]));
    }
    float d = wsimd_hmax(peak) / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    __m256i codes[4], sum = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        codes[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)));
        sum = _mm256_add_epi32(sum, codes[k]);
    }
    /* packs works within 128-bit halves: put the eight 64-bit pieces back in order */
    __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[0], codes[1]), 0xD8);
    __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[2], codes[3]), 0xD8);
    _mm256_storeu_si256((__m256i *)(void *)q, lo);
    _mm256_storeu_si256((__m256i *)(void *)(q + 16), hi);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    *d_out = d;
    *sum_out = d * (float)_mm_cvtsi128_si32(s);
}
#endif

void wdot_quantize(const float *x, size_t n, size_t cols, wqvec *out) {
    size_t blocks = cols / 32;
    void (*block)(const float *, int16_t *, float *, float *) = quantize_block;
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) block = quantize_block_avx2;
#endif
    out->cols = cols;
    for (size_t t = 0; t < n; t++)
        for (size_t b = 0; b < blocks; b++)
            block(x + t * cols + 32 * b, out->q + t * cols + 32 * b, &out->d[t * blocks + b],
                  &out->sum[t * blocks + b]);
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
/* Per block of 32: the integer products in eight int32 lanes (vpmaddwd pairs
 * 16-bit codes into 32-bit lanes without overflow, as |w| <= 128 and
 * |q| <= 32767), converted and accumulated with the block's scale times the
 * activation's (as the plain path does, lane-wise).  The scale products and
 * q4_1's minimum terms are taken eight blocks at a time; a last group of
 * fewer than eight has its missing lanes masked (masked loads never touch
 * memory past the row). */
#define INLINE_AVX2 WSIMD_TARGET static inline __attribute__((always_inline))

INLINE_AVX2 __m256i madd_block(__m256i lo, __m256i hi, const int16_t *q) {
    const __m256i *v = (const __m256i *)(const void *)q;
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(v)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256(v + 1)));
}

/* Lanes [0, count) of eight. */
WSIMD_TARGET static __m256i first_lanes(size_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Block b's 32 weights as 16-bit codes: elements 0-15 in lo, 16-31 in hi.
 * row: q4_1 nibbles (16 bytes a block) or q8 codes (32 bytes a block). */
INLINE_AVX2 void decode_block(int q4_1, const uint8_t *row, size_t b, __m256i *lo,
                                             __m256i *hi) {
    if (q4_1) {
        const __m128i low4 = _mm_set1_epi8(15);
        __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)(row + 16 * b));
        *lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
        *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
    } else {
        __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)(row + 32 * b));
        *lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
        *hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
    }
}

/* acc[t] += block b's products for token first+t, times sd[t]'s lane `lane`. */
INLINE_AVX2 void add_block(int q4_1, const uint8_t *row, const wqvec *x, size_t first, size_t n,
                           size_t b, int lane, const __m256 *sd, __m256 *acc) {
    __m256i lo, hi, which = _mm256_set1_epi32(lane);
    decode_block(q4_1, row, b, &lo, &hi);
#pragma GCC unroll 4
    for (size_t t = 0; t < n; t++) {
        __m256i dot = madd_block(lo, hi, x->q + (first + t) * x->cols + 32 * b);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(sd[t], which),
                                 acc[t]);
    }
}

/* Both formats; min is NULL for q8.  Always inlined, so that the calls
 * below get a copy for each format and token count, whose accumulators
 * stay in registers.  Each token keeps two running sums (even
 * and odd blocks), so consecutive multiply-adds do not wait on each other. */
INLINE_AVX2 void blocked_avx2(int q4_1, const uint8_t *row, const float *scale, const float *min,
                              const wqvec *x, size_t first, size_t n, float *out,
                              size_t out_stride) {
    size_t blocks = x->cols / 32;
    __m256 even[WDOT_TOKENS], odd[WDOT_TOKENS], sd[WDOT_TOKENS];
#pragma GCC unroll 4
    for (size_t t = 0; t < n; t++) even[t] = odd[t] = sd[t] = _mm256_setzero_ps();
    for (size_t b = 0; b < blocks; b += 8) {
        size_t count = blocks - b < 8 ? blocks - b : 8, i = 0;
        __m256i lanes = first_lanes(count);
        __m256 s = _mm256_maskload_ps(scale + b, lanes);
#pragma GCC unroll 4
        for (size_t t = 0; t < n; t++) {
            size_t at = (first + t) * blocks + b;
            sd[t] = _mm256_mul_ps(s, _mm256_maskload_ps(x->d + at, lanes));
            if (q4_1)
                odd[t] = _mm256_fmadd_ps(_mm256_maskload_ps(min + b, lanes),
                                         _mm256_maskload_ps(x->sum + at, lanes), odd[t]);
        }
        for (; i + 2 <= count; i += 2) {
            add_block(q4_1, row, x, first, n, b + i, (int)i, sd, even);
            add_block(q4_1, row, x, first, n, b + i + 1, (int)i + 1, sd, odd);
        }
        if (i < count) add_block(q4_1, row, x, first, n, b + i, (int)i, sd, even);
    }
#pragma GCC unroll 4
    for (size_t t = 0; t < n; t++) out[t * out_stride] = wsimd_hsum(_mm256_add_ps(even[t], odd[t]));
}

/* One copy per token count, each with its sums in registers. */
WSIMD_TARGET static void q4_1_avx2(const uint8_t *nib, const float *scale, const float *min,
                                   const wqvec *x, size_t first, size_t n, float *out,
                                   size_t out_stride) {
    switch (n) {
    case 1: blocked_avx2(1, nib, scale, min, x, first, 1, out, out_stride); break;
    case 2: blocked_avx2(1, nib, scale, min, x, first, 2, out, out_stride); break;
    case 3: blocked_avx2(1, nib, scale, min, x, first, 3, out, out_stride); break;
    default: blocked_avx2(1, nib, scale, min, x, first, WDOT_TOKENS, out, out_stride);
    }
}

WSIMD_TARGET static void q8_avx2(const int8_t *codes, const float *scale, const wqvec *x,
                                 size_t first, size_t n, float *out, size_t out_stride) {
    const uint8_t *row = (const uint8_t *)codes;
    switch (n) {
    case 1: blocked_avx2(0, row, scale, NULL, x, first, 1, out, out_stride); break;
    case 2: blocked_avx2(0, row, scale, NULL, x, first, 2, out, out_stride); break;
    case 3: blocked_avx2(0, row, scale, NULL, x, first, 3, out, out_stride); break;
    default: blocked_avx2(0, row, scale, NULL, x, first, WDOT_TOKENS, out, out_stride);
    }
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
