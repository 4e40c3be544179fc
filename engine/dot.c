#include "dot.h"

#include <math.h>

void wdot_quantize(const float *x, size_t n, wqvec *out) {
    for (size_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float peak = 0.0f;
        for (size_t j = 0; j < 32; j++) peak = fmaxf(peak, fabsf(xb[j]));
        float d = peak / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (size_t j = 0; j < 32; j++) {
            int32_t q = (int32_t)lrintf(xb[j] * inv);
            out->q[32 * b + j] = (int16_t)q;
            sum += q;
        }
        out->d[b] = d;
        out->sum[b] = d * (float)sum;
    }
}

/* ------------------------------------------------------------ plain C */

static float q4_1_plain(const uint8_t *nib, const float *scale, const float *min, const wqvec *x,
                        size_t blocks) {
    float sum = 0.0f;
    for (size_t b = 0; b < blocks; b++) {
        const uint8_t *n = nib + 16 * b;
        const int16_t *q = x->q + 32 * b;
        int32_t dot = 0;
        for (int k = 0; k < 16; k++) dot += (n[k] & 15) * q[k] + (n[k] >> 4) * q[k + 16];
        sum += scale[b] * x->d[b] * (float)dot + min[b] * x->sum[b];
    }
    return sum;
}

static float q8_plain(const int8_t *codes, const float *scale, const wqvec *x, size_t blocks) {
    float sum = 0.0f;
    for (size_t b = 0; b < blocks; b++) {
        const int8_t *w = codes + 32 * b;
        const int16_t *q = x->q + 32 * b;
        int32_t dot = 0;
        for (int k = 0; k < 32; k++) dot += w[k] * q[k];
        sum += scale[b] * x->d[b] * (float)dot;
    }
    return sum;
}

/* ---------------------------------------------------------------- AVX2 */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <stdatomic.h>
#define HAVE_AVX2_PATH 1

/* 16-bit pairs multiply-add into 32-bit lanes (vpmaddwd): no overflow, as
 * |w| <= 128 and |q| <= 32767. */
__attribute__((target("avx2,fma"))) static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) static float q4_1_avx2(const uint8_t *nib, const float *scale,
                                                         const float *min, const wqvec *x,
                                                         size_t blocks) {
    const __m128i low4 = _mm_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    float offset = 0.0f;
    for (size_t b = 0; b < blocks; b++) {
        __m128i n = _mm_loadu_si128((const __m128i *)(const void *)(nib + 16 * b));
        __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(n, low4));
        __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(n, 4), low4));
        const __m256i *q = (const __m256i *)(const void *)(x->q + 32 * b);
        __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(q)),
                                       _mm256_madd_epi16(hi, _mm256_loadu_si256(q + 1)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[b] * x->d[b]), acc);
        offset += min[b] * x->sum[b];
    }
    return hsum(acc) + offset;
}

__attribute__((target("avx2,fma"))) static float q8_avx2(const int8_t *codes, const float *scale,
                                                       const wqvec *x, size_t blocks) {
    __m256 acc = _mm256_setzero_ps();
    for (size_t b = 0; b < blocks; b++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)(codes + 32 * b));
        __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
        __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
        const __m256i *q = (const __m256i *)(const void *)(x->q + 32 * b);
        __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(q)),
                                       _mm256_madd_epi16(hi, _mm256_loadu_si256(q + 1)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[b] * x->d[b]), acc);
    }
    return hsum(acc);
}

static int use_avx2(void) {
    static atomic_int answer = -1; /* threads that race here all store the same value */
    int known = atomic_load_explicit(&answer, memory_order_relaxed);
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        atomic_store_explicit(&answer, known, memory_order_relaxed);
    }
    return known;
}
#endif

float wdot_q4_1(const uint8_t *nibbles, const float *scale, const float *min, const wqvec *x,
                size_t blocks) {
#ifdef HAVE_AVX2_PATH
    if (use_avx2()) return q4_1_avx2(nibbles, scale, min, x, blocks);
#endif
    return q4_1_plain(nibbles, scale, min, x, blocks);
}

float wdot_q8(const int8_t *codes, const float *scale, const wqvec *x, size_t blocks) {
#ifdef HAVE_AVX2_PATH
    if (use_avx2()) return q8_avx2(codes, scale, x, blocks);
#endif
    return q8_plain(codes, scale, x, blocks);
}
