/*
 * ops.h -- the element-wise kernels of the forward pass, one token's row at
 * a time (so a token's result never depends on the chunk around it).
 */
#ifndef WASTE_OPS_H
#define WASTE_OPS_H

#include <stddef.h>
#include <stdint.h>
#include "pool.h"

/* out = x / sqrt(mean(x^2) + eps) * weight */
void wops_rmsnorm(float *out, const float *x, const float *weight, size_t n, float eps);

/* out[rows] = W[rows][cols] . x (f32 weights; the vision tower's). */
void wops_matvec(wpool *pool, float *out, const float *w, const float *x, size_t rows,
                 size_t cols);

/* In-place softmax. */
void wops_softmax(float *x, size_t n);

/* The rotation of position pos: cos_sin[2i], cos_sin[2i+1] = cos and sin of
 * pos * theta^(-2i/head_dim), for i < head_dim/2. */
void wops_rope_angles(float *cos_sin, size_t head_dim, uint32_t pos, float theta);

/* Rotate pairs (2i, 2i+1) of each head by the angles above. */
void wops_rope(float *v, size_t n_heads, size_t head_dim, const float *cos_sin);

/* a[i] = silu(a[i]) * b[i] */
void wops_swiglu(float *a, const float *b, size_t n);

/* out[i] = x[i] as f16 (half.h), the same bits on every kernel path. */
void wops_to_half(uint16_t *out, const float *x, size_t n);

/* out[i] = the float equal to the f16 h[i]. */
void wops_to_float(float *out, const uint16_t *h, size_t n);

#endif
