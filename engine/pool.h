/*
 * pool.h -- a context's compute threads.
 *
 * Each context owns a pool: n_threads in all, the thread that calls into
 * the context plus n_threads - 1 helpers, so two contexts never wait for
 * each other's jobs.  Their budgets add up: a host running contexts side by
 * side gives each its share of the cores (docs/engine.md, "Threads").
 *
 * Work is split by output rows: the threads claim runs of rows [0, n) one
 * at a time, long runs first and short ones as the job runs out, and each
 * row is computed by exactly one thread with the same code, so results are
 * bit-identical whatever the thread count and whoever ran which run.
 *
 * A decode step is hundreds of jobs of a few microseconds each, so helpers
 * poll for the next job for a while after each one and only sleep once the
 * context has been idle that long.
 */
#ifndef WASTE_POOL_H
#define WASTE_POOL_H

#include <stddef.h>
#include "sys.h"

/* Helper threads a pool can have; n_threads above this is clamped. */
#define WPOOL_MAX_THREADS 64

typedef struct wpool wpool;

/* Computes rows [begin, end) of some operation described by arg. */
typedef void (*wpool_rows_fn)(void *arg, size_t begin, size_t end);

/* A pool of n_threads threads in all (the caller of wpool_run is one of
 * them).  With cpus->n > 0, helper i runs on cpus->ids[i % cpus->n];
 * otherwise on the CPUs the process had when the library was loaded.
 * Fewer helpers when threads cannot be started; NULL when out of memory. */
wpool *wpool_open(int n_threads, const wcpus *cpus);

/* Stop and join the helpers and free the pool; NULL is a no-op. */
void wpool_close(wpool *pool);

/* Threads in all (helpers and the caller); 1 for a NULL pool. */
int wpool_threads(const wpool *pool);

/* The calling thread's place in its pool: 1 .. threads - 1 on a helper, 0 on
 * any other thread (the one that calls wpool_run among them).  A job's fn
 * indexes per-thread scratch with it. */
int wpool_self(void);

/* Run fn over rows [0, n_rows) and return when every row is done.  work is
 * the job's multiply-add count: small jobs stay on the calling thread, and
 * so does every job of a NULL pool.  One caller at a time per pool. */
void wpool_run(wpool *pool, size_t n_rows, size_t work, wpool_rows_fn fn, void *arg);

#endif
