/*
 * dot.h -- one row of a weight matrix dotted with the activations of up to
 * WDOT_TOKENS tokens at once: the inner loop of every matmul.  The row is
 * decoded once for all of them; each token's sum is computed by the same
 * operations in the same order however many tokens share the call, so a
 * chunk gives bit for bit what one token at a time gives.
 *
 * Blocked formats (groups of 32) take integer products per block, scaled
 * once per block.  Plain C everywhere; AVX2 or AVX-512 (VNNI) when the CPU
 * has it (simd.h).
 */
#ifndef WASTE_DOT_H
#define WASTE_DOT_H

#include <stddef.h>
#include <stdint.h>

/* Tokens one call serves: the row's decoded blocks are reused this often. */
#define WDOT_TOKENS 4

/* The activations of n tokens quantised for integer dot products: per block
 * of 32, int16 codes q, their scale d (x ~= d*q) and d * sum(q).  Token t's
 * codes start at q + t*cols, its d and sum at t*cols/32.  int16, not int8:
 * int8 activations move logits by ~0.5 on SmolLM2, enough to flip near ties
 * in greedy answers; int16 keeps them within ~0.01.
 *
 * SIMD layout: with the AVX2 and AVX-512 kernels (simd.h) a block's codes
 * are not in element order but in the order its weights come out of the
 * nibbles by shifts alone: blocks go in pairs (a last odd one alone), and a
 * pair's 64 codes are four runs of sixteen, run r holding elements 2j,
 * 2j+16, 2j+1, 2j+17 (r = 0..3, j = 0..7) of the first block then of the
 * second (dot_kernel.h).  The plain kernels keep element order; a process
 * uses one or the other throughout. */
typedef struct {
    int16_t *q;
    float *d, *sum;
    size_t cols;
} wqvec;

/* Quantise n rows of cols floats (cols a multiple of 32) into out. */
void wdot_quantize(const float *x, size_t n, size_t cols, wqvec *out);

/* out[t * out_stride] = row . token t, for t in [0, n), n <= WDOT_TOKENS,
 * tokens first..first+n-1 of x. */

/* q4_1 row: 16 bytes per block, byte k holding element k (low nibble) and
 * k+16, with a scale and a minimum per block. */
void wdot_q4_1(const uint8_t *nibbles, const float *scale, const float *min, const wqvec *x,
               size_t first, size_t n, float *out, size_t out_stride);

/* q8 row with groups of 32: int8 codes and a scale per block. */
void wdot_q8(const int8_t *codes, const float *scale, const wqvec *x, size_t first, size_t n,
             float *out, size_t out_stride);

/* out[r] = row r . token `token` for r in [0, rows), consecutive rows of a
 * q4_1 matrix (q4_1 = 1: nibbles, scales and minima from their first row)
 * or of a q8 matrix with groups of 32 (min unused): the same bits as
 * wdot_q4_1 or wdot_q8 row by row, several rows a call. */
void wdot_rows(int q4_1, const uint8_t *data, const float *scale, const float *min, size_t rows,
               const wqvec *x, size_t token, float *out);

/* f32 row against float activations x (token t at x + t*cols). */
void wdot_f32(const float *row, const float *x, size_t cols, size_t n, float *out,
              size_t out_stride);

#endif
