#include "matmul.h"

#include <string.h>

#include "prof.h"

wmat wmat_view(wquant q, size_t rows, size_t cols, const uint8_t *p) {
    size_t n = rows * cols;
    wmat w = {.q = q, .rows = rows, .cols = cols, .data = p};
    if (q.kind == WQ_Q8) w.scales = p + n;
    if (q.kind == WQ_Q4_1) {
        w.scales = p + n / 2;
        w.minima = w.scales + 4 * (n / q.group);
    }
    return w;
}

static float f32_at(const uint8_t *p, size_t i) {
    float v;
    memcpy(&v, p + 4 * i, sizeof v);
    return v;
}

void wmat_dequant_row(const wmat *w, size_t row, float *out) {
    size_t c = w->cols, base = row * c;
    for (size_t i = 0; i < c; i++) {
        size_t e = base + i;
        switch (w->q.kind) {
        case WQ_Q8: out[i] = (float)((const int8_t *)w->data)[e] * f32_at(w->scales, e / w->q.group); break;
        case WQ_Q4_1: {
            /* block of 32: byte j holds element j (low nibble) and j+16 (high) */
            size_t block = e / 32, j = e % 32;
            uint8_t byte = w->data[block * 16 + j % 16];
            int code = j < 16 ? byte & 15 : byte >> 4;
            out[i] = f32_at(w->scales, block) * (float)code + f32_at(w->minima, block);
            break;
        }
        default: out[i] = f32_at(w->data, e);
        }
    }
}

typedef struct {
    float *out;
    const wmat *w;
    const float *x;
    const wqvec *xq;
    size_t n;
} job;

/* One row against tokens [t, t + count) of the chunk. */
static void row_tokens(const job *j, size_t r, size_t t, size_t count) {
    const wmat *w = j->w;
    size_t cols = w->cols, blocks = cols / 32, rows = w->rows;
    float *out = j->out + t * rows + r;
    if (w->q.kind == WQ_F32) {
        wdot_f32((const float *)(const void *)w->data + r * cols, j->x + t * cols, cols, count, out,
                 rows);
    } else if (w->q.kind == WQ_Q4_1) {
        const float *scales = (const float *)(const void *)w->scales + r * blocks;
        const float *minima = (const float *)(const void *)w->minima + r * blocks;
        wdot_q4_1(w->data + r * blocks * 16, scales, minima, j->xq, t, count, out, rows);
    } else {
        const float *scales = (const float *)(const void *)w->scales + r * blocks;
        wdot_q8((const int8_t *)w->data + r * cols, scales, j->xq, t, count, out, rows);
    }
}

/* q8 with groups other than 32: float activations, a scale per group. */
static void row_tokens_grouped(const job *j, size_t r) {
    const wmat *w = j->w;
    size_t cols = w->cols, group = w->q.group, groups = cols / group;
    const int8_t *row = (const int8_t *)w->data + r * cols;
    for (size_t t = 0; t < j->n; t++) {
        const float *x = j->x + t * cols;
        float sum = 0.0f;
        for (size_t g = 0; g < groups; g++) {
            float part = 0.0f;
            for (size_t k = 0; k < group; k++) part += (float)row[g * group + k] * x[g * group + k];
            sum += part * f32_at(w->scales, r * groups + g);
        }
        j->out[t * w->rows + r] = sum;
    }
}

/* The tokens whose activations (about 32 KB of them) stay in the core's
 * first-level cache while a thread's rows pass over them: a multiple of
 * WDOT_TOKENS. */
static size_t token_tile(size_t cols) {
    size_t tile = (32768 / 2 / cols) / WDOT_TOKENS * WDOT_TOKENS;
    return tile < WDOT_TOKENS ? WDOT_TOKENS : tile > 64 ? 64 : tile;
}

static void mul_rows(void *arg, size_t begin, size_t end) {
    const job *j = arg;
    size_t n = j->n, tile = token_tile(j->w->cols);
    if (j->w->q.kind == WQ_Q8 && j->w->q.group != 32) {
        for (size_t r = begin; r < end; r++) row_tokens_grouped(j, r);
        return;
    }
    if (n == 1 && j->w->q.kind != WQ_F32) { /* a decode step: several rows a call */
        const wmat *w = j->w;
        size_t blocks = w->cols / 32;
        const float *scales = (const float *)(const void *)w->scales + begin * blocks;
        int q4_1 = w->q.kind == WQ_Q4_1;
        const float *minima = q4_1 ? (const float *)(const void *)w->minima + begin * blocks : NULL;
        wdot_rows(q4_1, w->data + begin * blocks * (q4_1 ? 16 : 32), scales, minima, end - begin, j->xq,
                  0, j->out + begin);
        return;
    }
    for (size_t t0 = 0; t0 < n; t0 += tile) {
        size_t t1 = t0 + tile < n ? t0 + tile : n;
        for (size_t r = begin; r < end; r++)
            for (size_t t = t0; t < t1; t += WDOT_TOKENS)
                row_tokens(j, r, t, t1 - t < WDOT_TOKENS ? t1 - t : WDOT_TOKENS);
    }
}

void wmat_mul(wpool *pool, float *out, const wmat *w, const float *x, size_t n,
              wqvec *xq) {
    WPROF_START(started);
    if (w->q.kind != WQ_F32 && w->q.group == 32) {
        wdot_quantize(x, n, w->cols, xq);
        WPROF_ADD(WPROF_QUANTIZE, started);
    }
    WPROF_START(multiplied);
    job j = {.out = out, .w = w, .x = x, .xq = xq, .n = n};
    wpool_run(pool, w->rows, w->rows * w->cols * n, mul_rows, &j);
    WPROF_ADD(w->q.kind == WQ_Q4_1 ? WPROF_MATMUL_Q4_1 : w->q.kind == WQ_Q8 ? WPROF_MATMUL_Q8
                                                                           : WPROF_MATMUL_F32,
              multiplied);
}
