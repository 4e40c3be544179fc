#include "dot.h"

#include <math.h>

#include "simd.h"

/* One block of 32: codes, d and d * sum of codes.  The AVX2 version below
 * gives the same bits (the same products, and conversion rounds to nearest
 * even as lrintf does), laid out for the SIMD kernels. */
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
/* The SIMD layout (dot.h): block b's codes as four runs of eight, elements
 * 2j, 2j+16, 2j+1 and 2j+17 for j < 8, run r of block g of a group of
 * `group` blocks at r*8*group + 8g from the group's start. */
WSIMD_TARGET static void quantize_block_avx2(const float *x, int16_t *q, size_t g, size_t group,
                                             float *d_out, float *sum_out) {
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
    /* as 32-bit lanes, lane j of lo holds elements 2j (low half) and 2j+1 */
    __m256i even = _mm256_packs_epi32(_mm256_srai_epi32(_mm256_slli_epi32(lo, 16), 16),
                                      _mm256_srai_epi32(_mm256_slli_epi32(hi, 16), 16));
    __m256i odd = _mm256_packs_epi32(_mm256_srai_epi32(lo, 16), _mm256_srai_epi32(hi, 16));
    even = _mm256_permute4x64_epi64(even, 0xD8); /* 2j | 2j + 16 */
    odd = _mm256_permute4x64_epi64(odd, 0xD8);   /* 2j + 1 | 2j + 17 */
    __m128i *runs[4] = {(__m128i *)(void *)(q + 8 * g), (__m128i *)(void *)(q + 8 * group + 8 * g),
                        (__m128i *)(void *)(q + 16 * group + 8 * g),
                        (__m128i *)(void *)(q + 24 * group + 8 * g)};
    _mm_storeu_si128(runs[0], _mm256_castsi256_si128(even));
    _mm_storeu_si128(runs[1], _mm256_extracti128_si256(even, 1));
    _mm_storeu_si128(runs[2], _mm256_castsi256_si128(odd));
    _mm_storeu_si128(runs[3], _mm256_extracti128_si256(odd, 1));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    *d_out = d;
    *sum_out = d * (float)_mm_cvtsi128_si32(s);
}
#endif

void wdot_quantize(const float *x, size_t n, size_t cols, wqvec *out) {
    size_t blocks = cols / 32;
    out->cols = cols;
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) {
        const size_t width = 2; /* blocks per group */
        for (size_t t = 0; t < n; t++)
            for (size_t b = 0; b < blocks; b++) {
                size_t pair = b / width * width;
                size_t group = blocks - pair < width ? blocks - pair : width;
                quantize_block_avx2(x + t * cols + 32 * b, out->q + t * cols + 32 * pair, b - pair,
                                    group, &out->d[t * blocks + b], &out->sum[t * blocks + b]);
            }
        return;
    }
#endif
    for (size_t t = 0; t < n; t++)
        for (size_t b = 0; b < blocks; b++)
            quantize_block(x + t * cols + 32 * b, out->q + t * cols + 32 * b, &out->d[t * blocks + b],
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
/* The AVX2 copy: vpmaddwd pairs 16-bit codes into 32-bit lanes without
 * overflow (|w| <= 128, |q| <= 32767). */
#define KERNEL(name) name##_avx2
#define KTARGET WSIMD_TARGET
#define DOT4(w0, w1, w2, w3, q0, q1, q2, q3)                                                  \
    _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(w0, q0), _mm256_madd_epi16(w1, q1)), \
                     _mm256_add_epi32(_mm256_madd_epi16(w2, q2), _mm256_madd_epi16(w3, q3)))
#include "dot_kernel.h"
#undef KERNEL
#undef KTARGET
#undef DOT4

/* The AVX-512 copy: the same, with VNNI's multiply-accumulate (vpdpwssd) on
 * 256-bit vectors, the same exact sums in fewer instructions.  (A copy on
 * 512-bit vectors, four blocks a load, was slower on this project's AMD
 * EPYC, whose 512-bit operations take two passes through 256-bit units.) */
#define KERNEL(name) name##_avx512
#define KTARGET WSIMD_TARGET_512
#define DOT4(w0, w1, w2, w3, q0, q1, q2, q3)                                                   \
    _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_madd_epi16(w0, q0), w1, q1), \
                                            w2, q2),                                          \
                        w3, q3)
#include "dot_kernel.h"
#undef KERNEL
#undef KTARGET
#undef DOT4


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
    switch (wsimd_level()) {
    case WSIMD_AVX512: q4_1_avx512(nibbles, scale, min, x, first, n, out, out_stride); return;
    case WSIMD_AVX2: q4_1_avx2(nibbles, scale, min, x, first, n, out, out_stride); return;
    }
#endif
    for (size_t t = 0; t < n; t++) out[t * out_stride] = q4_1_plain(nibbles, scale, min, x, first + t);
}

void wdot_q8(const int8_t *codes, const float *scale, const wqvec *x, size_t first, size_t n,
             float *out, size_t out_stride) {
#ifdef WSIMD_AVX2
    switch (wsimd_level()) {
    case WSIMD_AVX512: q8_avx512(codes, scale, x, first, n, out, out_stride); return;
    case WSIMD_AVX2: q8_avx2(codes, scale, x, first, n, out, out_stride); return;
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

void wdot_rows(int q4_1, const uint8_t *data, const float *scale, const float *min, size_t rows,
               const wqvec *x, size_t token, float *out) {
#ifdef WSIMD_AVX2
    switch (wsimd_level()) {
    case WSIMD_AVX512: rows_avx512(q4_1, data, scale, min, rows, x, token, out); return;
    case WSIMD_AVX2: rows_avx2(q4_1, data, scale, min, rows, x, token, out); return;
    }
#endif
    size_t blocks = x->cols / 32;
    for (size_t r = 0; r < rows; r++)
        out[r] = q4_1 ? q4_1_plain(data + r * blocks * 16, scale + r * blocks, min + r * blocks, x, token)
                      : q8_plain((const int8_t *)data + r * blocks * 32, scale + r * blocks, x, token);
}
