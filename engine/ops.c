#include "ops.h"

#include <math.h>

#include "half.h"
#include "simd.h"

void wops_rmsnorm(float *out, const float *x, const float *weight, size_t n, float eps) {
    float ss = 0.0f;
    for (size_t i = 0; i < n; i++) ss += x[i] * x[i];
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (size_t i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

typedef struct {
    float *out;
    const float *w, *x;
    size_t cols;
} matvec_job;

static void matvec_rows(void *arg, size_t begin, size_t end) {
    const matvec_job *j = arg;
    for (size_t r = begin; r < end; r++) {
        const float *row = j->w + r * j->cols;
        float sum = 0.0f;
        for (size_t c = 0; c < j->cols; c++) sum += row[c] * j->x[c];
        j->out[r] = sum;
    }
}

void wops_matvec(wpool *pool, float *out, const float *w, const float *x, size_t rows,
                 size_t cols) {
    matvec_job j = {.out = out, .w = w, .x = x, .cols = cols};
    wpool_run(pool, rows, rows * cols, matvec_rows, &j);
}

void wops_softmax(float *x, size_t n) {
    float max = x[0];
    for (size_t i = 1; i < n; i++)
        if (x[i] > max) max = x[i];
    float sum = 0.0f;
    for (size_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    for (size_t i = 0; i < n; i++) x[i] /= sum;
}

void wops_rope_angles(float *cos_sin, size_t head_dim, uint32_t pos, float theta) {
    for (size_t i = 0; i < head_dim / 2; i++) {
        float freq = powf(theta, -(float)(2 * i) / (float)head_dim);
        float angle = (float)pos * freq;
        cos_sin[2 * i] = cosf(angle);
        cos_sin[2 * i + 1] = sinf(angle);
    }
}

void wops_rope(float *v, size_t n_heads, size_t head_dim, const float *cos_sin) {
    for (size_t h = 0; h < n_heads; h++)
        for (size_t i = 0; i < head_dim / 2; i++) {
            float *pair = v + h * head_dim + 2 * i, c = cos_sin[2 * i], s = cos_sin[2 * i + 1];
            float a = pair[0], b = pair[1];
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
}

#ifdef WSIMD_AVX2
WSIMD_TARGET static size_t swiglu_avx2(float *a, const float *b, size_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(a + i);
        __m256 e = wsimd_exp(_mm256_sub_ps(_mm256_setzero_ps(), x));
        __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(silu, _mm256_loadu_ps(b + i)));
    }
    return i;
}
#endif

void wops_swiglu(float *a, const float *b, size_t n) {
    size_t i = 0;
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) i = swiglu_avx2(a, b, n);
#endif
    for (; i < n; i++) a[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
}

#ifdef WSIMD_AVX2
WSIMD_TARGET static size_t to_half_avx2(uint16_t *out, const float *x, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}

WSIMD_TARGET static size_t to_float_avx2(float *out, const uint16_t *h, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    return i;
}
#endif

void wops_to_half(uint16_t *out, const float *x, size_t n) {
    size_t i = 0;
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) i = to_half_avx2(out, x, n);
#endif
    for (; i < n; i++) out[i] = whalf_from_float(x[i]);
}

void wops_to_float(float *out, const uint16_t *h, size_t n) {
    size_t i = 0;
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) i = to_float_avx2(out, h, n);
#endif
    for (; i < n; i++) out[i] = whalf_to_float(h[i]);
}
