#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "prof.h"

/* Jobs with fewer multiply-adds than this run on the caller alone: below
 * it the hand-off cost more than a second thread saved in every run of
 * bench/engine_threads.py (docs/engine.md, "Threads"). */
#ifndef WPOOL_WORK_THRESHOLD
#define WPOOL_WORK_THRESHOLD ((size_t)1 << 16)
#endif

/* How long an idle helper polls for the next job before it sleeps: enough
 * for the gaps between the jobs of a decode step on an idle machine, and no
 * more: a helper polling on a busy machine spends the CPU time the scheduler
 * would otherwise let it work with (bench/engine_threads.py). */
#ifndef WPOOL_SPIN_US
#define WPOOL_SPIN_US 10
#endif

/* Guided scheduling: each claim takes 1/CLAIM_SHARE of the rows still left
 * per thread, so a job starts in long runs (a thread streams through
 * contiguous weights) and ends in short ones (the last thread to finish
 * keeps the others waiting for less), and never less than a grain of
 * 1/GRAINS_PER_THREAD of a thread's share, so claims stay few.  A thread the
 * OS delays leaves its unclaimed rows to the others. */
#define CLAIM_SHARE 2
#define GRAINS_PER_THREAD 16

/* The job word: its generation in the high 32 bits, the helpers working on
 * it in the low ones.  An odd generation is a job open to join; the caller
 * closes it (makes the generation even) only when no helper is inside, so
 * the job's fields never change under a helper that joined. */
#define GEN(state) ((uint32_t)((state) >> 32))
#define OPEN(state) (GEN(state) & 1u)

struct wpool {
    int n_helpers; /* the caller is one more thread */
    pthread_t helpers[WPOOL_MAX_THREADS];
    wcpus cpus;

    _Atomic uint64_t state;
    /* The open job; written by the caller while no job is open. */
    wpool_rows_fn fn;
    void *arg;
    size_t n_rows, grain;
    atomic_size_t next_row;
#ifdef WASTE_PROFILE
    uint64_t opened; /* wprof_now() as the job opened */
#endif

    /* Idle helpers sleep here; the caller signals only when one does. */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_int sleepers;
    atomic_int stopping;
};

typedef struct {
    wpool *pool;
    int index;
} helper_start;

/* The mask threads had when the library was loaded, before any pinning:
 * where an unpinned helper runs. */
static wsys_mask home_mask;

__attribute__((constructor)) static void remember_home_mask(void) { wsys_mask_get(&home_mask); }

static _Thread_local int self_index; /* 0 outside a pool's helpers */

int wpool_self(void) { return self_index; }

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claim the next rows of the open job into [*begin, *end); 0 when none is
 * left. */
static int claim(wpool *pool, size_t *begin, size_t *end) {
    size_t at = atomic_load_explicit(&pool->next_row, memory_order_relaxed);
    for (;;) {
        if (at >= pool->n_rows) return 0;
        size_t left = pool->n_rows - at;
        size_t take = left / ((size_t)wpool_threads(pool) * CLAIM_SHARE);
        if (take < pool->grain) take = pool->grain;
        if (take >= 4) take &= ~(size_t)3; /* wdot_rows goes four rows a call */
        if (take > left) take = left;
        if (atomic_compare_exchange_weak_explicit(&pool->next_row, &at, at + take,
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *begin = at;
            *end = at + take;
            return 1;
        }
    }
}

/* Claim rows of the open job until none is left. */
static void claim_chunks(wpool *pool) {
    size_t begin, end;
    while (claim(pool, &begin, &end)) {
        WPROF_START(chunk_started);
        pool->fn(pool->arg, begin, end);
        WPROF_ADD(self_index ? WPROF_CHUNK_HELPER : WPROF_CHUNK_CALLER, chunk_started);
    }
}

/* The state once a job other than generation `seen` is open, or 0 when the
 * pool is stopping: poll for WPOOL_SPIN_US, then sleep. */
static uint64_t next_job(wpool *pool, uint32_t seen) {
    double deadline = wsys_now_ms() + WPOOL_SPIN_US / 1000.0;
    for (unsigned spins = 1;; spins++) {
        uint64_t s = atomic_load(&pool->state);
        if (OPEN(s) && GEN(s) != seen) return s;
        if (atomic_load_explicit(&pool->stopping, memory_order_relaxed)) return 0;
        cpu_relax();
        if (spins % 16 == 0 && wsys_now_ms() > deadline) break;
    }
    pthread_mutex_lock(&pool->lock);
    atomic_fetch_add(&pool->sleepers, 1);
    uint64_t s;
    /* sleepers is raised before this look at the state and the caller looks
     * at sleepers after publishing: one of the two sees the other. */
    while (!((s = atomic_load(&pool->state)), OPEN(s) && GEN(s) != seen) &&
           !atomic_load(&pool->stopping))
        pthread_cond_wait(&pool->wake, &pool->lock);
    atomic_fetch_sub(&pool->sleepers, 1);
    pthread_mutex_unlock(&pool->lock);
    return atomic_load(&pool->stopping) ? 0 : s;
}

static void *helper_main(void *p) {
    helper_start start = *(helper_start *)p;
    free(p);
    wpool *pool = start.pool;
    self_index = start.index + 1;
    wsys_mask mask = home_mask; /* not the mask of whoever opened the context */
    if (pool->cpus.n > 0) wsys_mask_of(&pool->cpus, start.index, &mask);
    wsys_mask_apply(&mask);
    uint32_t seen = 0;
    uint64_t s;
    while ((s = next_job(pool, seen)) != 0) {
        seen = GEN(s);
        /* Join while the job is still the one seen; it may close first. */
        while (GEN(s) == seen && OPEN(s) &&
               !atomic_compare_exchange_weak(&pool->state, &s, s + 1))
            ;
        if (GEN(s) != seen || !OPEN(s)) continue;
        WPROF_ADD(WPROF_HELPER_JOIN, pool->opened);
        claim_chunks(pool);
        atomic_fetch_sub(&pool->state, 1);
    }
    return NULL;
}

wpool *wpool_open(int n_threads, const wcpus *cpus) {
    wpool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    if (cpus) pool->cpus = *cpus;
    int want = n_threads - 1 > WPOOL_MAX_THREADS ? WPOOL_MAX_THREADS : n_threads - 1;
    for (int i = 0; i < want; i++) {
        helper_start *start = malloc(sizeof *start);
        if (!start) break;
        *start = (helper_start){pool, i};
        if (pthread_create(&pool->helpers[i], NULL, helper_main, start) != 0) {
            free(start);
            break;
        }
        pool->n_helpers++;
    }
    return pool;
}

void wpool_close(wpool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->stopping, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->n_helpers; i++) pthread_join(pool->helpers[i], NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

int wpool_threads(const wpool *pool) { return pool ? pool->n_helpers + 1 : 1; }

void wpool_run(wpool *pool, size_t n_rows, size_t work, wpool_rows_fn fn, void *arg) {
    if (!pool || pool->n_helpers == 0 || n_rows <= 1 || work < WPOOL_WORK_THRESHOLD) {
        fn(arg, 0, n_rows);
        return;
    }
    size_t grain = n_rows / ((size_t)wpool_threads(pool) * GRAINS_PER_THREAD);
    pool->fn = fn;
    pool->arg = arg;
    pool->n_rows = n_rows;
    pool->grain = grain ? grain : 1;
    atomic_store_explicit(&pool->next_row, 0, memory_order_relaxed);
    WPROF_STAMP(pool->opened);
    const uint64_t next_gen = (uint64_t)1 << 32;
    uint64_t open = atomic_load(&pool->state) + next_gen; /* odd generation, nobody inside */
    atomic_store(&pool->state, open);
    if (atomic_load(&pool->sleepers) > 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
    claim_chunks(pool);
    WPROF_START(waited);
    /* Close once every helper that joined has left: their chunks are done.
     * A helper holding a chunk may share this core, hence the yields. */
    for (unsigned spins = 1;; spins++) {
        uint64_t expected = open;
        if (atomic_compare_exchange_weak(&pool->state, &expected, open + next_gen)) break;
        if (spins % 64 == 0) sched_yield();
        else cpu_relax();
    }
    WPROF_ADD(WPROF_JOB_WAIT, waited);
}
