/*
 * sample.h -- choosing the next token from logits: greedy, or temperature
 * with top-k / top-p, driven by a seeded xoshiro256** generator.
 */
#ifndef WASTE_SAMPLE_H
#define WASTE_SAMPLE_H

#include <stddef.h>
#include <stdint.h>
#include "waste.h"

typedef struct {
    uint64_t s[4];
} wrng;

/* Seed from one 64-bit value (expanded with splitmix64). */
void wrng_seed(wrng *rng, uint64_t seed);

/* Uniform in [0, 1). */
double wrng_uniform(wrng *rng);

/* Scratch bytes wsample needs for a vocabulary of n. */
uint64_t wsample_scratch_bytes(uint32_t n);

/* Pick a token.  Temperature 0 is greedy (ties: lowest id).  Otherwise
 * candidates are ranked by probability (ties: lower id), cut to top_k
 * (when > 0), then to the smallest prefix holding top_p of the remaining
 * mass (when < 1), and drawn from.  *logprob gets the chosen token's
 * log-softmax at temperature 1. */
int32_t wsample(const float *logits, uint32_t n, const waste_gen_params *p, wrng *rng,
                void *scratch, float *logprob);

#endif
