/* engine/half.h against F16C and against a list of floats: built and run by test_half.py.
 *
 *   half_check          the plain conversions against vcvtps2ph / vcvtph2ps: every f16,
 *                       and floats across every exponent and rounding case; exit 2 if
 *                       this CPU has no F16C
 *   half_check --print  for each float's bits (hex) on stdin, the f16's bits (hex)
 */
#include <stdio.h>
#include <string.h>

#include "half.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

__attribute__((target("f16c"))) static uint16_t f16c_from(float x) {
    return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT), 0);
}

__attribute__((target("f16c"))) static float f16c_to(uint16_t h) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

static float of_bits(uint32_t bits) {
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static uint32_t bits_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

static int same_from(uint32_t bits) {
    uint16_t a = whalf_from_float(of_bits(bits)), b = f16c_from(of_bits(bits));
    if (a != b) fprintf(stderr, "float %08x: plain %04x, f16c %04x\n", bits, a, b);
    return a == b;
}

static int against_f16c(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("f16c")) return 2;
    unsigned long checked = 0;
    for (uint32_t h = 0; h < 0x10000u; h++, checked++) {
        uint32_t a = bits_of(whalf_to_float((uint16_t)h)), b = bits_of(f16c_to((uint16_t)h));
        if (a != b) {
            fprintf(stderr, "f16 %04x: plain %08x, f16c %08x\n", h, a, b);
            return 1;
        }
    }
    /* The 13 dropped bits (more below 2^-14) decide the rounding: around each tie, at
     * each end, for every sign, exponent and top mantissa pattern. */
    static const uint32_t low[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff};
    for (uint32_t top = 0; top < (1u << 19); top++) /* sign, exponent, 10 mantissa bits */
        for (size_t i = 0; i < sizeof low / sizeof low[0]; i++, checked++)
            if (!same_from(top << 13 | low[i])) return 1;
    for (uint64_t bits = 0; bits < (1ull << 32); bits += 997, checked++) /* and a spread of all */
        if (!same_from((uint32_t)bits)) return 1;
    for (uint32_t e = 101; e <= 113; e++) /* every bit dropped in the subnormals */
        for (uint32_t m = 0; m < (1u << 23); m += 7, checked++)
            if (!same_from(e << 23 | m) || !same_from(0x80000000u | e << 23 | m)) return 1;
    printf("same on %lu conversions\n", checked);
    return 0;
}
#else
static int against_f16c(void) { return 2; }
#endif

int main(int argc, char **argv) {
    if (argc < 2) return against_f16c();
    if (strcmp(argv[1], "--print") != 0) return 64;
    unsigned bits;
    while (scanf("%x", &bits) == 1) {
        float x;
        uint32_t b = bits;
        memcpy(&x, &b, sizeof x);
        printf("%04x\n", whalf_from_float(x));
    }
    return 0;
}
