/*
 * simd.h -- the AVX2 building blocks shared by the kernels (dot.c,
 * attention.c, ops.c).  Each kernel keeps a plain C version beside its AVX2
 * one (and dot.c an AVX-512 one); wsimd_level() picks at run time, so one
 * build runs on any x86-64 and on other CPUs the plain versions are all
 * there is.
 *
 * Only GCC and Clang on x86-64 get the AVX2 code (WSIMD_AVX2 defined): the
 * functions below are compiled for AVX2+FMA+F16C whatever -march says, and must
 * only be called after wsimd_avx2() said yes; WSIMD_TARGET_512 code only
 * after wsimd_level() said WSIMD_AVX512.
 */
#ifndef WASTE_SIMD_H
#define WASTE_SIMD_H

/* The kernels this CPU runs, asked once, then remembered: AVX2 needs AVX2,
 * FMA and F16C (the KV cache's f16, half.h), AVX-512 also AVX512F/BW/VL and
 * VNNI.  WASTE_NO_AVX2=1 in the
 * environment says plain, WASTE_NO_AVX512=1 at most AVX2. */
enum { WSIMD_PLAIN, WSIMD_AVX2, WSIMD_AVX512 };
int wsimd_level(void);

/* wsimd_level() >= WSIMD_AVX2 */
int wsimd_avx2(void);

/* Ask for the cache line at p ahead of its use (a hint: never faults). */
static inline void wsimd_prefetch(const void *p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 3);
#else
    (void)p;
#endif
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WSIMD_AVX2 1
#include <immintrin.h>

#define WSIMD_TARGET __attribute__((target("avx2,fma,f16c")))
#define WSIMD_TARGET_512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* The sum of v's eight lanes. */
WSIMD_TARGET static inline float wsimd_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* The largest of v's eight lanes. */
WSIMD_TARGET static inline float wsimd_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* Lane i of the result is the sum of the eight lanes of v[i]: eight
 * horizontal sums at the cost of about two. */
WSIMD_TARGET static inline __m256 wsimd_hsum8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* The same for eight vectors of int32 lanes (exact). */
WSIMD_TARGET static inline __m256i wsimd_hsum8_epi32(const __m256i v[8]) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* e^x per lane, within 2 ulp of expf for -87.3 <= x <= 88, exactly 0 below
 * (softmax feeds it x <= 0, with -inf for masked keys), e^88 above.  Cephes' method:
 * x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial, 2^n
 * through the exponent bits. */
WSIMD_TARGET static inline __m256 wsimd_exp(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.0f), lo = _mm256_set1_ps(-87.3365447505531f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
    return _mm256_andnot_ps(under, e);
}
#endif

#endif
