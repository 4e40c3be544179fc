#include "simd.h"

#ifdef WSIMD_AVX2
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static int switched_off(const char *name) {
    const char *value = getenv(name);
    return value && strcmp(value, "1") == 0;
}

/* WASTE_NO_AVX2=1 keeps every kernel on its plain C path and WASTE_NO_AVX512=1
 * keeps them on AVX2, so that each path can be tested and measured on a
 * machine that has them all. */
int wsimd_level(void) {
    static atomic_int answer = -1; /* threads that race here all store the same value */
    int known = atomic_load_explicit(&answer, memory_order_relaxed);
    if (known < 0) {
        __builtin_cpu_init();
        known = WSIMD_PLAIN;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            __builtin_cpu_supports("f16c") &&
            !switched_off("WASTE_NO_AVX2")) {
            known = WSIMD_AVX2;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                !switched_off("WASTE_NO_AVX512"))
                known = WSIMD_AVX512;
        }
        atomic_store_explicit(&answer, known, memory_order_relaxed);
    }
    return known;
}
#else
int wsimd_level(void) { return WSIMD_PLAIN; }
#endif

int wsimd_avx2(void) { return wsimd_level() >= WSIMD_AVX2; }
