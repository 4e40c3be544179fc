#include "model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "attention.h"
#include "detail.h"
#include "ffn.h"
#include "ops.h"
#include "prof.h"
#include "sample.h"

/* Hand out consecutive tensors of the trunk in file order. */
static const float *take_f32(const uint8_t **cursor, uint64_t n) {
    const float *t = (const float *)(const void *)*cursor;
    *cursor += 4 * n;
    return t;
}

static wmat take_mat(const uint8_t **cursor, wquant q, uint64_t rows, uint64_t cols) {
    wmat t = wmat_view(q, rows, cols, *cursor);
    *cursor += wquant_bytes(q, rows, cols);
    return t;
}

static void map_tensors(wweights *w, const wmanifest *m) {
    uint64_t h = m->hidden, kv = wmanifest_kv_dim(m);
    const wquant f32 = {WQ_F32, 0};
    const uint8_t *p = w->trunk;
    w->tok_embed = take_mat(&p, m->embed_q, m->vocab_size, h);
    for (uint32_t l = 0; l < m->n_layers; l++) {
        wlayer *L = &w->layers[l];
        int dense = l < m->n_dense_layers;
        L->attn_norm = take_f32(&p, h);
        L->wq = take_mat(&p, m->weight_q, h, h);
        L->wk = take_mat(&p, m->weight_q, kv, h);
        L->wv = take_mat(&p, m->weight_q, kv, h);
        L->wo = take_mat(&p, m->weight_q, h, h);
        L->ffn_norm = take_f32(&p, h);
        if (!dense && !m->llama) L->router = take_mat(&p, f32, m->n_experts, h);
        if (dense || m->shared_expert) {
            uint64_t ffn = dense ? m->dense_ffn : m->expert_ffn;
            L->w1 = take_mat(&p, f32, ffn, h);
            L->w3 = take_mat(&p, f32, ffn, h);
            L->w2 = take_mat(&p, f32, h, ffn);
        }
    }
    w->final_norm = take_f32(&p, h);
    w->lm_head = m->tied_embeddings ? w->tok_embed : take_mat(&p, m->embed_q, m->vocab_size, h);
}

void wmodel_embed(const wweights *w, int32_t token, float *out) {
    wmat_dequant_row(&w->tok_embed, (size_t)token, out);
}

waste_status wweights_load(wweights *w, const char *dir, const wmanifest *m, char *err, size_t errcap) {
    char path[4096];
    snprintf(path, sizeof path, "%s/trunk.bin", dir);
    memset(w, 0, sizeof *w);
    FILE *f = fopen(path, "rb");
    if (!f) return wdetail(err, errcap, WASTE_E_IO, "%s: %s", path, strerror(errno));
    struct stat st;
    uint64_t want = wmanifest_trunk_bytes(m);
    if (fstat(fileno(f), &st) != 0 || (uint64_t)st.st_size != want) {
        fclose(f);
        return wdetail(err, errcap, WASTE_E_FORMAT, "%s: %llu bytes, the manifest implies %llu", path,
                       (unsigned long long)st.st_size, (unsigned long long)want);
    }
    w->trunk = malloc((size_t)want);
    w->layers = calloc(m->n_layers, sizeof *w->layers);
    if (!w->trunk || !w->layers) {
        fclose(f);
        wweights_free(w);
        return wdetail(err, errcap, WASTE_E_OOM, "out of memory for %llu trunk bytes",
                       (unsigned long long)want);
    }
    size_t got = fread(w->trunk, 1, (size_t)want, f);
    fclose(f);
    if (got != want) {
        wweights_free(w);
        return wdetail(err, errcap, WASTE_E_IO, "%s: short read", path);
    }
    w->trunk_crc = 0;
    for (uint64_t off = 0; off < want; off += 1u << 30) {
        uint64_t n = want - off < (1u << 30) ? want - off : (1u << 30);
        w->trunk_crc = (uint32_t)crc32(w->trunk_crc, (const Bytef *)w->trunk + off, (uInt)n);
    }
    map_tensors(w, m);
    return WASTE_OK;
}

void wweights_free(wweights *w) {
    free(w->trunk);
    free(w->layers);
    memset(w, 0, sizeof *w);
}

static uint32_t cache_stride(uint32_t ctx) { return (ctx + 7) / 8 * 8; }

uint64_t wstate_kv_bytes(const wmanifest *m, uint32_t ctx) {
    return 2ull * m->n_layers * cache_stride(ctx) * wmanifest_kv_dim(m) * sizeof(uint16_t);
}

static uint64_t max_ffn(const wmanifest *m) {
    return m->dense_ffn > m->expert_ffn ? m->dense_ffn : m->expert_ffn;
}

/* The widest matmul input: the quantised activations hold a batch of these. */
static uint64_t max_cols(const wmanifest *m) {
    return max_ffn(m) > m->hidden ? max_ffn(m) : m->hidden;
}

static uint32_t batch_of(uint32_t ctx) { return ctx < WMODEL_BATCH ? ctx : WMODEL_BATCH; }

/* Hand out consecutive arrays of the arena; with base NULL only count. */
static void *carve(uint8_t *base, uint64_t *used, uint64_t count, size_t size) {
    void *p = base ? base + *used : NULL;
    *used += count * size;
    return p;
}

/* Lay the activation buffers of a batch out in the arena at base (or, with
 * base NULL, only measure them): floats first, then the uint32 and int16
 * arrays, so every array is aligned for its type. */
static uint64_t lay_out(wstate *s, const wmanifest *m, uint32_t ctx, uint8_t *base) {
    const wattn_shape shape = {m->n_heads, m->n_kv_heads, m->head_dim, cache_stride(ctx)};
    uint64_t used = 0, b = batch_of(ctx), h = m->hidden, kv = wmanifest_kv_dim(m), routes = b * m->top_k;
    const size_t f = sizeof(float), u = sizeof(uint32_t);
    s->x = carve(base, &used, b * h, f);
    s->xb = carve(base, &used, b * h, f);
    s->xb2 = carve(base, &used, b * h, f);
    s->q = carve(base, &used, b * h, f);
    s->k = carve(base, &used, b * kv, f);
    s->v = carve(base, &used, b * kv, f);
    s->hb = carve(base, &used, b * max_ffn(m), f);
    s->hb2 = carve(base, &used, b * max_ffn(m), f);
    s->moe = carve(base, &used, b * h, f);
    s->rows = carve(base, &used, b * h, f);
    s->router = carve(base, &used, b * m->n_experts, f);
    s->rope = carve(base, &used, b * m->head_dim, f);
    s->logits = carve(base, &used, m->vocab_size, f);
    s->tiles = carve(base, &used, (WPOOL_MAX_THREADS + 1) * wattn_tile_floats(m->head_dim), f);
    s->spans = carve(base, &used, wattn_span_floats(&shape), f);
    s->route.weight = carve(base, &used, routes, f);
    s->route.member_weight = carve(base, &used, routes, f);
    s->xq.d = carve(base, &used, b * (max_cols(m) / 32), f);
    s->xq.sum = carve(base, &used, b * (max_cols(m) / 32), f);
    s->route.chosen = carve(base, &used, routes, u);
    s->route.member = carve(base, &used, routes, u);
    s->route.first = carve(base, &used, m->n_experts + 1, u);
    s->route.next = carve(base, &used, m->n_experts, u);
    s->xq.q = carve(base, &used, b * max_cols(m), sizeof(int16_t));
    return used;
}

uint64_t wstate_scratch_bytes(const wmanifest *m, uint32_t ctx) {
    wstate measure;
    return lay_out(&measure, m, ctx, NULL) + wsample_scratch_bytes(m->vocab_size);
}

waste_status wstate_init(wstate *s, const wmanifest *m, uint32_t ctx) {
    memset(s, 0, sizeof *s);
    size_t kv = (size_t)(wstate_kv_bytes(m, ctx) / 2);
    s->ctx = ctx;
    s->batch = batch_of(ctx);
    s->stride = cache_stride(ctx);
    /* Zeroed: attention reads keys eight at a time, a few past the last
     * position (and masks them), and those must be numbers. */
    s->keys = calloc(1, kv);
    s->values = calloc(1, kv);
    s->arena = malloc((size_t)lay_out(s, m, ctx, NULL));
    s->sampler = malloc((size_t)wsample_scratch_bytes(m->vocab_size));
    if (!s->keys || !s->values || !s->arena || !s->sampler) {
        wstate_free(s);
        return WASTE_E_OOM;
    }
    lay_out(s, m, ctx, s->arena);
    return WASTE_OK;
}

void wstate_free(wstate *s) {
    free(s->keys);
    free(s->values);
    free(s->arena);
    free(s->sampler);
    memset(s, 0, sizeof *s);
}

uint16_t *wstate_kv(const wstate *s, const wmanifest *m, int values, uint32_t layer,
                    uint32_t kv_head) {
    size_t head = ((size_t)layer * m->n_kv_heads + kv_head) * s->stride * m->head_dim;
    return (values ? s->values : s->keys) + head;
}

/* Each token's keys and values into its heads' rows of the cache, as f16. */
static void store_kv(const wmanifest *m, wstate *s, uint32_t layer, size_t n) {
    size_t hd = m->head_dim, kv = wmanifest_kv_dim(m);
    for (uint32_t head = 0; head < m->n_kv_heads; head++) {
        uint16_t *keys = wstate_kv(s, m, 0, layer, head) + (size_t)s->pos * hd;
        uint16_t *values = wstate_kv(s, m, 1, layer, head) + (size_t)s->pos * hd;
        for (size_t t = 0; t < n; t++) {
            wops_to_half(keys + t * hd, s->k + t * kv + head * hd, hd);
            wops_to_half(values + t * hd, s->v + t * kv + head * hd, hd);
        }
    }
}

/* x += wo . attention(rmsnorm(x) * attn_norm), for tokens [0, n). */
static void attention_block(const wmanifest *m, const wlayer *L, wstate *s, wpool *pool,
                            uint32_t layer, size_t n) {
    size_t h = m->hidden, kv = wmanifest_kv_dim(m), hd = m->head_dim;
    WPROF_START(normed);
    for (size_t t = 0; t < n; t++) wops_rmsnorm(s->xb + t * h, s->x + t * h, L->attn_norm, h, m->norm_eps);
    WPROF_ADD(WPROF_NORM, normed);
    float *const outs[] = {s->q, s->k, s->v};
    const wmat *const ws[] = {&L->wq, &L->wk, &L->wv};
    wmat_mul_many(pool, outs, ws, 3, s->xb, n, &s->xq);
    WPROF_START(rotated);
    for (size_t t = 0; t < n; t++) {
        wops_rope(s->q + t * h, m->n_heads, hd, s->rope + t * hd);
        wops_rope(s->k + t * kv, m->n_kv_heads, hd, s->rope + t * hd);
    }
    WPROF_ADD(WPROF_ROPE, rotated);
    WPROF_START(stored);
    store_kv(m, s, layer, n);
    WPROF_ADD(WPROF_KV_STORE, stored);
    WPROF_START(attended);
    const wattn_shape shape = {m->n_heads, m->n_kv_heads, hd, s->stride};
    wattn_chunk(pool, &shape, wstate_kv(s, m, 0, layer, 0), wstate_kv(s, m, 1, layer, 0), s->q,
                s->pos, n, s->xb, s->tiles, s->spans);
    WPROF_ADD(WPROF_ATTENTION, attended);
    wmat_mul(pool, s->xb2, &L->wo, s->xb, n, &s->xq);
    WPROF_START(added);
    for (size_t i = 0; i < n * h; i++) s->x[i] += s->xb2[i];
    WPROF_ADD(WPROF_RESIDUAL, added);
}

waste_status wmodel_forward(const wmanifest *m, const wweights *w, wstate *s, wpool *pool,
                            wexperts *experts, size_t n, int want_logits, char *err,
                            size_t errcap) {
    size_t h = m->hidden;
    for (size_t t = 0; t < n; t++) /* the same angles serve every layer */
        wops_rope_angles(s->rope + t * m->head_dim, m->head_dim, s->pos + (uint32_t)t, m->rope_theta);
    for (uint32_t l = 0; l < m->n_layers; l++) {
        const wlayer *L = &w->layers[l];
        attention_block(m, L, s, pool, l, n);
        WPROF_START(normed);
        for (size_t t = 0; t < n; t++) wops_rmsnorm(s->xb + t * h, s->x + t * h, L->ffn_norm, h, m->norm_eps);
        WPROF_ADD(WPROF_NORM, normed);
        if (l < m->n_dense_layers) {
            wffn_dense(L, s, pool, n);
        } else {
            waste_status st = wffn_moe(m, L, s, pool, experts, l, n, err, errcap);
            if (st != WASTE_OK) return st;
        }
    }
    if (want_logits) {
        const float *last = s->x + (n - 1) * h;
        WPROF_START(normed);
        wops_rmsnorm(s->xb, last, w->final_norm, h, m->norm_eps);
        WPROF_ADD(WPROF_NORM, normed);
        wmat_mul(pool, s->logits, &w->lm_head, s->xb, 1, &s->xq);
    }
    s->pos += (uint32_t)n;
    return WASTE_OK;
}
