#include "attention.h"

#include <math.h>
#include <string.h>

#include "half.h"
#include "ops.h"
#include "simd.h"

#define TILE 32         /* keys per online-softmax step */
#define QUERY_BLOCK 32  /* queries of one head that share each tile while it is in cache */
#define HEADS 8         /* query heads of one key/value head that share each tile */
#define SPAN 256        /* positions whose softmax is taken apart, then folded in order */
#define SUMS 12         /* value sums in registers at once: 16 AVX2 registers, less the
                           * value and up to three heads' weights */

typedef struct {
    const wattn_shape *shape;
    const uint16_t *keys, *values; /* f16 */
    const float *q;
    float *out;
    float *tiles; /* wattn_tile_floats per pool thread */
    uint32_t pos0;
    size_t n, n_blocks;
    size_t splits, heads; /* each key/value head's query heads in `splits` items of `heads` */
    size_t n_spans;       /* > 0: one query, an item per (key/value head, span) (span_item) */
    float *spans;         /* wattn_span_floats: each item's sums, folded after the job */
    float scale;
} job;

/* One query's running softmax: the largest score so far, the sum of
 * e^(score - max), and the value sum it weights (kept in the output row). */
typedef struct {
    float max, sum;
} running;

/* Rescale the running sums to a new, larger maximum. */
static void raise_max(running *r, float *acc, size_t hd, float max) {
    float correction = expf(r->max - max); /* 0 while nothing is summed yet */
    r->sum *= correction;
    for (size_t c = 0; c < hd; c++) acc[c] *= correction;
    r->max = max;
}

/* Add a span's sums (part, acc) to the total so far (total, sum_acc).
 * Spans are folded one after another from position 0, whether a thread
 * takes a query's spans in turn (query_block) or threads take one span each
 * (span_item), so a query's result is the same bits either way; the first
 * fold copies the span exactly (its factors are 0 and 1). */
static void fold(running *total, float *sum_acc, const running *part, const float *acc, size_t hd) {
    float max = fmaxf(total->max, part->max);
    float keep = expf(total->max - max), take = expf(part->max - max);
    total->sum = total->sum * keep + part->sum * take;
    for (size_t c = 0; c < hd; c++) sum_acc[c] = sum_acc[c] * keep + acc[c] * take;
    total->max = max;
}

/* A tile's keys and values are read either from the cache itself, as f16
 * (half = 1), or from a copy as floats (half = 0): one query reads them once
 * per head, so converting as it loads costs least, while a block of queries
 * has each tile converted once (query_block).  Both see the same numbers. */
static inline float load1(const void *p, size_t i, int half) {
    return half ? whalf_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Keys [0, count) of a tile for `heads` query heads of one key/value head
 * (k and v point at its first position; head g's query, running sums and
 * output row are q + g*hd, r[g] and acc + g*hd). */
static inline void tile_plain(const float *q, size_t heads, const void *k, const void *v,
                              size_t count, size_t hd, float scale, running *r, float *acc,
                              int half) {
    for (size_t g = 0; g < heads; g++, q += hd, acc += hd) {
        float s[TILE], top = -INFINITY;
        for (size_t j = 0; j < count; j++) {
            float dot = 0.0f;
            for (size_t c = 0; c < hd; c++) dot += q[c] * load1(k, j * hd + c, half);
            s[j] = dot * scale;
            top = fmaxf(top, s[j]);
        }
        if (top > r[g].max) raise_max(&r[g], acc, hd, top);
        for (size_t j = 0; j < count; j++) {
            float p = expf(s[j] - r[g].max);
            r[g].sum += p;
            for (size_t c = 0; c < hd; c++) acc[c] += p * load1(v, j * hd + c, half);
        }
    }
}

#ifdef WSIMD_AVX2
#define INLINE_AVX2 WSIMD_TARGET static inline __attribute__((always_inline))

/* Eight of a tile's numbers, from index i. */
INLINE_AVX2 __m256 load8(const void *p, size_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

/* Scores of eight keys from `at` for each head (head_dim a multiple of 8):
 * each key's numbers are loaded, and converted from f16, once for all the
 * heads, while every head's dot products are summed in the same order as
 * if it were alone.  Lanes at or past `count` read keys that are not the
 * query's (or not yet written) and are masked to -inf, which softmax turns
 * into exact zeros. */
INLINE_AVX2 void scores8(const float *q, size_t heads, const void *k, size_t at, size_t hd,
                         float scale, size_t count, int half, __m256 *s, size_t s_stride) {
    __m256 parts[HEADS][8];
#pragma GCC unroll 8
    for (size_t i = 0; i < 8; i++) {
        size_t ki = at + i * hd;
        __m256 key = load8(k, ki, half), a[HEADS];
#pragma GCC unroll 8
        for (size_t g = 0; g < heads; g++) a[g] = _mm256_mul_ps(_mm256_loadu_ps(q + g * hd), key);
#pragma GCC unroll 16
        for (size_t c = 8; c < hd; c += 8) {
            key = load8(k, ki + c, half);
#pragma GCC unroll 8
            for (size_t g = 0; g < heads; g++)
                a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + c), key, a[g]);
        }
#pragma GCC unroll 8
        for (size_t g = 0; g < heads; g++) parts[g][i] = a[g];
    }
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32((int)count - 1)));
#pragma GCC unroll 8
    for (size_t g = 0; g < heads; g++) {
        __m256 sg = _mm256_mul_ps(wsimd_hsum8(parts[g]), _mm256_set1_ps(scale));
        s[g * s_stride] = _mm256_blendv_ps(sg, _mm256_set1_ps(-INFINITY), past);
    }
}

/* The tile for `heads` heads, a constant in each caller so its loops unroll. */
INLINE_AVX2 void heads_tile(const float *q, size_t heads, const void *k, const void *v,
                            size_t count, size_t hd, float scale, running *r, float *acc,
                            int half) {
    __m256 s[HEADS][TILE / 8];
    size_t groups = (count + 7) / 8;
    for (size_t b = 0; b < groups; b++)
        scores8(q, heads, k, 8 * b * hd, hd, scale, count - 8 * b, half, &s[0][b], TILE / 8);
    float p[HEADS][TILE];
    for (size_t g = 0; g < heads; g++) {
        __m256 top = _mm256_set1_ps(-INFINITY);
        for (size_t b = 0; b < groups; b++) top = _mm256_max_ps(top, s[g][b]);
        float tile_max = wsimd_hmax(top);
        if (tile_max > r[g].max) raise_max(&r[g], acc + g * hd, hd, tile_max);
        __m256 max = _mm256_set1_ps(r[g].max), sum = _mm256_setzero_ps();
        for (size_t b = 0; b < groups; b++) {
            __m256 e = wsimd_exp(_mm256_sub_ps(s[g][b], max));
            sum = _mm256_add_ps(sum, e);
            _mm256_storeu_ps(p[g] + 8 * b, e);
        }
        r[g].sum += wsimd_hsum(sum);
    }
    /* Key by key over a slice of channels: each value is loaded (and
     * converted) once for all the heads, and up to SUMS independent sums
     * keep both FMA pipes busy: each sum waits on its previous FMA, and with
     * at most eight (six for three heads) the decode loop ran at the FMA's
     * latency, not its throughput (perf, docs/engine.md).  Each
     * channel's sum still takes the keys in order, so the slicing changes
     * no result. */
    const size_t slice = SUMS / heads; /* vectors per head: heads * slice <= SUMS */
    for (size_t c0 = 0; c0 < hd; c0 += 8 * slice) {
        size_t vectors = hd - c0 < 8 * slice ? (hd - c0) / 8 : slice;
        __m256 a[SUMS]; /* head g's vector u at g * slice + u */
#pragma GCC unroll 8
        for (size_t g = 0; g < heads; g++)
#pragma GCC unroll 12
            for (size_t u = 0; u < slice; u++)
                a[g * slice + u] = u < vectors ? _mm256_loadu_ps(acc + g * hd + c0 + 8 * u) : _mm256_setzero_ps();
        for (size_t j = 0; j < count; j++) {
            size_t vj = j * hd + c0;
#pragma GCC unroll 12
            for (size_t u = 0; u < slice; u++) {
                if (u >= vectors) break;
                __m256 value = load8(v, vj + 8 * u, half);
#pragma GCC unroll 8
                for (size_t g = 0; g < heads; g++)
                    a[g * slice + u] = _mm256_fmadd_ps(_mm256_set1_ps(p[g][j]), value, a[g * slice + u]);
            }
        }
#pragma GCC unroll 8
        for (size_t g = 0; g < heads; g++)
#pragma GCC unroll 12
            for (size_t u = 0; u < slice; u++)
                if (u < vectors) _mm256_storeu_ps(acc + g * hd + c0 + 8 * u, a[g * slice + u]);
    }
}

INLINE_AVX2 void tile_avx2(const float *q, size_t heads, const void *k, const void *v,
                           size_t count, size_t hd, float scale, running *r, float *acc, int half) {
    switch (heads) {
#define HEADS_CASE(n) \
    case n: heads_tile(q, n, k, v, count, hd, scale, r, acc, half); break;
        HEADS_CASE(1) HEADS_CASE(2) HEADS_CASE(3) HEADS_CASE(4)
        HEADS_CASE(5) HEADS_CASE(6) HEADS_CASE(7) HEADS_CASE(8)
#undef HEADS_CASE
    }
}
#endif

typedef void (*tile_fn)(const float *q, size_t heads, const void *k, const void *v, size_t count,
                        size_t hd, float scale, running *r, float *acc);

/* One copy per number format, and on AVX2 per common head size, whose loops
 * the compiler unrolls and whose query and sums stay in registers: the same
 * operations as the general one. */
#define TILE_COPY(name, body, hd_used, half)                                                   \
    static void name(const float *q, size_t heads, const void *k, const void *v, size_t count, \
                     size_t hd, float scale, running *r, float *acc) {                        \
        (void)hd;                                                                             \
        body(q, heads, k, v, count, hd_used, scale, r, acc, half);                            \
    }
TILE_COPY(plain_f32, tile_plain, hd, 0)
TILE_COPY(plain_f16, tile_plain, hd, 1)
#ifdef WSIMD_AVX2
#define AVX2_COPIES(half, suffix)                                     \
    WSIMD_TARGET TILE_COPY(avx2_16_##suffix, tile_avx2, 16, half)     \
    WSIMD_TARGET TILE_COPY(avx2_64_##suffix, tile_avx2, 64, half)     \
    WSIMD_TARGET TILE_COPY(avx2_128_##suffix, tile_avx2, 128, half)   \
    WSIMD_TARGET TILE_COPY(avx2_any_##suffix, tile_avx2, hd, half)
AVX2_COPIES(0, f32)
AVX2_COPIES(1, f16)
#endif

static tile_fn pick_tile(size_t hd, int half) {
#ifdef WSIMD_AVX2
    if (hd % 8 == 0 && wsimd_avx2()) {
        if (half)
            return hd == 16 ? avx2_16_f16 : hd == 64 ? avx2_64_f16 : hd == 128 ? avx2_128_f16 : avx2_any_f16;
        return hd == 16 ? avx2_16_f32 : hd == 64 ? avx2_64_f32 : hd == 128 ? avx2_128_f32 : avx2_any_f32;
    }
#endif
    (void)hd;
    return half ? plain_f16 : plain_f32;
}

/* The tiles of the span from s0 for queries [t0, t1) and `heads` query
 * heads from head0, which share keys and values: every tile of keys is taken
 * by each query and head that reaches it before the next tile is read, so a
 * tile is read from memory once per block of queries and group of heads,
 * not once per query and head.  Query t's running sums are at
 * r + (t - t0) * HEADS, its value sums at acc + (t - t0) * HEADS * hd; each
 * (query, head) sees the same tiles in the same order as it would alone. */
static void span_tiles(const job *j, const uint16_t *keys, const uint16_t *values, size_t head0,
                       size_t heads, size_t t0, size_t t1, size_t s0, running *r, float *acc) {
    size_t hd = j->shape->head_dim, width = j->shape->n_heads * hd;
    /* A block of queries takes each tile as floats, converted once for all of
     * them into this thread's scratch; one query reads the cache's f16. */
    int copied = t1 - t0 > 1;
    float *tile_k = j->tiles + (size_t)wpool_self() * wattn_tile_floats(hd);
    float *tile_v = tile_k + TILE * hd;
    tile_fn tile = pick_tile(hd, !copied);
    size_t last = j->pos0 + t1 - 1, end = s0 + SPAN <= last ? s0 + SPAN - 1 : last;
    for (size_t first = s0; first <= end; first += TILE) {
        /* The next tile's keys and values are on their way while this one is
         * worked on: one tile at a time, the loads wait on memory. */
        if (first + TILE <= last) {
            const char *next_k = (const char *)(keys + (first + TILE) * hd);
            const char *next_v = (const char *)(values + (first + TILE) * hd);
            size_t bytes = TILE * hd * sizeof(uint16_t);
            for (size_t at = 0; at < bytes; at += 64) {
                wsimd_prefetch(next_k + at);
                wsimd_prefetch(next_v + at);
            }
        }
        const void *k = keys + first * hd, *v = values + first * hd;
        if (copied) {
            /* Keys are scored eight at a time, so up to the next multiple of 8
             * (within the cache's stride, zeroed past what is written). */
            size_t used = last + 1 - first < TILE ? (last + 1 - first + 7) / 8 * 8 : TILE;
            wops_to_float(tile_k, k, used * hd);
            wops_to_float(tile_v, v, used * hd);
            k = tile_k;
            v = tile_v;
        }
        for (size_t t = t0; t < t1; t++) {
            size_t pos = j->pos0 + t;
            if (first > pos) continue;
            size_t count = pos + 1 - first < TILE ? pos + 1 - first : TILE;
            tile(j->q + t * width + head0 * hd, heads, k, v, count, hd, j->scale,
                 &r[(t - t0) * HEADS], acc + (t - t0) * HEADS * hd);
        }
    }
}

/* Queries [t0, t1) of query heads [h0, h1) of those that share key/value
 * head kv_head (grouped-query attention), HEADS heads at a time: span by
 * span, each folded into the output rows as it ends. */
static void query_block(const job *j, size_t kv_head, size_t h0, size_t h1, size_t t0, size_t t1) {
    const wattn_shape *sh = j->shape;
    size_t hd = sh->head_dim, width = sh->n_heads * hd, group = sh->n_heads / sh->n_kv_heads;
    const uint16_t *keys = j->keys + kv_head * sh->stride * hd;
    const uint16_t *values = j->values + kv_head * sh->stride * hd;
    float *span_acc = j->tiles + (size_t)wpool_self() * wattn_tile_floats(hd) + 2 * TILE * hd;
    running r[QUERY_BLOCK * HEADS], total[QUERY_BLOCK * HEADS];
    size_t last = j->pos0 + t1 - 1;
    for (size_t g0 = h0; g0 < h1; g0 += HEADS) {
        size_t heads = h1 - g0 < HEADS ? h1 - g0 : HEADS;
        size_t head0 = kv_head * group + g0;
        for (size_t t = t0; t < t1; t++)
            for (size_t g = 0; g < heads; g++) {
                total[(t - t0) * HEADS + g] = (running){-INFINITY, 0.0f};
                memset(j->out + t * width + (head0 + g) * hd, 0, hd * sizeof(float));
            }
        for (size_t s0 = 0; s0 <= last; s0 += SPAN) {
            size_t t_first = s0 > j->pos0 + t0 ? s0 - j->pos0 : t0; /* the queries that reach s0 */
            for (size_t t = t_first; t < t1; t++)
                for (size_t g = 0; g < heads; g++) {
                    size_t i = (t - t0) * HEADS + g;
                    r[i] = (running){-INFINITY, 0.0f};
                    memset(span_acc + i * hd, 0, hd * sizeof(float));
                }
            span_tiles(j, keys, values, head0, heads, t0, t1, s0, r, span_acc);
            for (size_t t = t_first; t < t1; t++)
                for (size_t g = 0; g < heads; g++) {
                    size_t i = (t - t0) * HEADS + g;
                    fold(&total[i], j->out + t * width + (head0 + g) * hd, &r[i], span_acc + i * hd, hd);
                }
        }
        for (size_t t = t0; t < t1; t++)
            for (size_t g = 0; g < heads; g++) {
                float *acc = j->out + t * width + (head0 + g) * hd;
                for (size_t c = 0; c < hd; c++) acc[c] /= total[(t - t0) * HEADS + g].sum;
            }
    }
}

/* A decode step's span s for all the query heads of kv_head: their value
 * sums and running sums into the span's record in j->spans (group * hd
 * floats, then each head's max and sum), folded by fold_spans. */
static void span_item(const job *j, size_t kv_head, size_t s) {
    const wattn_shape *sh = j->shape;
    size_t hd = sh->head_dim, group = sh->n_heads / sh->n_kv_heads;
    const uint16_t *keys = j->keys + kv_head * sh->stride * hd;
    const uint16_t *values = j->values + kv_head * sh->stride * hd;
    float *record = j->spans + (kv_head * j->n_spans + s) * group * (hd + 2);
    for (size_t g0 = 0; g0 < group; g0 += HEADS) {
        size_t heads = group - g0 < HEADS ? group - g0 : HEADS;
        running r[HEADS];
        for (size_t g = 0; g < heads; g++) r[g] = (running){-INFINITY, 0.0f};
        memset(record + g0 * hd, 0, heads * hd * sizeof(float));
        span_tiles(j, keys, values, kv_head * group + g0, heads, 0, 1, s * SPAN, r, record + g0 * hd);
        for (size_t g = 0; g < heads; g++) {
            record[group * hd + 2 * (g0 + g)] = r[g].max;
            record[group * hd + 2 * (g0 + g) + 1] = r[g].sum;
        }
    }
}

/* The one query's output rows from the records of span_item, each head's
 * spans folded in order as query_block folds them. */
static void fold_spans(const job *j) {
    const wattn_shape *sh = j->shape;
    size_t hd = sh->head_dim, group = sh->n_heads / sh->n_kv_heads;
    for (size_t kv_head = 0; kv_head < sh->n_kv_heads; kv_head++)
        for (size_t g = 0; g < group; g++) {
            float *out = j->out + (kv_head * group + g) * hd;
            running total = {-INFINITY, 0.0f};
            memset(out, 0, hd * sizeof(float));
            for (size_t s = 0; s < j->n_spans; s++) {
                const float *record = j->spans + (kv_head * j->n_spans + s) * group * (hd + 2);
                running part = {record[group * hd + 2 * g], record[group * hd + 2 * g + 1]};
                fold(&total, out, &part, record + g * hd, hd);
            }
            for (size_t c = 0; c < hd; c++) out[c] /= total.sum;
        }
}

/* Items are (key/value head, span) for a decode step split by span, else
 * (key/value head, its query heads' split, block of queries), in that
 * order. */
static void items(void *arg, size_t begin, size_t end) {
    const job *j = arg;
    size_t group = j->shape->n_heads / j->shape->n_kv_heads;
    for (size_t i = begin; i < end; i++) {
        if (j->n_spans) {
            span_item(j, i / j->n_spans, i % j->n_spans);
            continue;
        }
        size_t block = i % j->n_blocks, split = i / j->n_blocks % j->splits;
        size_t kv_head = i / j->n_blocks / j->splits, t0 = block * QUERY_BLOCK;
        size_t h0 = split * j->heads, h1 = h0 + j->heads < group ? h0 + j->heads : group;
        if (h0 < h1)
            query_block(j, kv_head, h0, h1, t0, t0 + QUERY_BLOCK < j->n ? t0 + QUERY_BLOCK : j->n);
    }
}

size_t wattn_work(const wattn_shape *shape, uint32_t pos0, size_t n) {
    return 2 * shape->n_heads * shape->head_dim * n * (pos0 + (n + 1) / 2);
}

size_t wattn_tile_floats(size_t head_dim) {
    return 2 * TILE * head_dim + QUERY_BLOCK * HEADS * head_dim;
}

size_t wattn_span_floats(const wattn_shape *shape) {
    return shape->n_heads * ((shape->stride + SPAN - 1) / SPAN) * (shape->head_dim + 2);
}

void wattn_chunk(wpool *pool, const wattn_shape *shape, const uint16_t *keys,
                 const uint16_t *values, const float *q, uint32_t pos0, size_t n, float *out,
                 float *tiles, float *spans) {
    job j = {.shape = shape, .keys = keys, .values = values, .q = q, .out = out, .tiles = tiles,
             .spans = spans, .pos0 = pos0,
             .n = n, .n_blocks = (n + QUERY_BLOCK - 1) / QUERY_BLOCK, .splits = 1,
             .scale = 1.0f / sqrtf((float)shape->head_dim)};
    size_t group = shape->n_heads / shape->n_kv_heads, threads = (size_t)wpool_threads(pool);
    size_t work = wattn_work(shape, pos0, n);
    /* A decode step has one item per key/value head (3 on SmolLM2), too few
     * to share between threads evenly.  Past one span its positions are
     * split instead, each item keeping its head's query heads together (a
     * tile read once for all of them); before that, the query heads are
     * split, at the price of reading the head's tiles once per item.  One
     * thread keeps them together. */
    if (n == 1 && threads > 1 && pos0 >= SPAN) {
        j.n_spans = pos0 / SPAN + 1;
        wpool_run(pool, shape->n_kv_heads * j.n_spans, work, items, &j);
        fold_spans(&j);
        return;
    }
    while (threads > 1 && j.splits < group && shape->n_kv_heads * j.n_blocks * j.splits < 4 * threads)
        j.splits++;
    j.heads = (group + j.splits - 1) / j.splits;
    wpool_run(pool, shape->n_kv_heads * j.splits * j.n_blocks, work, items, &j);
}
