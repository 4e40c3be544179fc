/*
 * ops.h -- the numeric kernels of the forward pass.  Matrix-vector products
 * are split across the thread team by output row (see pool.h), so results
 * do not depend on the thread count.
 */
#ifndef WASTE_OPS_H
#define WASTE_OPS_H

#include <stddef.h>
#include <stdint.h>
#include "pool.h"

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
