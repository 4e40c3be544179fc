/*
 * model.h -- the reference model (FORMAT.md, "The model"): trunk weights,
 * the conversation state (KV cache) and the forward pass over a batch of
 * consecutive positions.
 *
 * A batch is evaluated layer by layer for all its tokens at once: every
 * weight matrix meets the whole batch (matmul.h), attention covers the batch
 * causally (attention.h), and each routed expert is read once for the
 * tokens that chose it (ffn.h).  Every kernel computes a token's values by
 * the same operations whatever the batch, so a prompt evaluated in one
 * batch, in any split, or one position at a time gives the same bits.
 */
#ifndef WASTE_MODEL_H
#define WASTE_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include "experts.h"
#include "manifest.h"
#include "matmul.h"
#include "pool.h"

/* The most positions one forward pass takes; longer inputs are cut into
 * batches of this many.  Every weight, and every routed expert, is read once
 * per batch. */
#define WMODEL_BATCH 512

typedef struct {
    const float *attn_norm, *ffn_norm;
    wmat wq, wk, wv, wo;
    wmat w1, w3, w2; /* the dense FFN, or a MoE layer's shared expert (f32) */
    wmat router;     /* MoE layers of a ref-moe container only (f32) */
} wlayer;

typedef struct {
    uint8_t *trunk; /* all of trunk.bin */
    wmat tok_embed, lm_head; /* the same matrix when the embeddings are tied */
    const float *final_norm;
    wlayer *layers;
    uint32_t trunk_crc;
} wweights;

/* Read <dir>/trunk.bin after checking its size against the manifest. */
waste_status wweights_load(wweights *w, const char *dir, const wmanifest *m, char *err, size_t errcap);
void wweights_free(wweights *w);

/* Where a batch's tokens went in a MoE layer: token t chose experts
 * chosen[t*top_k + k] with weights weight[t*top_k + k]; grouped by expert,
 * expert e's tokens (ascending) are member[first[e] .. first[e+1]) with
 * their weights in member_weight (next: the sort's cursor per expert). */
typedef struct {
    uint32_t *chosen, *member, *first, *next;
    float *weight, *member_weight;
} wroute;

/* The KV cache for ctx positions plus every activation buffer of a batch. */
typedef struct {
    uint32_t ctx, pos; /* capacity and positions filled */
    uint32_t batch;    /* the most positions one wmodel_forward takes: min(ctx, WMODEL_BATCH) */
    uint32_t stride;   /* positions per head in the cache: ctx rounded up to 8 */
    /* [n_layers][n_kv_heads][stride][head_dim], in f16 (half.h): a decode step
     * reads all of it, and half the bytes of f32 is half attention's time. */
    uint16_t *keys, *values;
    /* One row per token of the batch: */
    float *x;        /* the residual stream [batch][hidden]; the input embeddings on entry */
    float *xb, *xb2; /* normalised input and block output [batch][hidden] */
    float *q, *k, *v;/* [batch][hidden], [batch][kv_dim] x 2 */
    float *hb, *hb2; /* FFN hidden [batch][max ffn] */
    float *moe;      /* the MoE sum [batch][hidden] */
    float *rows;     /* one expert's gathered inputs [batch][hidden] */
    float *router;   /* router logits [batch][n_experts] */
    float *rope;     /* rotation angles [batch][head_dim] (ops.h) */
    float *logits;   /* [vocab], the batch's last position */
    float *tiles;    /* attention's per-thread tiles (attention.h), for any pool size */
    float *spans;    /* attention's spans of a decode step shared by threads (attention.h) */
    wroute route;
    wqvec xq;        /* the current matmul's quantised input */
    void *arena;     /* owns the buffers above */
    void *sampler;   /* wsample scratch */
} wstate;

uint64_t wstate_kv_bytes(const wmanifest *m, uint32_t ctx);
uint64_t wstate_scratch_bytes(const wmanifest *m, uint32_t ctx);

/* Allocate; the cache starts zeroed. */
waste_status wstate_init(wstate *s, const wmanifest *m, uint32_t ctx);
void wstate_free(wstate *s);

/* Keys (values = 1) of one layer's key/value head, from position 0. */
uint16_t *wstate_kv(const wstate *s, const wmanifest *m, int values, uint32_t layer,
                    uint32_t kv_head);

/* The input embedding of token (hidden floats) into out. */
void wmodel_embed(const wweights *w, int32_t token, float *out);

/* Evaluate n consecutive positions (1 <= n <= s->batch) whose input
 * embeddings the caller put in s->x[0..n), at s->pos onwards; s->pos
 * advances by n on success.  want_logits fills s->logits for the last of
 * them.  The caller checks that s->pos + n <= s->ctx. */
waste_status wmodel_forward(const wmanifest *m, const wweights *w, wstate *s, wpool *pool,
                            wexperts *experts, size_t n, int want_logits, char *err, size_t errcap);

#endif
