#include "sample.h"

#include <math.h>
#include <stdlib.h>

#include "simd.h"

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void wrng_seed(wrng *rng, uint64_t seed) {
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_u64(wrng *rng) {
    uint64_t *s = rng->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double wrng_uniform(wrng *rng) { return (double)(next_u64(rng) >> 11) * 0x1.0p-53; }

typedef struct {
    double p;
    int32_t id;
} candidate;

uint64_t wsample_scratch_bytes(uint32_t n) { return (uint64_t)n * sizeof(candidate); }

static int by_probability(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

#ifdef WSIMD_AVX2
/* The largest of x[0..n), eight lanes at a time (the same value as a scan). */
WSIMD_TARGET static float max_avx2(const float *x, uint32_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(x + i));
    float max = wsimd_hmax(top);
    for (; i < n; i++) max = fmaxf(max, x[i]);
    return max;
}

/* sum of e^(x[i] - max): e^ in float eight lanes at a time (within 2 ulp of
 * expf), summed in double. */
WSIMD_TARGET static double exp_sum_avx2(const float *x, uint32_t n, float max) {
    __m256d sum = _mm256_setzero_pd();
    __m256 m = _mm256_set1_ps(max);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = wsimd_exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
        sum = _mm256_add_pd(sum, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))));
    }
    double lanes[4], total = 0.0;
    _mm256_storeu_pd(lanes, sum);
    for (int k = 0; k < 4; k++) total += lanes[k];
    for (; i < n; i++) total += exp((double)x[i] - max);
    return total;
}
#endif

/* The first index of the largest logit. */
static int32_t argmax(const float *logits, uint32_t n) {
    uint32_t i = 1;
    int32_t best = 0;
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) { /* find the value at SIMD speed, then its first index */
        float max = max_avx2(logits, n);
        while (best + 1 < (int32_t)n && logits[best] != max) best++; /* bounded should a NaN hide it */
        return best;
    }
#endif
    for (; i < n; i++)
        if (logits[i] > logits[best]) best = (int32_t)i;
    return best;
}

static float log_softmax_at(const float *logits, uint32_t n, int32_t id, float max) {
    double sum = 0.0;
#ifdef WSIMD_AVX2
    if (wsimd_avx2()) sum = exp_sum_avx2(logits, n, max);
    else
#endif
        for (uint32_t i = 0; i < n; i++) sum += exp((double)logits[i] - max);
    return (float)((double)logits[id] - max - log(sum));
}

static int32_t draw(const float *logits, uint32_t n, const waste_gen_params *p, wrng *rng,
                    candidate *c, float max) {
    for (uint32_t i = 0; i < n; i++)
        c[i] = (candidate){exp(((double)logits[i] - max) / p->temperature), (int32_t)i};
    qsort(c, n, sizeof *c, by_probability);
    size_t kept = p->top_k > 0 && (uint32_t)p->top_k < n ? (size_t)p->top_k : n;
    double mass = 0.0;
    for (size_t i = 0; i < kept; i++) mass += c[i].p;
    if (p->top_p < 1.0f) {
        double target = (double)p->top_p * mass, running = 0.0;
        size_t cut = 0;
        while (cut < kept && (running < target || cut == 0)) running += c[cut++].p;
        kept = cut;
        mass = running;
    }
    double r = wrng_uniform(rng) * mass;
    for (size_t i = 0; i < kept; i++) {
        r -= c[i].p;
        if (r < 0.0) return c[i].id;
    }
    return c[kept - 1].id; /* rounding left r a hair above zero */
}

int32_t wsample(const float *logits, uint32_t n, const waste_gen_params *p, wrng *rng,
                void *scratch, float *logprob) {
    int32_t top = argmax(logits, n);
    int32_t id = p->temperature == 0.0f ? top : draw(logits, n, p, rng, scratch, logits[top]);
    *logprob = log_softmax_at(logits, n, id, logits[top]);
    return id;
}
