/*
 * half.h -- IEEE 754 binary16 ("f16"), the KV cache's number format.
 *
 * A decode step reads the whole KV cache once per token; kept in f16 it is
 * half the bytes of f32 (as llama.cpp's default cache), and attention reads
 * at the memory's speed.  These are the plain C conversions; F16C's
 * vcvtps2ph / vcvtph2ps give the same bits (tests/engine/test_half.py).
 */
#ifndef WASTE_HALF_H
#define WASTE_HALF_H

#include <stdint.h>
#include <string.h>

/* The f16 nearest x, ties to even; beyond the largest finite f16 (65504)
 * is infinity, a NaN stays a (quiet) NaN. */
static inline uint16_t whalf_from_float(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000u, abs = bits & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* infinity, or NaN with its top payload bits kept */
        return (uint16_t)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u | ((abs >> 13) & 0x3ffu) : 0u));
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
    if (abs < 0x38800000u) { /* below 2^-14: an f16 subnormal, or zero */
        if (abs < 0x33000000u) return (uint16_t)sign; /* at most half the smallest: 0 */
        uint32_t shift = 126u - (abs >> 23);          /* 14 .. 24 */
        uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        uint32_t half = mant >> shift, rest = mant & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        half += rest > mid || (rest == mid && (half & 1u));
        return (uint16_t)(sign | half);
    }
    /* Rebias the exponent (127 -> 15) and round the 13 bits dropped; a carry
     * out of the mantissa correctly raises the exponent. */
    uint32_t rebased = abs - 0x38000000u, rest = rebased & 0x1fffu, half = rebased >> 13;
    half += rest > 0x1000u || (rest == 0x1000u && (half & 1u));
    return (uint16_t)(sign | half);
}

/* The float equal to h (every f16 is exactly a float). */
static inline float whalf_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) { /* infinity, or NaN made quiet */
        bits = sign | 0x7f800000u | (mant ? 0x400000u | (mant << 13) : 0u);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise the mantissa */
        uint32_t e = 113u;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

#endif
