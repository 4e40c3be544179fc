/*
 * matmul.h -- weight matrices in any stored format (FORMAT.md, "Weight
 * formats") and their products with the activations of a chunk of tokens.
 * Each weight row is read once per chunk, not once per token: rows are split
 * across the thread pool (pool.h) and every row meets all the chunk's tokens
 * (dot.h), so results depend neither on the chunk nor on the thread count.
 */
#ifndef WASTE_MATMUL_H
#define WASTE_MATMUL_H

#include <stddef.h>
#include <stdint.h>
#include "dot.h"
#include "manifest.h"
#include "pool.h"

/* A weight matrix as stored (FORMAT.md, "Weight formats"). */
typedef struct {
    wquant q;
    size_t rows, cols;
    const uint8_t *data;    /* f32 values, int8 codes or q4_1 nibble pairs */
    const uint8_t *scales;  /* q8 and q4_1: one f32 per group (unaligned for odd q8 groups) */
    const uint8_t *minima;  /* q4_1: one f32 per group */
} wmat;

/* The matrix stored as q at p (rows x cols); the next one starts at
 * p + wquant_bytes(q, rows, cols). */
wmat wmat_view(wquant q, size_t rows, size_t cols, const uint8_t *p);

/* out[cols] = row `row` of w, dequantised. */
void wmat_dequant_row(const wmat *w, size_t row, float *out);

/* out[t][rows] = W . x[t] for the n tokens of x[n][cols], any stored format.
 * Blocked formats with groups of 32 quantise x into xq (room for n*cols
 * codes and n*cols/32 blocks, see dot.h) and take integer dot products; f32
 * and other q8 groups use x as is. */
void wmat_mul(wpool *pool, float *out, const wmat *w, const float *x, size_t n,
              wqvec *xq);

/* The same for `count` matrices of the same input (cols alike), outs[m] for
 * ws[m], in one job of the pool: a decode step's q, k and v (or an FFN's
 * gate and up) cost one hand-off between threads, not three, and the input
 * is quantised once.  The same bits as wmat_mul on each. */
void wmat_mul_many(wpool *pool, float *const *outs, const wmat *const *ws, size_t count,
                   const float *x, size_t n, wqvec *xq);

#endif
