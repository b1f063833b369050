/* GGUF matrices times fp32 activations, read straight from their blocks (the host backend's low-bit
 * linear: kernels/cpu_blocks.py builds this file and says why it exists).
 *
 * W [N, K] is N rows of blocks (ggml's block_q4_0 / q4_1 / q8_0 of 32 values, block_q4_K / q5_K / q6_K
 * of 256, byte for byte). A block is read as chunks of 32 values, each with its own scale (and min): a
 * K-quant's 8 sub-blocks of 32 (Q6_K's 16 of 16, two a chunk). Each weight is dequantized in fp32 exactly
 * as gguf's numpy dequantizers do (the same products and sums in the same order, each rounded once), so
 * W's values are the reference's bit for bit and a product differs from the reference's fp32 F.linear
 * only in the order of its sums.
 *
 * y [M, N] = x [M, K] @ W.T: each thread takes a static share of W's rows; a row's chunks are
 * dequantized once per tile of up to 8 rows of x, whose accumulators stay in registers (AVX2 + FMA;
 * a portable loop where the compiler has no AVX2). No allocation, no state: safe from any thread.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RAD_AVX2 1
#endif

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };

static inline int block_bytes(int fmt) {
    static const int bytes[] = {18, 20, 34, 144, 176, 210};
    return bytes[fmt];
}

static inline int block_chunks(int fmt) { return fmt >= Q4_K ? 8 : 1; } /* chunks of 32 values a block */

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

/* Q4_K / Q5_K: chunk j's 6-bit scale and min from the block's 12 scale bytes (gguf's get_scale_min) */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

/* the scale(s) and min of chunk j: w = d[i / 16] * q (- m) for its 32 values i */
static inline void chunk_scales(const uint8_t *b, int fmt, int j, float d[2], float *m) {
    *m = 0.0f;
    if (fmt == Q4_K || fmt == Q5_K) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        d[0] = d[1] = half(b) * (float)sc;
        *m = half(b + 2) * (float)mn;
    } else if (fmt == Q6_K) {
        const float dd = half(b + 208);
        d[0] = dd * (float)(int8_t)b[192 + 2 * j];
        d[1] = dd * (float)(int8_t)b[192 + 2 * j + 1];
    } else {
        d[0] = d[1] = half(b);
        if (fmt == Q4_1) *m = half(b + 2);
    }
}

/* value i (0..31) of chunk j as the integer gguf multiplies by the scale */
static inline int chunk_q(const uint8_t *b, int fmt, int j, int i) {
    switch (fmt) {
    case Q4_0: return (i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4) - 8;
    case Q4_1: return i < 16 ? b[4 + i] & 15 : b[4 + i - 16] >> 4;
    case Q8_0: return (int8_t)b[2 + i];
    case Q4_K: return (b[16 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
    case Q5_K: return ((b[48 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15) | (((b[16 + i] >> j) & 1) << 4);
    default: { /* Q6_K */
        const int h = j / 4, k = j % 4;
        const int lo = (b[64 * h + 32 * (k % 2) + i] >> (4 * (k / 2))) & 15, hi = (b[128 + 32 * h + i] >> (2 * k)) & 3;
        return (int8_t)(lo | (hi << 4)) - 32;
    }
    }
}

/* the 32 weights of chunk j of block b, in order, into w */
static inline void dequant_scalar(const uint8_t *b, int fmt, int j, float *w) {
    float d[2], m;
    chunk_scales(b, fmt, j, d, &m);
    for (int i = 0; i < 32; i++) {
        const float dq = d[i / 16] * (float)chunk_q(b, fmt, j, i);
        w[i] = fmt == Q4_1 ? dq + m : (fmt == Q4_K || fmt == Q5_K) ? dq - m : dq;
    }
}

#ifdef RAD_AVX2
static inline __m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* 32 signed bytes (the chunk's integers in order) -> 4 x 8 floats */
static inline void bytes_to_ps(__m256i q, __m256 f[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    f[0] = i8x8(lo);
    f[1] = i8x8(_mm_srli_si128(lo, 8));
    f[2] = i8x8(hi);
    f[3] = i8x8(_mm_srli_si128(hi, 8));
}

static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

static inline __m256i nibbles(__m256i bytes, int high) {
    const __m256i v = high ? _mm256_srli_epi16(bytes, 4) : bytes;
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

static inline void dequant_chunk(const uint8_t *b, int fmt, int j, __m256 w[4]) {
    __m256i q;
    if (fmt == Q8_0) {
        q = load32(b + 2);
    } else if (fmt == Q4_0 || fmt == Q4_1) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (fmt == Q4_1 ? 4 : 2)));
        q = nibbles(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), 0);
        if (fmt == Q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    } else if (fmt == Q4_K) {
        q = nibbles(load32(b + 16 + 32 * (j / 2)), j % 2);
    } else if (fmt == Q5_K) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(load32(b + 16), j), _mm256_set1_epi8(1));
        q = _mm256_or_si256(nibbles(load32(b + 48 + 32 * (j / 2)), j % 2), _mm256_slli_epi16(bit, 4));
    } else { /* Q6_K */
        const int h = j / 4, k = j % 4;
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(load32(b + 128 + 32 * h), 2 * k), _mm256_set1_epi8(3));
        q = _mm256_or_si256(nibbles(load32(b + 64 * h + 32 * (k % 2)), k / 2), _mm256_slli_epi16(hi, 4));
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
    }
    /* shifts by 16-bit lanes are exact here: every byte is masked after its shift, and the ORed high
     * bits (at most 2 wide, shifted by 4) stay inside their byte */
    float d[2], m;
    chunk_scales(b, fmt, j, d, &m);
    __m256 f[4];
    bytes_to_ps(q, f);
    const __m256 d0 = _mm256_set1_ps(d[0]), d1 = _mm256_set1_ps(d[1]), mv = _mm256_set1_ps(m);
    for (int i = 0; i < 4; i++) {
        w[i] = _mm256_mul_ps(i < 2 ? d0 : d1, f[i]);
        if (fmt == Q4_1) w[i] = _mm256_add_ps(w[i], mv);
        else if (fmt == Q4_K || fmt == Q5_K) w[i] = _mm256_sub_ps(w[i], mv);
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
    const int J = MT >= 4 ? 8 / MT : 4, bb = block_bytes(fmt), nc = block_chunks(fmt);
    __m256 acc[8];
    for (int i = 0; i < MT * J; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < nc; c++) {
            __m256 w[4];
            dequant_chunk(wrow + b * bb, fmt, c, w);
            const float *xb = x + (b * nc + c) * 32;
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
    const int bb = block_bytes(fmt), nc = block_chunks(fmt);
    for (int64_t m = 0; m < M; m++) y[m * ldy] = 0.0f;
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < nc; c++) {
            float w[32];
            dequant_scalar(wrow + b * bb, fmt, c, w);
            for (int64_t m = 0; m < M; m++) {
                float s = 0.0f;
                for (int i = 0; i < 32; i++) s += w[i] * x[m * ldx + (b * nc + c) * 32 + i];
                y[m * ldy] += s;
            }
        }
#endif
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T, W's N rows of row_bytes each; on
 * `threads` OpenMP threads (torch's own runtime: the same libgomp.so.1 is already loaded). */
void rad_blocks_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                       int64_t row_bytes, int fmt, float *y, int64_t ldy, int threads) {
    const int64_t nb = K / (32 * block_chunks(fmt));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) row(x, M, ldx, w + n * row_bytes, nb, fmt, y + n, ldy);
}

/* out [N, K] fp32 = W's values (gguf's dequantization, bit for bit) */
void rad_blocks_dequantize(const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, int fmt, float *out,
                           int threads) {
    const int nc = block_chunks(fmt), bb = block_bytes(fmt);
    const int64_t nb = K / (32 * nc);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++)
            for (int c = 0; c < nc; c++) {
                float *o = out + n * K + (b * nc + c) * 32;
#ifdef RAD_AVX2
                __m256 v[4];
                dequant_chunk(w + n * row_bytes + b * bb, fmt, c, v);
                for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + 8 * j, v[j]);
#else
                dequant_scalar(w + n * row_bytes + b * bb, fmt, c, o);
#endif
            }
}
