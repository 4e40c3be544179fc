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
    float *const *outs;
    const wmat *const *ws;
    size_t count; /* matrices, their rows one after another in the job */
    const float *x;
    const wqvec *xq;
    size_t n;
} job;

/* One row of w against tokens [t, t + count) of the chunk. */
static void row_tokens(const job *j, const wmat *w, float *out_w, size_t r, size_t t, size_t count) {
    size_t cols = w->cols, blocks = cols / 32, rows = w->rows;
    float *out = out_w + t * rows + r;
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
static void row_tokens_grouped(const job *j, const wmat *w, float *out, size_t r) {
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
        out[t * w->rows + r] = sum;
    }
}

/* The tokens whose activations (about 32 KB of them) stay in the core's
 * first-level cache while a thread's rows pass over them: a multiple of
 * WDOT_TOKENS. */
static size_t token_tile(size_t cols) {
    size_t tile = (32768 / 2 / cols) / WDOT_TOKENS * WDOT_TOKENS;
    return tile < WDOT_TOKENS ? WDOT_TOKENS : tile > 64 ? 64 : tile;
}

/* Rows [begin, end) of w. */
static void mul_segment(const job *j, const wmat *w, float *out, size_t begin, size_t end) {
    size_t n = j->n, tile = token_tile(w->cols);
    if (w->q.kind == WQ_Q8 && w->q.group != 32) {
        for (size_t r = begin; r < end; r++) row_tokens_grouped(j, w, out, r);
        return;
    }
    if (n == 1 && w->q.kind != WQ_F32) { /* a decode step: several rows a call */
        size_t blocks = w->cols / 32;
        const float *scales = (const float *)(const void *)w->scales + begin * blocks;
        int q4_1 = w->q.kind == WQ_Q4_1;
        const float *minima = q4_1 ? (const float *)(const void *)w->minima + begin * blocks : NULL;
        wdot_rows(q4_1, w->data + begin * blocks * (q4_1 ? 16 : 32), scales, minima, end - begin, j->xq,
                  0, out + begin);
        return;
    }
    for (size_t t0 = 0; t0 < n; t0 += tile) {
        size_t t1 = t0 + tile < n ? t0 + tile : n;
        for (size_t r = begin; r < end; r++)
            for (size_t t = t0; t < t1; t += WDOT_TOKENS)
                row_tokens(j, w, out, r, t, t1 - t < WDOT_TOKENS ? t1 - t : WDOT_TOKENS);
    }
}

/* Rows [begin, end) of the job, counted across its matrices. */
static void mul_rows(void *arg, size_t begin, size_t end) {
    const job *j = arg;
    for (size_t m = 0, base = 0; m < j->count && base < end; base += j->ws[m]->rows, m++) {
        size_t lo = begin > base ? begin - base : 0, rows = j->ws[m]->rows;
        size_t hi = end - base < rows ? end - base : rows;
        if (lo < hi) mul_segment(j, j->ws[m], j->outs[m], lo, hi);
    }
}

static int quantised(const wmat *w) { return w->q.kind != WQ_F32 && w->q.group == 32; }

void wmat_mul_many(wpool *pool, float *const *outs, const wmat *const *ws, size_t count,
                   const float *x, size_t n, wqvec *xq) {
    WPROF_START(started);
    size_t rows = 0, work = 0;
    int quantise = 0;
    for (size_t m = 0; m < count; m++) {
        rows += ws[m]->rows;
        work += ws[m]->rows * ws[m]->cols * n;
        quantise |= quantised(ws[m]);
    }
    if (quantise) {
        wdot_quantize(x, n, ws[0]->cols, xq);
        WPROF_ADD(WPROF_QUANTIZE, started);
    }
    WPROF_START(multiplied);
    job j = {.outs = outs, .ws = ws, .count = count, .x = x, .xq = xq, .n = n};
    wpool_run(pool, rows, work, mul_rows, &j);
    WPROF_ADD(ws[0]->q.kind == WQ_Q4_1 ? WPROF_MATMUL_Q4_1
              : ws[0]->q.kind == WQ_Q8 ? WPROF_MATMUL_Q8
                                       : WPROF_MATMUL_F32,
              multiplied);
}

void wmat_mul(wpool *pool, float *out, const wmat *w, const float *x, size_t n, wqvec *xq) {
    wmat_mul_many(pool, &out, &w, 1, x, n, xq);
}
