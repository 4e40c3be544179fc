#include "simd.h"

#ifdef WSIMD_AVX2
#include <stdatomic.h>

int wsimd_avx2(void) {
    static atomic_int answer = -1; /* threads that race here all store the same value */
    int known = atomic_load_explicit(&answer, memory_order_relaxed);
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        atomic_store_explicit(&answer, known, memory_order_relaxed);
    }
    return known;
}
#else
int wsimd_avx2(void) { return 0; }
#endif
