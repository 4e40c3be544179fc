#include "ffn.h"

#include <string.h>

#include "ops.h"
#include "prof.h"

/* out[n][hidden] = w2 . (silu(w1 . in) * (w3 . in)), row by row. */
static void swiglu(wpool *pool, wstate *s, float *out, const float *in, size_t n,
                   const wmat *w1, const wmat *w3, const wmat *w2) {
    size_t ffn = w1->rows;
    float *const outs[] = {s->hb, s->hb2};
    const wmat *const ws[] = {w1, w3};
    wmat_mul_many(pool, outs, ws, 2, in, n, &s->xq);
    WPROF_START(gated);
    for (size_t t = 0; t < n; t++) wops_swiglu(s->hb + t * ffn, s->hb2 + t * ffn, ffn);
    WPROF_ADD(WPROF_SWIGLU, gated);
    wmat_mul(pool, out, w2, s->hb, n, &s->xq);
}

static void add_rows(float *x, const float *y, size_t count) {
    WPROF_START(added);
    for (size_t i = 0; i < count; i++) x[i] += y[i];
    WPROF_ADD(WPROF_RESIDUAL, added);
}

void wffn_dense(const wlayer *L, wstate *s, wpool *pool, size_t n) {
    swiglu(pool, s, s->xb2, s->xb, n, &L->w1, &L->w3, &L->w2);
    add_rows(s->x, s->xb2, n * L->w2.rows);
}

/* Softmax over all experts, keep the top_k (ties: lower index), renormalise. */
static void route_token(const wmanifest *m, float *probs, uint32_t *chosen, float *weights) {
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

/* Route every token, then list each expert's tokens (a counting sort, so
 * each list is in token order). */
static void route(const wmanifest *m, const wlayer *L, wstate *s, wpool *pool, size_t n) {
    wroute *r = &s->route;
    size_t top_k = m->top_k;
    if (m->llama) { /* a dense FFN stored as the layer's only expert */
        for (size_t t = 0; t < n; t++) r->chosen[t] = 0, r->weight[t] = 1.0f;
    } else {
        wmat_mul(pool, s->router, &L->router, s->xb, n, &s->xq);
        for (size_t t = 0; t < n; t++)
            route_token(m, s->router + t * m->n_experts, r->chosen + t * top_k, r->weight + t * top_k);
    }
    memset(r->first, 0, (m->n_experts + 1) * sizeof *r->first);
    for (size_t i = 0; i < n * top_k; i++) r->first[r->chosen[i] + 1]++;
    for (uint32_t e = 0; e < m->n_experts; e++) r->first[e + 1] += r->first[e];
    memcpy(r->next, r->first, m->n_experts * sizeof *r->next);
    for (size_t i = 0; i < n * top_k; i++) {
        uint32_t slot = r->next[r->chosen[i]]++;
        r->member[slot] = (uint32_t)(i / top_k);
        r->member_weight[slot] = r->weight[i];
    }
}

/* Expert e (its record's payload) applied to its `count` tokens' rows. */
static void run_expert(const wmanifest *m, wstate *s, wpool *pool, const uint8_t *payload,
                       const uint32_t *member, const float *weight, size_t count, size_t n) {
    size_t h = m->hidden, ffn = m->expert_ffn, up = (size_t)wquant_bytes(m->expert_q, ffn, h);
    wmat w1 = wmat_view(m->expert_q, ffn, h, payload);
    wmat w3 = wmat_view(m->expert_q, ffn, h, payload + up);
    wmat w2 = wmat_view(m->expert_q, h, ffn, payload + 2 * up);
    const float *in = s->xb;
    if (count < n) { /* gather; when every token chose it, its rows are xb as they are */
        for (size_t i = 0; i < count; i++) memcpy(s->rows + i * h, s->xb + member[i] * h, h * sizeof(float));
        in = s->rows;
    }
    swiglu(pool, s, s->xb2, in, count, &w1, &w3, &w2);
    for (size_t i = 0; i < count; i++) { /* scatter */
        float *sum = s->moe + member[i] * h;
        const float *y = s->xb2 + i * h;
        for (size_t c = 0; c < h; c++) sum[c] += weight[i] * y[c];
    }
}

waste_status wffn_moe(const wmanifest *m, const wlayer *L, wstate *s, wpool *pool,
                      wexperts *experts, uint32_t layer, size_t n, char *err, size_t errcap) {
    size_t h = m->hidden;
    const wroute *r = &s->route;
    route(m, L, s, pool, n);
    memset(s->moe, 0, n * h * sizeof *s->moe);
    for (uint32_t e = 0; e < m->n_experts; e++) {
        size_t begin = r->first[e], count = r->first[e + 1] - begin;
        if (count == 0) continue;
        const uint8_t *payload;
        waste_status st = wexperts_get(experts, layer, e, (uint32_t)count, &payload, err, errcap);
        if (st != WASTE_OK) return st;
        run_expert(m, s, pool, payload, r->member + begin, r->member_weight + begin, count, n);
    }
    if (m->shared_expert) {
        swiglu(pool, s, s->xb2, s->xb, n, &L->w1, &L->w3, &L->w2);
        add_rows(s->moe, s->xb2, n * h);
    }
    add_rows(s->x, s->moe, n * h);
    return WASTE_OK;
}
