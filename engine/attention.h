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
 * 32, within spans of 256 positions that start at multiples of 256; the
 * spans' sums are then folded in order from position 0.  A query's result
 * depends only on its position and the cache, never on which chunk it came
 * in, how many threads there are or which one ran it.
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
 * wattn_tile_floats(head_dim) floats for each thread of the pool, spans
 * wattn_span_floats(shape) (a decode step's spans, when threads share it). */
void wattn_chunk(wpool *pool, const wattn_shape *shape, const uint16_t *keys,
                 const uint16_t *values, const float *q, uint32_t pos0, size_t n, float *out,
                 float *tiles, float *spans);

/* Floats of the scratch wattn_chunk's `tiles` holds for each thread of its
 * pool (thread i's at i * this, wpool_self): a tile's keys and values as
 * floats, and a block of queries' value sums within a span. */
size_t wattn_tile_floats(size_t head_dim);

/* Floats of wattn_chunk's `spans`: every span's sums for every head of one
 * query, for positions up to shape->stride. */
size_t wattn_span_floats(const wattn_shape *shape);

/* Multiply-adds of wattn_chunk, for the thread pool's threshold. */
size_t wattn_work(const wattn_shape *shape, uint32_t pos0, size_t n);

#endif
