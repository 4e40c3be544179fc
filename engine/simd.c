#include "simd.h"

#ifdef WSIMD_AVX2
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* WASTE_NO_AVX2=1 keeps every kernel on its plain C path, so that path can
 * be tested on a machine that has AVX2. */
int wsimd_avx2(void) {
    static atomic_int answer = -1; /* threads that race here all store the same value */
    int known = atomic_load_explicit(&answer, memory_order_relaxed);
    if (known < 0) {
        const char *off = getenv("WASTE_NO_AVX2");
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                !(off && strcmp(off, "1") == 0);
        atomic_store_explicit(&answer, known, memory_order_relaxed);
    }
    return known;
}
#else
int wsimd_avx2(void) { return 0; }
#endif
