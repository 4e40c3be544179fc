/*
 * model.h -- the reference model (FORMAT.md, "The model"): trunk weights,
 * the conversation state (KV cache) and the forward pass for one position.
 */
#ifndef WASTE_MODEL_H
#define WASTE_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include "experts.h"
#include "manifest.h"
#include "matmul.h"
#include "pool.h"

typedef struct {
    const float *attn_norm, *ffn_norm;
    wmat wq, wk, wv, wo;
    const float *w1, *w3, *w2; /* the dense FFN, or a MoE layer's shared expert */
    const float *router;       /* MoE layers of a ref-moe container only */
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

/* The KV cache for ctx positions plus every activation buffer. */
typedef struct {
    uint32_t ctx, pos; /* capacity and positions filled */
    float *keys, *values; /* [n_layers][ctx][kv_dim] */
    float *x, *xb, *xb2, *q, *att, *hb, *hb2, *moe, *router, *logits;
    wqvec xq; /* the current matmul's quantised input */
    void *arena;   /* owns the activation buffers above */
    void *sampler; /* wsample scratch */
} wstate;

uint64_t wstate_kv_bytes(const wmanifest *m, uint32_t ctx);
uint64_t wstate_scratch_bytes(const wmanifest *m, uint32_t ctx);

waste_status wstate_init(wstate *s, const wmanifest *m, uint32_t ctx);
void wstate_free(wstate *s);

/* The input embedding of token (hidden floats) into out. */
void wmodel_embed(const wweights *w, int32_t token, float *out);

/* Evaluate one position: embedding (hidden floats) enters at s->pos, which
 * advances on success.  want_logits fills s->logits.  The caller checks
 * that s->pos < s->ctx. */
waste_status wmodel_forward(const wmanifest *m, const wweights *w, wstate *s, const wpool_team *team,
                            wexperts *experts, const float *embedding, int want_logits, char *err,
                            size_t errcap);

#endif
