/*
 * bandwidth.c -- the machine's memory bandwidth, the ceiling of decode.
 *
 *     bandwidth THREADS [MB]
 *
 * Built and run by bench/roofline.py.  Each of THREADS threads gets its own
 * MB megabytes (default 256: far past any cache) and, all starting at once,
 * reads it (a sum of 64-bit words, as a matmul streams its weights) or
 * copies it into a second buffer (memcpy).  Prints one JSON line per test:
 * the best of ten passes in GB/s, counting a copy's bytes once read and
 * once written.
 */
#define _POSIX_C_SOURCE 200809L /* pthread barriers, clock_gettime */

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    uint64_t *src, *dst;
    size_t words;
    int copy;
    pthread_barrier_t *start;
    uint64_t sum; /* kept, so the reads are not optimised away */
} lane;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Four sums, so the loop is bound by loads, not by one chain of adds. */
static uint64_t read_words(const uint64_t *p, size_t n) {
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= n; i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
    }
    return a + b + c + d;
}

static void *run_lane(void *arg) {
    lane *l = arg;
    pthread_barrier_wait(l->start);
    if (l->copy) memcpy(l->dst, l->src, l->words * sizeof *l->src);
    else l->sum += read_words(l->src, l->words);
    return NULL;
}

/* GB/s of one pass of every lane at once. */
static double pass(lane *lanes, int threads, int copy) {
    pthread_t ids[256];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    for (int i = 0; i < threads; i++) {
        lanes[i].copy = copy;
        lanes[i].start = &start;
        pthread_create(&ids[i], NULL, run_lane, &lanes[i]);
    }
    pthread_barrier_wait(&start);
    double started = now_s();
    for (int i = 0; i < threads; i++) pthread_join(ids[i], NULL);
    double seconds = now_s() - started;
    pthread_barrier_destroy(&start);
    double bytes = (double)threads * (double)lanes[0].words * 8.0 * (copy ? 2.0 : 1.0);
    return bytes / seconds / 1e9;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    size_t mb = argc > 2 ? (size_t)atoi(argv[2]) : 256;
    if (threads < 1 || threads > 256 || mb < 1) {
        fprintf(stderr, "usage: bandwidth THREADS [MB]\n");
        return 2;
    }
    lane lanes[256];
    size_t words = mb * 1024 * 1024 / 8;
    for (int i = 0; i < threads; i++) {
        lanes[i] = (lane){.src = malloc(words * 8), .dst = malloc(words * 8), .words = words};
        if (!lanes[i].src || !lanes[i].dst) return 1;
        memset(lanes[i].src, i + 1, words * 8); /* touch every page before timing */
        memset(lanes[i].dst, 0, words * 8);
    }
    const char *names[2] = {"read", "copy"};
    for (int copy = 0; copy < 2; copy++) {
        double best = 0;
        for (int rep = 0; rep < 10; rep++) {
            double gbps = pass(lanes, threads, copy);
            if (gbps > best) best = gbps;
        }
        printf("{\"test\": \"%s\", \"threads\": %d, \"gb_per_s\": %.2f}\n", names[copy], threads, best);
    }
    uint64_t sum = 0;
    for (int i = 0; i < threads; i++) {
        sum += lanes[i].sum;
        free(lanes[i].src);
        free(lanes[i].dst);
    }
    return sum == 1; /* never: the sum only has to be used */
}
