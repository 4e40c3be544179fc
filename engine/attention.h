/*
 * attention.h -- causal multi-head attention of a chunk of queries over the
 * KV cache, spread over the thread pool.
 *
 * The cache of one layer holds each key/value head's positions contiguously,
 * in f16 (half.h): keys[kv_head][position][head_dim] (values alike), `stride`
 * positions per head (the context rounded up to a multiple of 8, as keys are
 * read eight at a time).  A query at position p attends to positions 0..p.
 *
 * Softmax is taken online, over tiles of 32 keys that start at multiples of
 * 32: a query's result depends only on its position and the cache, never on
 * which chunk it came in or which thread ran it.
 */
#ifndef WASTE_ATTENTION_H
#define WASTE_ATTENTION_H

#include <stddef.h>
#include <stdint.h>
#include "pool.h"

typedef struct {
    size_t n_heads, n_kv_heads, head_dim;
    size_t stride; /* positions per key/value head in the cache */
} wattn_shape;

/* For t < n: out[t] = attention of q[t] (at position pos0 + t) over the
 * cached positions 0..pos0+t.  q and out are [n][n_heads*head_dim]; the
 * chunk's own keys and values must already be in the cache; tiles holds
 * wattn_tile_floats(head_dim) floats for each thread of the pool. */
void wattn_chunk(wpool *pool, const wattn_shape *shape, const uint16_t *keys,
                 const uint16_t *values, const float *q, uint32_t pos0, size_t n, float *out,
                 float *tiles);

/* Floats of the scratch wattn_chunk's `tiles` holds for each thread of its
 * pool (thread i's at i * this, wpool_self): a tile's keys and values as
 * floats. */
size_t wattn_tile_floats(size_t head_dim);

/* Multiply-adds of wattn_chunk, for the thread pool's threshold. */
size_t wattn_work(const wattn_shape *shape, uint32_t pos0, size_t n);

#endif
