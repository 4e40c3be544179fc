#include "matmul.h"

#include <string.h>

#include "ops.h"

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
    const wqvec *x;
} qjob;

static void matmul_q4_1_rows(void *arg, size_t begin, size_t end) {
    const qjob *j = arg;
    size_t blocks = j->w->cols / 32;
    const float *scales = (const float *)(const void *)j->w->scales;
    const float *minima = (const float *)(const void *)j->w->minima;
    for (size_t r = begin; r < end; r++)
        j->out[r] = wdot_q4_1(j->w->data + r * blocks * 16, scales + r * blocks,
                              minima + r * blocks, j->x, blocks);
}

static void matmul_q8_rows(void *arg, size_t begin, size_t end) {
    const qjob *j = arg;
    size_t blocks = j->w->cols / 32;
    const float *scales = (const float *)(const void *)j->w->scales;
    for (size_t r = begin; r < end; r++)
        j->out[r] = wdot_q8((const int8_t *)j->w->data + r * j->w->cols, scales + r * blocks, j->x,
                            blocks);
}

void wmat_mul(const wpool_team *team, float *out, const wmat *w, const float *x, wqvec *xq) {
    size_t work = w->rows * w->cols;
    if (w->q.kind == WQ_F32) {
        wops_matvec(team, out, (const float *)(const void *)w->data, x, w->rows, w->cols);
        return;
    }
    if (w->q.group != 32) { /* q8g<G> with another group: float activations */
        wops_matvec_q8(team, out, (const int8_t *)w->data, w->scales, w->q.group, x, w->rows, w->cols);
        return;
    }
    wdot_quantize(x, w->cols, xq);
    qjob j = {.out = out, .w = w, .x = xq};
    wpool_run(team, w->rows, work, w->q.kind == WQ_Q4_1 ? matmul_q4_1_rows : matmul_q8_rows, &j);
}
