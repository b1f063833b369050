/* GGUF Q4_0 / Q4_1 / Q8_0 matrices times fp32 activations, read straight from their blocks (the host
 * backend's low-bit linear: kernels/cpu_blocks.py builds this file and says why it exists).
 *
 * W [N, K] is N rows of K / 32 blocks (ggml's block_q4_0 / block_q4_1 / block_q8_0, byte for byte).
 * Each weight is dequantized in fp32 exactly as gguf's numpy dequantizers do (d * q, d * q + m: a
 * multiply, then an add, each rounded once), so W's values are the reference's bit for bit and a
 * product differs from the reference's fp32 F.linear only in the order of its sums.
 *
 * y [M, N] = x [M, K] @ W.T: each thread takes a static share of W's rows; a row's blocks are
 * dequantized once per tile of up to 8 rows of x, whose accumulators stay in registers (AVX2 + FMA;
 * a portable loop where the compiler has no AVX2). No allocation, no state: safe from any thread.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RAD_AVX2 1
#endif

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

static inline int block_bytes(int fmt) { return fmt == Q8_0 ? 34 : fmt == Q4_1 ? 20 : 18; }

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef RAD_AVX2
    return _cvtsh_ss(h);
#else
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#endif
}

/* the 32 weights of one block, in order, into w */
static inline void dequant_scalar(const uint8_t *b, int fmt, float *w) {
    float d = half(b);
    if (fmt == Q8_0) {
        for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)b[2 + j];
        return;
    }
    const uint8_t *qs = b + (fmt == Q4_1 ? 4 : 2);
    float m = fmt == Q4_1 ? half(b + 2) : 0.0f;
    for (int j = 0; j < 16; j++) {
        int lo = qs[j] & 15, hi = qs[j] >> 4;
        if (fmt == Q4_0) {
            w[j] = d * (float)(lo - 8);
            w[j + 16] = d * (float)(hi - 8);
        } else {
            w[j] = d * (float)lo + m;
            w[j + 16] = d * (float)hi + m;
        }
    }
}

#ifdef RAD_AVX2
static inline __m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

static inline void dequant_block(const uint8_t *b, int fmt, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half(b));
    __m128i lo, hi;
    if (fmt == Q8_0) {
        lo = _mm_loadu_si128((const __m128i *)(b + 2));
        hi = _mm_loadu_si128((const __m128i *)(b + 18));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (fmt == Q4_1 ? 4 : 2)));
        const __m128i mask = _mm_set1_epi8(15);
        lo = _mm_and_si128(raw, mask);
        hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        if (fmt == Q4_0) {
            lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
            hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
        }
    }
    w[0] = _mm256_mul_ps(d, i8x8(lo));
    w[1] = _mm256_mul_ps(d, i8x8(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_mul_ps(d, i8x8(hi));
    w[3] = _mm256_mul_ps(d, i8x8(_mm_srli_si128(hi, 8)));
    if (fmt == Q4_1) {
        const __m256 m = _mm256_set1_ps(half(b + 2));
        for (int j = 0; j < 4; j++) w[j] = _mm256_add_ps(w[j], m);
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one row of W against MT rows of x: MT * J accumulators (J = 8 / MT lanes of partial sums per row,
 * enough independent chains to keep both FMA ports busy) */
static inline __attribute__((always_inline)) void row_tile(const float *x, int64_t ldx, const uint8_t *wrow,
                                                           int64_t nb, int fmt, float *y, int64_t ldy, const int MT) {
    const int J = MT >= 4 ? 8 / MT : 4, bb = block_bytes(fmt);
    __m256 acc[8];
    for (int i = 0; i < MT * J; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        dequant_block(wrow + b * bb, fmt, w);
        const float *xb = x + b * 32;
        for (int i = 0; i < MT; i++)
            for (int j = 0; j < 4; j++)
                acc[i * J + j % J] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + i * ldx + 8 * j), acc[i * J + j % J]);
    }
    for (int i = 0; i < MT; i++) {
        __m256 s = acc[i * J];
        for (int j = 1; j < J; j++) s = _mm256_add_ps(s, acc[i * J + j]);
        y[i * ldy] = hsum(s);
    }
}
#endif

static void row(const float *x, int64_t M, int64_t ldx, const uint8_t *wrow, int64_t nb, int fmt, float *y,
                int64_t ldy) {
#ifdef RAD_AVX2
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) row_tile(x + m * ldx, ldx, wrow, nb, fmt, y + m * ldy, ldy, 8);
    if (M - m >= 4) { row_tile(x + m * ldx, ldx, wrow, nb, fmt, y + m * ldy, ldy, 4); m += 4; }
    if (M - m >= 2) { row_tile(x + m * ldx, ldx, wrow, nb, fmt, y + m * ldy, ldy, 2); m += 2; }
    if (M - m >= 1) row_tile(x + m * ldx, ldx, wrow, nb, fmt, y + m * ldy, ldy, 1);
#else
    const int bb = block_bytes(fmt);
    for (int64_t m = 0; m < M; m++) y[m * ldy] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        float w[32];
        dequant_scalar(wrow + b * bb, fmt, w);
        for (int64_t m = 0; m < M; m++) {
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += w[j] * x[m * ldx + b * 32 + j];
            y[m * ldy] += s;
        }
    }
#endif
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T, W's N rows of row_bytes each; on
 * `threads` OpenMP threads (torch's own runtime: the same libgomp.so.1 is already loaded). */
void rad_blocks_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                       int64_t row_bytes, int fmt, float *y, int64_t ldy, int threads) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) row(x, M, ldx, w + n * row_bytes, nb, fmt, y + n, ldy);
}

/* out [N, K] fp32 = W's values (gguf's dequantization, bit for bit) */
void rad_blocks_dequantize(const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, int fmt, float *out,
                           int threads) {
    const int64_t nb = K / 32;
    const int bb = block_bytes(fmt);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
#ifdef RAD_AVX2
            __m256 v[4];
            dequant_block(w + n * row_bytes + b * bb, fmt, v);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + n * K + b * 32 + 8 * j, v[j]);
#else
            dequant_scalar(w + n * row_bytes + b * bb, fmt, out + n * K + b * 32);
#endif
        }
}
