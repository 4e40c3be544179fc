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
