/*
 * pool_threshold.c -- what a job must weigh before a second thread pays.
 *
 *     pool_threshold THREADS
 *
 * Built by bench/engine_threads.py against engine/ with the pool's work
 * threshold at 0, so every job is split.  For q4_1 matrix-vector products
 * of growing size (a decode step's jobs), prints the median time per
 * product on one thread and on THREADS threads with the helpers hot (back to
 * back, as in a decode step) and the speedup: the break-even is where it
 * crosses 1.
 */
#include <stdio.h>
#include <stdlib.h>

#include "matmul.h"
#include "sys.h"

/* Microseconds per product of `calls` products back to back. */
static double time_product(wpool *pool, float *out, const wmat *w, const float *x, wqvec *xq,
                           int calls) {
    double started = wsys_now_ms();
    for (int i = 0; i < calls; i++) wmat_mul(pool, out, w, x, 1, xq);
    return (wsys_now_ms() - started) * 1000.0 / calls;
}

static int ascending(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define ROUNDS 15

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    const size_t cols = 576; /* SmolLM2's hidden size */
    const wquant q4_1 = {WQ_Q4_1, 32};
    wpool *one = wpool_open(1, NULL), *many = wpool_open(threads, NULL);
    size_t max_rows = 8192;
    uint8_t *data = malloc(wquant_bytes(q4_1, max_rows, cols));
    float *x = malloc(cols * sizeof *x), *out = malloc(max_rows * sizeof *out);
    int16_t *codes = malloc(cols * sizeof *codes);
    float *d = malloc(cols / 32 * sizeof *d), *sums = malloc(cols / 32 * sizeof *sums);
    if (!one || !many || !data || !x || !out || !codes || !d || !sums) return 1;
    wqvec xq = {codes, d, sums, cols};
    srand(1);
    for (size_t i = 0; i < wquant_bytes(q4_1, max_rows, cols); i++) data[i] = (uint8_t)rand();
    /* scales and minima are floats: keep them small numbers, not random bits */
    for (size_t rows = 8; rows <= max_rows; rows *= 2) {
        wmat w = wmat_view(q4_1, rows, cols, data);
        float *floats = (float *)(void *)(data + rows * cols / 2);
        for (size_t i = 0; i < 2 * rows * cols / 32; i++) floats[i] = 0.01f * (float)(i % 7);
        for (size_t i = 0; i < cols; i++) x[i] = (float)(i % 13) - 6.0f;
        int calls = (int)(4000000 / (rows * cols)) + 50;
        /* The two take turns, so a busy machine slows both alike; medians. */
        double alone[ROUNDS], split[ROUNDS];
        for (int round = 0; round < ROUNDS; round++) {
            alone[round] = time_product(one, out, &w, x, &xq, calls);
            split[round] = time_product(many, out, &w, x, &xq, calls);
        }
        qsort(alone, ROUNDS, sizeof *alone, ascending);
        qsort(split, ROUNDS, sizeof *split, ascending);
        printf("%8zu multiply-adds: %8.2f us on 1 thread, %8.2f us on %d: %5.2fx\n", rows * cols,
               alone[ROUNDS / 2], split[ROUNDS / 2], threads, alone[ROUNDS / 2] / split[ROUNDS / 2]);
    }
    wpool_close(one);
    wpool_close(many);
    free(data);
    free(x);
    free(out);
    free(codes);
    free(d);
    free(sums);
    return 0;
}
