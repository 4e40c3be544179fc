#include "prof.h"

#ifdef WASTE_PROFILE
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static const char *const names[WPROF_KINDS] = {
    "matmul_q4_1", "matmul_q8", "matmul_f32", "quantize", "attention", "kv_store", "norm",
    "rope", "swiglu", "residual", "sample", "callback", "step",
    "chunk_caller", "chunk_helper", "job_wait", "helper_join"};

static _Atomic uint64_t total_ns[WPROF_KINDS], calls[WPROF_KINDS];
static atomic_int decoding;

uint64_t wprof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void wprof_add(wprof_kind kind, uint64_t since) {
    if (!atomic_load_explicit(&decoding, memory_order_relaxed)) return;
    atomic_fetch_add_explicit(&total_ns[kind], wprof_now() - since, memory_order_relaxed);
    atomic_fetch_add_explicit(&calls[kind], 1, memory_order_relaxed);
}

void wprof_decoding(int on) { atomic_store(&decoding, on); }

__attribute__((destructor)) static void wprof_report(void) {
    const char *path = getenv("WASTE_PROFILE");
    FILE *f = path && *path ? fopen(path, "w") : stderr;
    if (!f) return;
    fprintf(f, "{");
    for (int k = 0; k < WPROF_KINDS; k++)
        fprintf(f, "%s\"%s\": {\"ns\": %llu, \"calls\": %llu}", k ? ", " : "", names[k],
                (unsigned long long)total_ns[k], (unsigned long long)calls[k]);
    fprintf(f, "}\n");
    if (f != stderr) fclose(f);
}
#else
typedef int wprof_unused; /* ISO C wants something in a translation unit */
#endif
