/*
 * dot_kernel.h -- the SIMD row kernels of dot.c, included there once per
 * instruction set (no include guard): KERNEL(name) names a copy, KTARGET is
 * its target attribute and DOT4(w, q) the exact integer products of four
 * weight vectors with the activations at q (dot.h, "SIMD layout").
 *
 * Blocks are taken two at a time: one 32-byte load of q4_1 nibbles (or two
 * 16-byte halves of q8 codes) gives the pair's weights as four vectors of
 * 16-bit lanes by shifts and masks alone, lanes 0-7 from the first block and
 * 8-15 from the second, in the order the activations were laid out in.
 * Their products leave the first block's sum in int32 lanes 0-3 and the
 * second's in 4-7, scaled there by the blocks' scale times the activations'
 * (taken eight blocks at a time) and accumulated lane-wise.  A last block
 * without a partner takes the same steps on 128-bit vectors.  Each token
 * keeps two running sums (even and odd pairs), so consecutive multiply-adds
 * do not wait on each other; a token's operations are the same however
 * many tokens share the call.
 */

#define KINLINE KTARGET static inline __attribute__((always_inline))

/* Bytes of weights the prefetches of a one-row call run ahead of the
 * arithmetic (the best of 256, 1024 and 4096 on SmolLM2's q4_1 matrices). */
#ifndef WDOT_AHEAD
#define WDOT_AHEAD 256
#endif

/* Blocks b and b+1 (both == 0: block b alone, in the low 128 bits). */
KINLINE void KERNEL(weights)(int q4_1, const uint8_t *row, size_t b, int both, __m256i w[4]) {
    if (q4_1) {
        const uint8_t *p = row + 16 * b;
        __m256i v = both ? _mm256_loadu_si256((const __m256i *)(const void *)p)
                         : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)p));
        const __m256i low4 = _mm256_set1_epi16(15);
        w[0] = _mm256_and_si256(v, low4);                        /* elements 2j */
        w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  /* 2j + 16 */
        w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);  /* 2j + 1 */
        w[3] = _mm256_srli_epi16(v, 12);                         /* 2j + 17 */
    } else {
        const __m128i *p = (const __m128i *)(const void *)(row + 32 * b);
        __m256i lo = _mm256_zextsi128_si256(_mm_loadu_si128(p));     /* elements 0-15 */
        __m256i hi = _mm256_zextsi128_si256(_mm_loadu_si128(p + 1)); /* 16-31 */
        if (both) {
            lo = _mm256_inserti128_si256(lo, _mm_loadu_si128(p + 2), 1);
            hi = _mm256_inserti128_si256(hi, _mm_loadu_si128(p + 3), 1);
        }
        w[0] = _mm256_srai_epi16(_mm256_slli_epi16(lo, 8), 8);
        w[1] = _mm256_srai_epi16(_mm256_slli_epi16(hi, 8), 8);
        w[2] = _mm256_srai_epi16(lo, 8);
        w[3] = _mm256_srai_epi16(hi, 8);
    }
}

/* acc[t] += the pair's (or lone block's) products for token first+t, times
 * the lanes `lanes` of sd[t]. */
KINLINE void KERNEL(add_pair)(int q4_1, const uint8_t *row, const wqvec *x, size_t first,
                              size_t n, size_t b, int both, __m256i lanes, const __m256 *sd,
                              __m256 *acc) {
    __m256i w[4];
    KERNEL(weights)(q4_1, row, b, both, w);
#pragma GCC unroll 4
    for (size_t t = 0; t < n; t++) {
        const int16_t *q = x->q + (first + t) * x->cols + 32 * b;
        __m256i dot;
        if (both) {
            const __m256i *v = (const __m256i *)(const void *)q;
            dot = DOT4(w[0], w[1], w[2], w[3], _mm256_loadu_si256(v), _mm256_loadu_si256(v + 1),
                       _mm256_loadu_si256(v + 2), _mm256_loadu_si256(v + 3));
        } else {
            const __m128i *v = (const __m128i *)(const void *)q;
            dot = DOT4(w[0], w[1], w[2], w[3], _mm256_zextsi128_si256(_mm_loadu_si128(v)),
                       _mm256_zextsi128_si256(_mm_loadu_si128(v + 1)),
                       _mm256_zextsi128_si256(_mm_loadu_si128(v + 2)),
                       _mm256_zextsi128_si256(_mm_loadu_si128(v + 3)));
        }
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(sd[t], lanes),
                                 acc[t]);
    }
}

/* Both formats; min is NULL for q8.  `rows` consecutive rows (row_bytes
 * apart, their scales and minima blocks apart) against n tokens, rows * n
 * <= WDOT_TOKENS: out[r + t * out_stride].  Always inlined, so that the
 * calls below get a copy for each format and shape, whose accumulators stay
 * in registers.  Several rows a call, for one token, spread a row's fixed
 * costs (short rows have few blocks) and give the CPU independent work; a
 * row and token get the same operations in any shape. */
KINLINE void KERNEL(blocked)(int q4_1, const uint8_t *row, size_t row_bytes, const float *scale,
                             const float *min, size_t rows, const wqvec *x, size_t first,
                             size_t n, float *out, size_t out_stride) {
    size_t blocks = x->cols / 32;
    __m256 even[WDOT_TOKENS], odd[WDOT_TOKENS], sd[WDOT_TOKENS];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    /* lanes 0-3 from block i, 4-7 from block i+1 */
    const __m256i pair = _mm256_srli_epi32(lane, 2);
#pragma GCC unroll 4
    for (size_t k = 0; k < rows * n; k++) even[k] = odd[k] = sd[k] = _mm256_setzero_ps();
    for (size_t b = 0; b < blocks; b += 8) {
        size_t count = blocks - b < 8 ? blocks - b : 8, i = 0;
        __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), lane);
#pragma GCC unroll 4
        for (size_t r = 0; r < rows; r++) {
            const float *scale_r = scale + r * blocks, *min_r = q4_1 ? min + r * blocks : NULL;
            __m256 s = _mm256_maskload_ps(scale_r + b, lanes);
            /* Rows are short (18 blocks for 576 columns): ask for the bytes of
             * the rows the next call takes now, so that their loads overlap
             * this call's arithmetic instead of following it (a prefetch past
             * the end of the matrix is harmless). */
            size_t ahead_rows = rows > 1 ? rows : 0;
            const char *ahead = (const char *)(row + (r + ahead_rows) * row_bytes + (q4_1 ? 16 : 32) * b);
            if (!ahead_rows) ahead += WDOT_AHEAD;
            for (int line = 0; line < (q4_1 ? 2 : 4); line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
            size_t ahead_blocks = ahead_rows ? ahead_rows * blocks : WDOT_AHEAD / (q4_1 ? 16 : 32);
            _mm_prefetch((const char *)(scale_r + b + ahead_blocks), _MM_HINT_T0);
            if (q4_1) _mm_prefetch((const char *)(min_r + b + ahead_blocks), _MM_HINT_T0);
#pragma GCC unroll 4
            for (size_t t = 0; t < n; t++) {
                size_t at = (first + t) * blocks + b;
                sd[r * n + t] = _mm256_mul_ps(s, _mm256_maskload_ps(x->d + at, lanes));
                if (q4_1)
                    odd[r * n + t] = _mm256_fmadd_ps(_mm256_maskload_ps(min_r + b, lanes),
                                                     _mm256_maskload_ps(x->sum + at, lanes),
                                                     odd[r * n + t]);
            }
        }
        for (; i + 4 <= count; i += 4)
#pragma GCC unroll 4
            for (size_t r = 0; r < rows; r++) {
                const uint8_t *row_r = row + r * row_bytes;
                KERNEL(add_pair)(q4_1, row_r, x, first, n, b + i, 1,
                                 _mm256_add_epi32(pair, _mm256_set1_epi32((int)i)), sd + r * n,
                                 even + r * n);
                KERNEL(add_pair)(q4_1, row_r, x, first, n, b + i + 2, 1,
                                 _mm256_add_epi32(pair, _mm256_set1_epi32((int)i + 2)), sd + r * n,
                                 odd + r * n);
            }
        if (i + 2 <= count) {
#pragma GCC unroll 4
            for (size_t r = 0; r < rows; r++)
                KERNEL(add_pair)(q4_1, row + r * row_bytes, x, first, n, b + i, 1,
                                 _mm256_add_epi32(pair, _mm256_set1_epi32((int)i)), sd + r * n,
                                 even + r * n);
            i += 2;
        }
        if (i < count)
#pragma GCC unroll 4
            for (size_t r = 0; r < rows; r++)
                KERNEL(add_pair)(q4_1, row + r * row_bytes, x, first, n, b + i, 0,
                                 _mm256_set1_epi32((int)i), sd + r * n, odd + r * n);
    }
#pragma GCC unroll 4
    for (size_t r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (size_t t = 0; t < n; t++)
            out[r + t * out_stride] = wsimd_hsum(_mm256_add_ps(even[r * n + t], odd[r * n + t]));
}

/* One copy per token count, each with its sums in registers. */
KTARGET static void KERNEL(q4_1)(const uint8_t *nib, const float *scale, const float *min,
                                 const wqvec *x, size_t first, size_t n, float *out,
                                 size_t out_stride) {
    switch (n) {
    case 1: KERNEL(blocked)(1, nib, 0, scale, min, 1, x, first, 1, out, out_stride); break;
    case 2: KERNEL(blocked)(1, nib, 0, scale, min, 1, x, first, 2, out, out_stride); break;
    case 3: KERNEL(blocked)(1, nib, 0, scale, min, 1, x, first, 3, out, out_stride); break;
    default: KERNEL(blocked)(1, nib, 0, scale, min, 1, x, first, WDOT_TOKENS, out, out_stride);
    }
}

KTARGET static void KERNEL(q8)(const int8_t *codes, const float *scale, const wqvec *x,
                               size_t first, size_t n, float *out, size_t out_stride) {
    const uint8_t *row = (const uint8_t *)codes;
    switch (n) {
    case 1: KERNEL(blocked)(0, row, 0, scale, NULL, 1, x, first, 1, out, out_stride); break;
    case 2: KERNEL(blocked)(0, row, 0, scale, NULL, 1, x, first, 2, out, out_stride); break;
    case 3: KERNEL(blocked)(0, row, 0, scale, NULL, 1, x, first, 3, out, out_stride); break;
    default: KERNEL(blocked)(0, row, 0, scale, NULL, 1, x, first, WDOT_TOKENS, out, out_stride);
    }
}

/* Rows [0, rows) for one token, WDOT_TOKENS rows a call. */
KTARGET static void KERNEL(rows)(int q4_1, const uint8_t *data, const float *scale,
                                 const float *min, size_t rows, const wqvec *x, size_t token,
                                 float *out) {
    size_t blocks = x->cols / 32, row_bytes = blocks * (q4_1 ? 16 : 32), r = 0;
    for (; r + WDOT_TOKENS <= rows; r += WDOT_TOKENS) {
        const float *m = q4_1 ? min + r * blocks : NULL;
        if (q4_1)
            KERNEL(blocked)(1, data + r * row_bytes, row_bytes, scale + r * blocks, m, WDOT_TOKENS, x,
                            token, 1, out + r, 0);
        else
            KERNEL(blocked)(0, data + r * row_bytes, row_bytes, scale + r * blocks, m, WDOT_TOKENS, x,
                            token, 1, out + r, 0);
    }
    for (; r < rows; r++) {
        const float *m = q4_1 ? min + r * blocks : NULL;
        if (q4_1)
            KERNEL(blocked)(1, data + r * row_bytes, row_bytes, scale + r * blocks, m, 1, x, token, 1,
                            out + r, 0);
        else
            KERNEL(blocked)(0, data + r * row_bytes, row_bytes, scale + r * blocks, m, 1, x, token, 1,
                            out + r, 0);
    }
}

#undef KINLINE
