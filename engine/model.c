#include "model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "detail.h"
#include "ops.h"
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
        if (!dense && !m->llama) L->router = take_f32(&p, (uint64_t)m->n_experts * h);
        if (dense || m->shared_expert) {
            uint64_t ffn = dense ? m->dense_ffn : m->expert_ffn;
            L->w1 = take_f32(&p, ffn * h);
            L->w3 = take_f32(&p, ffn * h);
            L->w2 = take_f32(&p, h * ffn);
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

uint64_t wstate_kv_bytes(const wmanifest *m, uint32_t ctx) {
    return 2ull * m->n_layers * ctx * wmanifest_kv_dim(m) * sizeof(float);
}

static uint64_t max_ffn(const wmanifest *m) {
    return m->dense_ffn > m->expert_ffn ? m->dense_ffn : m->expert_ffn;
}

/* The widest matmul input: the quantised activation holds one of these. */
static uint64_t max_cols(const wmanifest *m) {
    return max_ffn(m) > m->hidden ? max_ffn(m) : m->hidden;
}

/* Activation floats, in the order wstate_init carves them (the quantised
 * activation's d and sum come last, its int16 codes after them). */
static uint64_t activation_floats(const wmanifest *m, uint32_t ctx) {
    return 5ull * m->hidden + ctx + 2 * max_ffn(m) + m->n_experts + m->vocab_size +
           2 * (max_cols(m) / 32 + 1);
}

static uint64_t activation_bytes(const wmanifest *m, uint32_t ctx) {
    return activation_floats(m, ctx) * sizeof(float) + 2 * max_cols(m);
}

uint64_t wstate_scratch_bytes(const wmanifest *m, uint32_t ctx) {
    return activation_bytes(m, ctx) + wsample_scratch_bytes(m->vocab_size);
}

waste_status wstate_init(wstate *s, const wmanifest *m, uint32_t ctx) {
    memset(s, 0, sizeof *s);
    size_t kv = (size_t)(wstate_kv_bytes(m, ctx) / 2);
    s->ctx = ctx;
    s->keys = malloc(kv);
    s->values = malloc(kv);
    s->arena = malloc((size_t)activation_bytes(m, ctx));
    s->sampler = malloc((size_t)wsample_scratch_bytes(m->vocab_size));
    if (!s->keys || !s->values || !s->arena || !s->sampler) {
        wstate_free(s);
        return WASTE_E_OOM;
    }
    float *p = s->arena;
    size_t h = m->hidden, ffn = (size_t)max_ffn(m);
    s->x = p, p += h;
    s->xb = p, p += h;
    s->xb2 = p, p += h;
    s->q = p, p += h;
    s->moe = p, p += h;
    s->hb = p, p += ffn;
    s->hb2 = p, p += ffn;
    s->att = p, p += ctx;
    s->router = p, p += m->n_experts;
    s->logits = p, p += m->vocab_size;
    s->xq.d = p, p += max_cols(m) / 32 + 1;
    s->xq.sum = p, p += max_cols(m) / 32 + 1;
    s->xq.q = (int16_t *)(void *)p;
    return WASTE_OK;
}

void wstate_free(wstate *s) {
    free(s->keys);
    free(s->values);
    free(s->arena);
    free(s->sampler);
    memset(s, 0, sizeof *s);
}

static void attention(const wmanifest *m, wstate *s, const float *k_cache,
                      const float *v_cache) {
    size_t kv = wmanifest_kv_dim(m), hd = m->head_dim, group = m->n_heads / m->n_kv_heads;
    float inv_sqrt = 1.0f / sqrtf((float)hd);
    for (size_t head = 0; head < m->n_heads; head++) {
        const float *qh = s->q + head * hd;
        size_t kv_off = head / group * hd; /* grouped-query: heads share a key/value head */
        for (uint32_t t = 0; t <= s->pos; t++) {
            const float *kt = k_cache + (size_t)t * kv + kv_off;
            float dot = 0.0f;
            for (size_t i = 0; i < hd; i++) dot += qh[i] * kt[i];
            s->att[t] = dot * inv_sqrt;
        }
        wops_softmax(s->att, (size_t)s->pos + 1);
        float *out = s->xb + head * hd;
        memset(out, 0, hd * sizeof *out);
        for (uint32_t t = 0; t <= s->pos; t++) {
            const float *vt = v_cache + (size_t)t * kv + kv_off;
            for (size_t i = 0; i < hd; i++) out[i] += s->att[t] * vt[i];
        }
    }
}

/* x += wo . attention(rmsnorm(x) * attn_norm) */
static void attention_block(const wmanifest *m, const wlayer *L, wstate *s, const wpool_team *team,
                            uint32_t layer) {
    size_t h = m->hidden, kv = wmanifest_kv_dim(m);
    size_t plane = (size_t)layer * s->ctx * kv;
    float *k = s->keys + plane + (size_t)s->pos * kv, *v = s->values + plane + (size_t)s->pos * kv;
    wops_rmsnorm(s->xb, s->x, L->attn_norm, h, m->norm_eps);
    wmat_mul(team, s->q, &L->wq, s->xb, &s->xq);
    wmat_mul(team, k, &L->wk, s->xb, &s->xq);
    wmat_mul(team, v, &L->wv, s->xb, &s->xq);
    wops_rope(s->q, m->n_heads, m->head_dim, s->pos, m->rope_theta);
    wops_rope(k, m->n_kv_heads, m->head_dim, s->pos, m->rope_theta);
    attention(m, s, s->keys + plane, s->values + plane);
    wmat_mul(team, s->xb2, &L->wo, s->xb, &s->xq);
    for (size_t i = 0; i < h; i++) s->x[i] += s->xb2[i];
}

/* out = w2 . (silu(w1 . in) * (w3 . in)) with f32 weights. */
static void swiglu_f32(const wpool_team *team, wstate *s, float *out, const float *in, const float *w1,
                       const float *w3, const float *w2, size_t h, size_t ffn) {
    wops_matvec(team, s->hb, w1, in, ffn, h);
    wops_matvec(team, s->hb2, w3, in, ffn, h);
    wops_swiglu(s->hb, s->hb2, ffn);
    wops_matvec(team, out, w2, s->hb, h, ffn);
}

/* The same for an expert record's payload, in the manifest's expert format. */
static void expert_ffn(const wmanifest *m, const wpool_team *team, wstate *s, float *out,
                       const float *in, const uint8_t *payload) {
    size_t h = m->hidden, ffn = m->expert_ffn, up = (size_t)wquant_bytes(m->expert_q, ffn, h);
    wmat w1 = wmat_view(m->expert_q, ffn, h, payload);
    wmat w3 = wmat_view(m->expert_q, ffn, h, payload + up);
    wmat w2 = wmat_view(m->expert_q, h, ffn, payload + 2 * up);
    wmat_mul(team, s->hb, &w1, in, &s->xq);
    wmat_mul(team, s->hb2, &w3, in, &s->xq);
    wops_swiglu(s->hb, s->hb2, ffn);
    wmat_mul(team, out, &w2, s->hb, &s->xq);
}

/* Softmax over all experts, keep the top_k (ties: lower index), renormalise. */
static void route(const wmanifest *m, float *probs, uint32_t *chosen, float *weights) {
    wops_softmax(probs, m->n_experts);
    float total = 0.0f;
    for (uint32_t k = 0; k < m->top_k; k++) {
        uint32_t best = 0;
        float best_p = -1.0f;
        for (uint32_t e = 0; e < m->n_experts; e++)
            if (probs[e] > best_p) best = e, best_p = probs[e];
        chosen[k] = best;
        weights[k] = best_p;
        total += best_p;
        probs[best] = -2.0f; /* taken */
    }
    for (uint32_t k = 0; k < m->top_k; k++) weights[k] /= total;
}

/* Experts are loaded and applied one at a time, so a cache of a single
 * record is enough. */
static waste_status moe_ffn(const wmanifest *m, const wlayer *L, wstate *s, const wpool_team *team,
                            wexperts *experts, uint32_t layer, char *err, size_t errcap) {
    size_t h = m->hidden;
    uint32_t chosen[WM_MAX_TOP_K];
    float weights[WM_MAX_TOP_K];
    if (m->llama) { /* a dense FFN stored as the layer's only expert */
        chosen[0] = 0;
        weights[0] = 1.0f;
    } else {
        wops_matvec(team, s->router, L->router, s->xb, m->n_experts, h);
        route(m, s->router, chosen, weights);
    }
    memset(s->moe, 0, h * sizeof *s->moe);
    for (uint32_t k = 0; k < m->top_k; k++) {
        const uint8_t *payload;
        waste_status st = wexperts_get(experts, layer, chosen[k], &payload, err, errcap);
        if (st != WASTE_OK) return st;
        expert_ffn(m, team, s, s->xb2, s->xb, payload);
        for (size_t i = 0; i < h; i++) s->moe[i] += weights[k] * s->xb2[i];
    }
    if (m->shared_expert) {
        swiglu_f32(team, s, s->xb2, s->xb, L->w1, L->w3, L->w2, h, m->expert_ffn);
        for (size_t i = 0; i < h; i++) s->moe[i] += s->xb2[i];
    }
    for (size_t i = 0; i < h; i++) s->x[i] += s->moe[i];
    return WASTE_OK;
}

waste_status wmodel_forward(const wmanifest *m, const wweights *w, wstate *s, const wpool_team *team,
                            wexperts *experts, const float *embedding, int want_logits, char *err,
                            size_t errcap) {
    size_t h = m->hidden;
    memcpy(s->x, embedding, h * sizeof *s->x);
    for (uint32_t l = 0; l < m->n_layers; l++) {
        const wlayer *L = &w->layers[l];
        attention_block(m, L, s, team, l);
        wops_rmsnorm(s->xb, s->x, L->ffn_norm, h, m->norm_eps);
        if (l < m->n_dense_layers) {
            swiglu_f32(team, s, s->xb2, s->xb, L->w1, L->w3, L->w2, h, m->dense_ffn);
            for (size_t i = 0; i < h; i++) s->x[i] += s->xb2[i];
        } else {
            waste_status st = moe_ffn(m, L, s, team, experts, l, err, errcap);
            if (st != WASTE_OK) return st;
        }
    }
    if (want_logits) {
        wops_rmsnorm(s->xb, s->x, w->final_norm, h, m->norm_eps);
        wmat_mul(team, s->logits, &w->lm_head, s->xb, &s->xq);
    }
    s->pos++;
    return WASTE_OK;
}
