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
 *
 * Then the same from memory, as a decode step meets its weights: the
 * products of a SmolLM2 step's shapes, each call on the next of copies
 * spanning COLD_BYTES (past any cache), beside a plain read of the same
 * bytes through the pool.  Where the read itself gains little from a second
 * thread, the limit is how fast a short run of memory streams in, not the
 * product's code.
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
#define COLD_BYTES ((size_t)256 << 20)
#define COLD_CALLS 40
#define WIDEST 1536 /* the widest input of a step's products: the FFN's down */

/* A matrix's bytes in rows: row r is the r-th slice of the whole block
 * (nibbles, scales and minima alike), one word of each cache line summed:
 * every line comes in from memory, and the adds never keep it waiting. */
typedef struct {
    const uint8_t *data;
    size_t bytes, rows;
    volatile uint64_t sums[WPOOL_MAX_THREADS * 8]; /* a cache line a thread */
} reading;

static void read_rows(void *arg, size_t begin, size_t end) {
    reading *r = arg;
    const uint64_t *p = (const uint64_t *)(const void *)(r->data + begin * r->bytes / r->rows / 8 * 8);
    const uint64_t *stop = (const uint64_t *)(const void *)(r->data + end * r->bytes / r->rows / 8 * 8);
    uint64_t sum = 0;
    for (; p < stop; p += 8) sum += *p;
    r->sums[wpool_self() * 8] += sum;
}

/* Median microseconds a call, COLD_CALLS calls back to back a round, each on
 * the next copy; the one-thread and the split calls take turns by round. */
typedef struct {
    double product[2], read[2];
} cold_times;

static cold_times time_cold(wpool *pools[2], const wmat *copies, size_t n_copies, size_t bytes,
                            float *out, const float *x, wqvec *xq) {
    double product[2][ROUNDS], read[2][ROUNDS];
    reading r = {.bytes = bytes, .rows = copies[0].rows};
    size_t next = 0;
    for (int round = 0; round < ROUNDS; round++) {
        for (int p = 0; p < 2; p++) {
            double started = wsys_now_ms();
            for (int i = 0; i < COLD_CALLS; i++, next = (next + 1) % n_copies)
                wmat_mul(pools[p], out, &copies[next], x, 1, xq);
            product[p][round] = (wsys_now_ms() - started) * 1000.0 / COLD_CALLS;
            started = wsys_now_ms();
            for (int i = 0; i < COLD_CALLS; i++, next = (next + 1) % n_copies) {
                r.data = copies[next].data;
                wpool_run(pools[p], r.rows, r.rows * copies[next].cols, read_rows, &r);
            }
            read[p][round] = (wsys_now_ms() - started) * 1000.0 / COLD_CALLS;
        }
    }
    cold_times t;
    for (int p = 0; p < 2; p++) {
        qsort(product[p], ROUNDS, sizeof(double), ascending);
        qsort(read[p], ROUNDS, sizeof(double), ascending);
        t.product[p] = product[p][ROUNDS / 2];
        t.read[p] = read[p][ROUNDS / 2];
    }
    return t;
}

/* scales and minima are floats: keep them small numbers, not random bits */
static void sane_floats(uint8_t *matrix, size_t rows, size_t cols) {
    float *floats = (float *)(void *)(matrix + rows * cols / 2);
    for (size_t i = 0; i < 2 * rows * cols / 32; i++) floats[i] = 0.01f * (float)(i % 7);
}

/* The second table: a decode step's q4_1 shapes from memory, with main's
 * buffers (out and x for WIDEST values, xq's room for WIDEST codes). */
static int cold_table(wpool *one, wpool *many, int threads, float *out, float *x, wqvec xq) {
    static const size_t shapes[][2] = {{576, 576}, {960, 576}, {1536, 576}, {576, 1536}};
    const wquant q4_1 = {WQ_Q4_1, 32};
    uint8_t *data = malloc(COLD_BYTES);
    wmat *copies = malloc(COLD_BYTES / wquant_bytes(q4_1, 576, 576) * sizeof *copies);
    if (!data || !copies) return 1;
    for (size_t i = 0; i < COLD_BYTES; i++) data[i] = (uint8_t)rand();
    for (size_t i = 0; i < WIDEST; i++) x[i] = (float)(i % 13) - 6.0f;
    wpool *pools[2] = {one, many};
    printf("\nfrom memory (each call on the next of %zu MB of copies), us a call, 1 thread"
           " and split over %d:\n", COLD_BYTES >> 20, threads);
    printf("%11s %8s  %9s %9s %6s  %9s %9s %6s\n", "rows x cols", "KB", "product 1", "split",
           "gain", "read 1", "split", "gain");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        size_t rows = shapes[s][0], cols = shapes[s][1];
        size_t bytes = wquant_bytes(q4_1, rows, cols), stride = (bytes + 63) / 64 * 64;
        size_t n_copies = COLD_BYTES / stride;
        for (size_t c = 0; c < n_copies; c++) {
            sane_floats(data + c * stride, rows, cols);
            copies[c] = wmat_view(q4_1, rows, cols, data + c * stride);
        }
        xq.cols = cols;
        cold_times t = time_cold(pools, copies, n_copies, bytes, out, x, &xq);
        printf("%5zu x %4zu %8.0f  %9.2f %9.2f %5.2fx  %9.2f %9.2f %5.2fx\n", rows, cols,
               bytes / 1024.0, t.product[0], t.product[1], t.product[0] / t.product[1],
               t.read[0], t.read[1], t.read[0] / t.read[1]);
    }
    free(data);
    free(copies);
    return 0;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    const size_t cols = 576; /* SmolLM2's hidden size */
    const wquant q4_1 = {WQ_Q4_1, 32};
    wpool *one = wpool_open(1, NULL), *many = wpool_open(threads, NULL);
    size_t max_rows = 8192;
    uint8_t *data = malloc(wquant_bytes(q4_1, max_rows, cols));
    float *x = malloc(WIDEST * sizeof *x), *out = malloc(max_rows * sizeof *out);
    int16_t *codes = malloc(WIDEST * sizeof *codes);
    float *d = malloc(WIDEST / 32 * sizeof *d), *sums = malloc(WIDEST / 32 * sizeof *sums);
    if (!one || !many || !data || !x || !out || !codes || !d || !sums) return 1;
    wqvec xq = {codes, d, sums, cols};
    srand(1);
    for (size_t i = 0; i < wquant_bytes(q4_1, max_rows, cols); i++) data[i] = (uint8_t)rand();
    for (size_t rows = 8; rows <= max_rows; rows *= 2) {
        wmat w = wmat_view(q4_1, rows, cols, data);
        sane_floats(data, rows, cols);
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
    int failed = cold_table(one, many, threads, out, x, xq);
    wpool_close(one);
    wpool_close(many);
    free(data);
    free(x);
    free(out);
    free(codes);
    free(d);
    free(sums);
    return failed;
}
