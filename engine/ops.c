#include "ops.h"

#include <math.h>
#include <string.h>

void wops_rmsnorm(float *out, const float *x, const float *weight, size_t n, float eps) {
    float ss = 0.0f;
    for (size_t i = 0; i < n; i++) ss += x[i] * x[i];
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (size_t i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

typedef struct {
    float *out;
    const float *w, *x;
    const int8_t *q;
    const uint8_t *scales;
    size_t group, cols;
} matvec_job;

static void matvec_rows(void *arg, size_t begin, size_t end) {
    const matvec_job *j = arg;
    for (size_t r = begin; r < end; r++) {
        const float *row = j->w + r * j->cols;
        float sum = 0.0f;
        for (size_t c = 0; c < j->cols; c++) sum += row[c] * j->x[c];
        j->out[r] = sum;
    }
}

void wops_matvec(const wpool_team *team, float *out, const float *w, const float *x, size_t rows,
                 size_t cols) {
    matvec_job j = {.out = out, .w = w, .x = x, .cols = cols};
    wpool_run(team, rows, rows * cols, matvec_rows, &j);
}

/* Each group's integer dot product is scaled once; groups never straddle a
 * row because the group size divides the row length. */
static void matvec_q8_rows(void *arg, size_t begin, size_t end) {
    const matvec_job *j = arg;
    size_t groups_per_row = j->cols / j->group;
    for (size_t r = begin; r < end; r++) {
        const int8_t *row = j->q + r * j->cols;
        float sum = 0.0f;
        for (size_t g = 0; g < groups_per_row; g++) {
            const int8_t *qg = row + g * j->group;
            const float *xg = j->x + g * j->group;
            float part = 0.0f;
            for (size_t k = 0; k < j->group; k++) part += (float)qg[k] * xg[k];
            float scale;
            memcpy(&scale, j->scales + 4 * (r * groups_per_row + g), sizeof scale);
            sum += part * scale;
        }
        j->out[r] = sum;
    }
}

void wops_matvec_q8(const wpool_team *team, float *out, const int8_t *q, const uint8_t *scales,
                    size_t group, const float *x, size_t rows, size_t cols) {
    matvec_job j = {.out = out, .x = x, .q = q, .scales = scales, .group = group, .cols = cols};
    wpool_run(team, rows, rows * cols, matvec_q8_rows, &j);
}

void wops_softmax(float *x, size_t n) {
    float max = x[0];
    for (size_t i = 1; i < n; i++)
        if (x[i] > max) max = x[i];
    float sum = 0.0f;
    for (size_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    for (size_t i = 0; i < n; i++) x[i] /= sum;
}

void wops_rope(float *v, size_t n_heads, size_t head_dim, uint32_t pos, float theta) {
    for (size_t i = 0; i < head_dim / 2; i++) {
        float freq = powf(theta, -(float)(2 * i) / (float)head_dim);
        float angle = (float)pos * freq;
        float c = cosf(angle), s = sinf(angle);
        for (size_t h = 0; h < n_heads; h++) {
            float *pair = v + h * head_dim + 2 * i;
            float a = pair[0], b = pair[1];
            pair[0] = a * c - b * s;
            pair[1] = a * s + b * c;
        }
    }
}

void wops_swiglu(float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) a[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
}

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

void wops_dequant_row(const wmat *w, size_t row, float *out) {
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

void wops_matmul(const wpool_team *team, float *out, const wmat *w, const float *x, wqvec *xq) {
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
