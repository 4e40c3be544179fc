/*
 * dot.h -- one row of a blocked weight matrix dotted with a quantised
 * activation: the inner loop of every matmul.  Integer products per block of
 * 32, scaled once per block.  Plain C everywhere; on x86-64 with GCC or
 * Clang an AVX2 version is chosen at run time when the CPU has it.
 */
#ifndef WASTE_DOT_H
#define WASTE_DOT_H

#include <stddef.h>
#include <stdint.h>

/* An activation vector quantised for integer dot products: per block of 32,
 * int16 codes q, their scale d (x ~= d*q) and d * sum(q).  int16, not int8:
 * int8 activations move logits by ~0.5 on SmolLM2, enough to flip near ties
 * in greedy answers; int16 keeps them within ~0.01. */
typedef struct {
    int16_t *q;
    float *d, *sum;
} wqvec;

/* x ~= d*q per block of 32 (n a multiple of 32). */
void wdot_quantize(const float *x, size_t n, wqvec *out);

/* sum over blocks b of (scale[b]*q_w + min[b]) . (d[b]*q_x) for q4_1 codes:
 * 16 bytes per block, byte k holding element k (low nibble) and k+16. */
float wdot_q4_1(const uint8_t *nibbles, const float *scale, const float *min, const wqvec *x,
                size_t blocks);

/* sum over blocks b of scale[b]*q_w . d[b]*q_x for int8 codes. */
float wdot_q8(const int8_t *codes, const float *scale, const wqvec *x, size_t blocks);

#endif
