/*
 * ffn.h -- the feed-forward half of a layer for a batch of tokens: a dense
 * SwiGLU, or a MoE layer whose experts are grouped.
 *
 * Grouping: every token of the batch is routed first; then each expert that
 * any token chose is fetched once (through the expert cache, counted there
 * as one hit or miss), applied to the rows of all the tokens that chose it
 * as one matrix product, and its outputs are added back to those tokens.
 * Experts are taken in ascending index, so a token's sum is formed in the
 * same order whatever else is in the batch.
 */
#ifndef WASTE_FFN_H
#define WASTE_FFN_H

#include <stddef.h>
#include <stdint.h>
#include "experts.h"
#include "manifest.h"
#include "model.h"
#include "pool.h"

/* s->x += w2 . (silu(w1 . s->xb) * (w3 . s->xb)) for tokens [0, n). */
void wffn_dense(const wlayer *L, wstate *s, wpool *pool, size_t n);

/* s->x += the MoE layer `layer` applied to s->xb, tokens [0, n).  An expert
 * that cannot be read fails the batch: WASTE_E_IO with the reason in err. */
waste_status wffn_moe(const wmanifest *m, const wlayer *L, wstate *s, wpool *pool,
                      wexperts *experts, uint32_t layer, size_t n, char *err, size_t errcap);

#endif
