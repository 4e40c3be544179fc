#include "pool.h"

#include <pthread.h>

/* Splitting costs a wake-up per helper: only worth it for jobs with at
 * least this many multiply-adds. */
#define WORK_THRESHOLD ((size_t)1 << 15)

typedef struct {
    pthread_t thread;
    int started;
    int pinned_cpu; /* the CPU it is pinned to, -1 = the home mask */
} helper;

static struct {
    pthread_mutex_t dispatch; /* one job at a time, process-wide */
    pthread_mutex_t lock;     /* guards the job fields below */
    pthread_cond_t wake, done;
    unsigned long generation;
    wpool_rows_fn fn;
    void *arg;
    size_t n_rows;
    int n_chunks;
    int pending;
    const wcpus *cpus;
    helper helpers[WPOOL_MAX_THREADS];
} pool = {
    .dispatch = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
};

/* The mask threads had when the library was loaded, before any pinning:
 * where an unpinned helper goes back to. */
static wsys_mask home_mask;

__attribute__((constructor)) static void remember_home_mask(void) { wsys_mask_get(&home_mask); }

static void run_chunk(wpool_rows_fn fn, void *arg, size_t n_rows, int chunk, int n_chunks) {
    size_t begin = n_rows * (size_t)chunk / (size_t)n_chunks;
    size_t end = n_rows * (size_t)(chunk + 1) / (size_t)n_chunks;
    if (begin < end) fn(arg, begin, end);
}

/* Helper i does chunk i + 1 of every job with enough chunks. */
static void *helper_main(void *p) {
    int index = (int)(size_t)p;
    helper *self = &pool.helpers[index];
    unsigned long seen = 0;
    /* It inherited its creator's mask, which may be a pinned caller's. */
    wsys_mask_apply(&home_mask);
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        int chunk = index + 1;
        if (chunk >= pool.n_chunks) continue;
        wpool_rows_fn fn = pool.fn;
        void *arg = pool.arg;
        size_t n_rows = pool.n_rows;
        int n_chunks = pool.n_chunks;
        const wcpus *cpus = pool.cpus;
        pthread_mutex_unlock(&pool.lock);

        int want = cpus && cpus->n > 0 ? cpus->ids[index % cpus->n] : -1;
        if (want != self->pinned_cpu) {
            wsys_mask mask = home_mask;
            if (want >= 0) wsys_mask_of(cpus, index, &mask);
            wsys_mask_apply(&mask);
            self->pinned_cpu = want;
        }
        run_chunk(fn, arg, n_rows, chunk, n_chunks);

        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* Start helpers up to `count`; returns how many are running. */
static int ensure_helpers(int count) {
    int running = 0;
    for (int i = 0; i < count && i < WPOOL_MAX_THREADS; i++) {
        helper *h = &pool.helpers[i];
        if (!h->started) {
            h->pinned_cpu = -1;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            h->started = pthread_create(&h->thread, &attr, helper_main, (void *)(size_t)i) == 0;
            pthread_attr_destroy(&attr);
            if (!h->started) break;
        }
        running++;
    }
    return running;
}

void wpool_run(const wpool_team *team, size_t n_rows, size_t work, wpool_rows_fn fn, void *arg) {
    int n_chunks = team->n_threads;
    if (n_chunks > WPOOL_MAX_THREADS + 1) n_chunks = WPOOL_MAX_THREADS + 1;
    if ((size_t)n_chunks > n_rows) n_chunks = (int)n_rows;
    if (n_chunks <= 1 || work < WORK_THRESHOLD) {
        fn(arg, 0, n_rows);
        return;
    }
    pthread_mutex_lock(&pool.dispatch);
    n_chunks = 1 + ensure_helpers(n_chunks - 1);
    pthread_mutex_lock(&pool.lock);
    pool.fn = fn;
    pool.arg = arg;
    pool.n_rows = n_rows;
    pool.n_chunks = n_chunks;
    pool.pending = n_chunks - 1;
    pool.cpus = team->cpus;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    run_chunk(fn, arg, n_rows, 0, n_chunks);

    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.dispatch);
}
