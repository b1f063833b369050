/* e^x in fp32 for the host backend's C kernels (cpu_attention.c's softmax), and the SiLU on it (cpu_blocks.c's
 * SwiGLU, cpu_layer.c): Cephes' expf
 * (x = n ln 2 + r, |r| <= ln 2 / 2, a polynomial in r, times 2^n), within 0.99 units of fp32 rounding of e^x on
 * every float of -87..0 (libm's expf: 0.5), and as close past 0 (the same polynomial on the same r). 8 at a
 * time where the compiler has AVX2, the same operations one at a time otherwise: the same values either way.
 * One scalar exp a score was a quarter of the decode attention's time at b8 (perf; libm's expf no faster); 8
 * at a time that kernel took 91 -> 75 us (one thread, b8, contexts 45-70). Below -87.3, where e^x leaves fp32's
 * normal range, it is e^-87.3 (1.2e-38: beside a softmax maximum's e^0 = 1 in every sum, and 1 + it is 1 in a
 * sigmoid); past ln(FLT_MAX), 88.72, infinity (as torch's). 2^n is applied as two halves, 2^(n / 2) 2^(n - n / 2),
 * each scaling exact: the same value as one 2^n for n <= 127, and n = 128 (x of 88.38 to 88.72) stays finite.
 * A NaN x is not defined here (no caller passes one: scores and products of finite values). */
#ifndef RAD_CPU_EXP_H
#define RAD_CPU_EXP_H
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h> /* rad_exp8, whatever the includer's own conditions for it */
#endif

#define EXP_MIN -87.3f
#define EXP_MAX 88.72283905f /* ln(FLT_MAX) */
#define LOG2E 1.44269504088896341f
#define ROUND 12582912.0f /* 1.5 * 2^23: (y + ROUND) - ROUND is y rounded to an integer */
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
static const float POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};

static inline float rad_expf(float x) {
    if (x > EXP_MAX) return __builtin_inff();
    x = x < EXP_MIN ? EXP_MIN : x;
    const float n = (x * LOG2E + ROUND) - ROUND;
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + POLY[i];
    p = p * r * r + r + 1.0f;
    const int32_t h = (int32_t)n >> 1, bits[2] = {(h + 127) << 23, ((int32_t)n - h + 127) << 23}; /* n: -126..128 */
    float scale[2];
    memcpy(scale, bits, 8);
    return p * scale[0] * scale[1];
}

#ifdef __AVX2__
static inline __m256 rad_exp8(__m256 x) { /* rad_expf's operations, 8 lanes */
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MAX), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)), _mm256_set1_ps(EXP_MAX));
    const __m256 round = _mm256_set1_ps(ROUND);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), round), round);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
    __m256 p = _mm256_set1_ps(POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(POLY[i]));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const __m256 s0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
    return _mm256_blendv_ps(_mm256_mul_ps(_mm256_mul_ps(p, s0), s1), _mm256_set1_ps(__builtin_inff()), over);
}
#endif

/* y[i] = silu(g[i]) * u[i] over n values, as torch's fp32 silu computes it, g / (1 + e^-g) (torch's e^x: Sleef's;
 * within 2 units of fp32 rounding of its values), then times u, each step rounded once; y may be g */
static inline void rad_silu_mul(const float *g, const float *u, float *y, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = rad_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) y[i] = g[i] / (1.0f + rad_expf(-g[i])) * u[i];
}
#endif
