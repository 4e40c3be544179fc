/*
 * ops.h -- the numeric kernels of the forward pass.  Matrix-vector products
 * are split across the thread team by output row (see pool.h), so results
 * do not depend on the thread count.
 */
#ifndef WASTE_OPS_H
#define WASTE_OPS_H

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
void wops_dequant_row(const wmat *w, size_t row, float *out);

/* out[rows] = W . x for any stored format.  Blocked formats with groups of
 * 32 quantise x into xq (room for cols codes and cols/32 blocks) and take
 * int8 dot products; f32 and other q8 groups use x as is. */
void wops_matmul(const wpool_team *team, float *out, const wmat *w, const float *x, wqvec *xq);

/* out = x / sqrt(mean(x^2) + eps) * weight */
void wops_rmsnorm(float *out, const float *x, const float *weight, size_t n, float eps);

/* out[rows] = W[rows][cols] . x (f32 weights) */
void wops_matvec(const wpool_team *team, float *out, const float *w, const float *x, size_t rows,
                 size_t cols);

/* out[rows] = W . x where W is int8 codes q[rows*cols] with one f32 scale per
 * group of `group` codes (scales may be unaligned in the record). */
void wops_matvec_q8(const wpool_team *team, float *out, const int8_t *q, const uint8_t *scales,
                    size_t group, const float *x, size_t rows, size_t cols);

/* In-place softmax. */
void wops_softmax(float *x, size_t n);

/* Rotate pairs (2i, 2i+1) of each head by pos * theta^(-2i/head_dim). */
void wops_rope(float *v, size_t n_heads, size_t head_dim, uint32_t pos, float theta);

/* a[i] = silu(a[i]) * b[i] */
void wops_swiglu(float *a, const float *b, size_t n);

#endif
