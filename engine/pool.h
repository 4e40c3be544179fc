/*
 * pool.h -- the process-wide compute thread pool.
 *
 * Work is split by output rows: rows [0, n) are cut into one contiguous
 * chunk per thread and each row is computed by exactly one thread with the
 * same code, so results are bit-identical whatever the thread count.
 */
#ifndef WASTE_POOL_H
#define WASTE_POOL_H

#include <stddef.h>
#include "sys.h"

/* Computes rows [begin, end) of some operation described by arg. */
typedef void (*wpool_rows_fn)(void *arg, size_t begin, size_t end);

/* Who does the work: n_threads in total (the caller is one of them); helper
 * thread i is pinned to cpus->ids[i % cpus->n] when cpus->n > 0. */
typedef struct {
    int n_threads;
    const wcpus *cpus;
} wpool_team;

/* Run fn over rows [0, n_rows) and return when every row is done.  work is
 * the job's multiply-add count: small jobs stay on the calling thread. */
void wpool_run(const wpool_team *team, size_t n_rows, size_t work, wpool_rows_fn fn, void *arg);

/* Helper threads the pool can start; n_threads above this is clamped. */
#define WPOOL_MAX_THREADS 64

#endif
