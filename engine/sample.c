#include "sample.h"

#include <math.h>
#include <stdlib.h>

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

static int32_t argmax(const float *logits, uint32_t n) {
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = (int32_t)i;
    return best;
}

static float log_softmax_at(const float *logits, uint32_t n, int32_t id) {
    float max = logits[argmax(logits, n)];
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) sum += exp((double)logits[i] - max);
    return (float)((double)logits[id] - max - log(sum));
}

static int32_t draw(const float *logits, uint32_t n, const waste_gen_params *p, wrng *rng,
                    candidate *c) {
    float max = logits[argmax(logits, n)];
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
    int32_t id = p->temperature == 0.0f ? argmax(logits, n) : draw(logits, n, p, rng, scratch);
    *logprob = log_softmax_at(logits, n, id);
    return id;
}
