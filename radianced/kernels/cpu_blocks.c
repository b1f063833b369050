/* GGUF matrices times fp32 activations, read straight from their blocks (the host backend's low-bit
 * linear: kernels/cpu_blocks.py builds this file and says why it exists).
 *
 * W [N, K] is N rows of blocks (ggml's block_q4_0 / q4_1 / q8_0 of 32 values, block_q4_K / q5_K / q6_K
 * of 256, byte for byte). A block is read as chunks of 32 values, each with its own scale (and min): a
 * K-quant's 8 sub-blocks of 32 (Q6_K's 16 of 16, two a chunk).
 *
 * Two products, y [M, N] = x [M, K] @ W.T:
 *
 * AVX2 tiles (any x86-64 with AVX2 + FMA; a portable loop without): each weight is dequantized in fp32
 * exactly as gguf's numpy dequantizers do (the same products and sums in the same order, each rounded
 * once), so W's values are the reference's bit for bit and a product differs from the reference's fp32
 * F.linear only in the order of its sums. Each thread takes a static share of W's rows, two at a time. Up
 * to 4 rows of x, the two rows' chunks are dequantized in registers as the tile goes and each x vector
 * loaded feeds both rows' FMAs; from 5 rows, each 512 values of the two rows are dequantized once into a
 * buffer in L1 that every 4 rows of x then read (`panel`). rad_blocks_dequantize is this code too.
 *
 * AVX-512 tiles (Q4_0, Q4_1 and Q8_0 on a CPU with AVX-512F, where the AMX path does not run: Zen 4, or AMX
 * refused): each block's 32 weights of a row are two zmm vectors made in registers, gguf's values bit for
 * bit (Q4: d * q (+ m) for the 16 values a nibble can take, each rounded as gguf rounds it, then looked up
 * by vpermps; Q8_0: d * q), and each feeds the FMAs of up to 8 rows of x; no panel (32 registers hold
 * 2 x 8 sums). Measured on the 2-core AMD EPYC (Zen 4: AVX-512, no AMX), two threads, each call on the next
 * of 8 copies of W (tools/bench_cpu_blocks.py --no-fp32, the AVX2 tiles' build as --source), us a call:
 *     shape            M = 1: avx2  zmm   M = 4: avx2  zmm   M = 8: avx2  zmm
 *     1536 x 576 q4_1           44    39           63    59          112    88
 *     576 x 1536 q4_1           43    38           61    55          111    84
 *     576 x 576 q4_1            21    19           29    27           47    38
 *     49152 x 576 q8_0        1393  1267         1776  1597         3190  2602
 * (M = 8: 160-174 GFLOP/s, above MKL's fp32 GEMM of 1024 x 1024 on these cores, 153.) The product beats
 * dequantize + GEMM to ~200 rows of x (1536 x 576 q4_1 at M = 128: 1.33 ms against 1.50; 256: 2.75 against
 * 2.95, 576 x 1536 2.73 against 2.53), so ZMM_GEMM_ROWS; the AVX2 tiles' AVX2_GEMM_ROWS is cpu_blocks.py's.
 *
 * AMX (Sapphire Rapids and later: AMX-BF16 and AVX512-BF16, built with -march=native there, and Linux
 * granting the tile state at run time; from amx_min[fmt] rows of x): gguf's w = d * q (+ m) factored,
 * y = sum over chunks of d * sum(q x) (+ m * sum(x)). Every format's q is an integer of at most 8 bits,
 * exact in bf16; x is split exactly into three bf16 parts x1 + x2 + x3 (x1 = bf16(x), x2 = bf16(x - x1),
 * x3 = bf16(x - x1 - x2): 24 bits, x itself for normal values), so every q * xk is exact in fp32 and a
 * chunk's C tile (TDPBF16PS: fp32 sums of exact products) is sum(q x) up to fp32 rounding of its sums; each
 * C is scaled by d (and the min added) in AVX-512 before the next chunk. No weight is rounded to fp32 any
 * more: a product is no longer F.linear on W's dequantized values reordered, but within fp32 rounding of
 * the exact product all the same (tests/kernels/test_cpu_blocks_amx.py: (K + 64) u |x| @ (|W| + 2 |m|).T,
 * the bound fp32's own F.linear meets; SmolLM2 stays token-exact against transformers).
 *   Tiles: x's rows (up to 16) and three parts as the A tiles, W's 16 rows as the B tile: lane n of each
 * of its 16 rows holds a pair of row n's values, made from W's quant bytes gathered from the 16 rows
 * (vpgatherdd) and mapped to bf16 by vpermw from a 32-entry table (Q8_0 through fp32). The C tile's rows
 * are x's rows with W's 16 rows in lanes, so the scaling is one FMA by the 16 rows' d (and one by their m)
 * a row of x. A row's result depends on that row of W and of x alone: not on the thread count, M, or its
 * neighbours. Two B and two C tiles alternate in a software pipeline (amx_tile).
 *
 * Measured on the 2-core Sapphire Rapids, microseconds a call. Layouts on one thread, one copy of 1536 x
 * 576 q4_1 (in L2), M = 8 (the harness a C main calling rad_blocks_matmul): AVX2 tiles 202; AMX with W as
 * the A tiles (C's lanes x's rows, half of them idle at M = 8) and one A and one C tile 132, each chunk
 * waiting for the last; alternating two of each, pipelined 95 (taking parts out: B's conversion and its
 * store ~35% of that, the min's FMAs ~17%, gathering d and m ~15%, the tile unit's own work ~45 us); W as
 * the B tiles 65. Two threads, each call on the next of 8 copies of W (tools/bench_cpu_blocks.py --no-fp32,
 * the main branch's build as --source, load average 0.6-0.9 from another engineer's jobs):
 *     shape            M = 1: main  this   M = 8: main  this   M = 32: main  this   M = 64: main  this
 *     1536 x 576 q4_1          55    40           145    47           426   113            742   220
 *     576 x 1536 q4_1          56    38           144    51           406   129            692   246
 *     3072 x 576 q4_1         108    70           262    81           735   221           1472   442
 *     49152 x 576 q8_0       1373  1364          3500  2422         11773  5402          23651  9780
 * Thresholds (amx_min; AVX2 tiles against AMX, 2 threads, best of 40-200 calls): 1536 x 576 q4_1 at M = 1
 * 36 / 28 us; the q8_0 lm_head at M = 3 1.48 / 1.73 ms, M = 4 1.80 / 1.56; 3072 x 512 Q4_K at M = 1 93 / 106,
 * M = 2 109 / 107; Q5_K 141 / 147, 163 / 144; Q6_K at M = 4 191 / 239, M = 8 273 / 239.
 * With F.linear on the dequantized copies between calls (weights from memory, not L3) M = 8 reads, this
 * against main, 65 / 164, 72 / 169, 119 / 260, 2590 / 3760: the Q4_1 shapes near the speed the AVX2 tiles
 * stream them at M = 1 (68, 67, 117). The q8_0 lm_head at M = 1 is the AVX2 tiles in both: they stream it
 * at ~21 GB/s, which the AMX path (1.6 ms from a copy in L3) does not reach. A SmolLM2 decode step
 * (tools/cpu_step.py, 2 threads, this branch's base against it in three interleaved rounds, load average
 * 0.8-1.2 with the runs): batch 8 25.0-27.1 ms -> 17.1-18.9, batch 1 13.7-14.2 -> 11.0-11.7.
 * No allocation (buffers on the stack), no state but the tile permission: safe from any thread.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RAD_AVX2 1
#endif
#include "cpu_exp.h"     /* rad_silu_mul: the SwiGLU's */
#include "cpu_kernels.h" /* this file's functions that the others call */

#if defined(RAD_AVX2) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) \
    && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>
#define RAD_AMX 1
#endif

#if defined(RAD_AVX2) && defined(__AVX512F__)
#define RAD_ZMM 1
#endif

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };

/* rows of x past which dequantize + torch's GEMM beat the product (rad_blocks_gemm_rows; measured: header) */
#define AVX2_GEMM_ROWS 64
#define ZMM_GEMM_ROWS 192

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
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 32") /* a tile's loops have constant trips: unrolled, its sums live in registers */

/* 8 bytes -> 8 int32 lanes, zero-extended: one vpmovzxbd from memory */
INLINE __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* values 8 p .. 8 p + 7 of chunk c as the integers gguf multiplies by the scale, one a 32-bit lane.
 * Masks and shifts act on 32-bit lanes after the zero-extension, so no bit crosses into a neighbour. */
INLINE __m256i part_q(const uint8_t *b, const int fmt, int c, const int p) {
    const __m256i m15 = _mm256_set1_epi32(15);
    switch (fmt) {
    case Q4_0: case Q4_1: { /* value i < 16: byte i's low nibble; i >= 16: byte i - 16's high one */
        const __m256i v = u8x8(b + (fmt == Q4_1 ? 4 : 2) + 8 * (p % 2));
        const __m256i q = p < 2 ? _mm256_and_si256(v, m15) : _mm256_srli_epi32(v, 4);
        return fmt == Q4_0 ? _mm256_sub_epi32(q, _mm256_set1_epi32(8)) : q;
    }
    case Q8_0: return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * p)));
    case Q4_K: {
        const __m256i v = u8x8(b + 16 + 32 * (c / 2) + 8 * p);
        return c % 2 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, m15);
    }
    case Q5_K: {
        const __m256i v = u8x8(b + 48 + 32 * (c / 2) + 8 * p);
        const __m256i lo = c % 2 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, m15);
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi32(u8x8(b + 16 + 8 * p), _mm_cvtsi32_si128(c)),
                                             _mm256_set1_epi32(1));
        return _mm256_or_si256(lo, _mm256_slli_epi32(bit, 4));
    }
    default: { /* Q6_K */
        const int h = c / 4, k = c % 4;
        const __m256i v = u8x8(b + 64 * h + 32 * (k % 2) + 8 * p);
        const __m256i lo = k / 2 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, m15);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(u8x8(b + 128 + 32 * h + 8 * p), _mm_cvtsi32_si128(2 * k)),
                                            _mm256_set1_epi32(3));
        return _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    }
    }
}

/* a chunk's scales, broadcast: d0 for its values 0..15, d1 for 16..31 (equal but in Q6_K), m its min */
typedef struct { __m256 d0, d1, m; } scales;

INLINE scales chunk_scales_v(const uint8_t *b, const int fmt, int c) {
    float d[2], m;
    chunk_scales(b, fmt, c, d, &m);
    return (scales){_mm256_set1_ps(d[0]), _mm256_set1_ps(d[1]), _mm256_set1_ps(m)};
}

/* weights 8 p .. 8 p + 7 of chunk c: gguf's d * q (+ m, - m), each step rounded once as the reference's */
INLINE __m256 part_w(const uint8_t *b, const int fmt, int c, const int p, scales s) {
    const __m256 w = _mm256_mul_ps(p < 2 ? s.d0 : s.d1, _mm256_cvtepi32_ps(part_q(b, fmt, c, p)));
    return fmt == Q4_1 ? _mm256_add_ps(w, s.m) : (fmt == Q4_K || fmt == Q5_K) ? _mm256_sub_ps(w, s.m) : w;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Tiles. Every function below takes fmt, NR (rows of W), MR (rows of x) and J as compile-time constants
 * (each format's product is its own code: the loops have no format branch and keep their sums in
 * registers; that alone was most of the gain at M = 1, 2x on one thread).
 *
 * Sum order: each (W row, x row) keeps J partial sums; part p (values 8 p .. 8 p + 7) of every chunk of 32
 * goes to sum p % J, the J sums are added in order at the end, then across lanes. J depends on MR alone
 * (J_OF), MR on M alone, never on NR, on K-blocking or on which thread took the row: y is the same for
 * any thread count and any grouping of W's rows. */
#define J_OF(MR) ((MR) == 1 ? 4 : (MR) == 2 ? 2 : 1) /* at least 8 independent FMA chains a tile (latency 4) */
#define WR 2         /* rows of W a tile: each loaded x vector feeds 2 FMAs (one row of W: 1 load an FMA) */
#define MR_MAX 4     /* rows of x a tile: 2 x 4 sums + 2 weight vectors + an x vector fit the 16 ymm */
#define PANEL_MIN 5  /* rows of x from which the panel (below) beats the direct tile */
#define KB 512       /* values of K a panel holds: WR x 2 KiB, in L1 beside x's 4 rows */
#define PF 1024      /* prefetch distance in W's rows, bytes */

/* the M rows of x in tiles of MR_MAX, then one of 3, 2 or 1: BODY(first row, MR) with MR a constant */
#define FOR_M_TILES(M, BODY)                                                                                   \
    do {                                                                                                       \
        int64_t m_ = 0;                                                                                        \
        for (; m_ + MR_MAX <= (M); m_ += MR_MAX) BODY(m_, MR_MAX);                                             \
        switch ((M) - m_) {                                                                                    \
        case 3: BODY(m_, 3); break;                                                                            \
        case 2: BODY(m_, 2); break;                                                                            \
        case 1: BODY(m_, 1); break;                                                                            \
        }                                                                                                      \
    } while (0)

/* Direct tile: NR rows of W (rows row_bytes apart) against MR rows of x, dequantizing as it goes: for each 8
 * weights, the NR rows' vectors are made once and each x vector loaded feeds NR FMAs. Best at M <= 4 (the
 * panel's store and reload cost more than a second dequantization saves there). */
INLINE void tile(const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t nb, float *y,
                 int64_t ldy, const int fmt, const int NR, const int MR, const int J) {
    const int bb = block_bytes(fmt), nc = block_chunks(fmt);
    __m256 acc[WR][MR_MAX][4]; /* fixed sizes: a VLA ([NR][MR][J]) would stay in memory */
    UNROLL
    for (int r = 0; r < NR; r++)
        UNROLL
        for (int i = 0; i < MR; i++)
            UNROLL
            for (int j = 0; j < J; j++) acc[r][i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < nc; c++) {
            scales s[WR];
            /* two rows are two streams the hardware prefetcher follows poorly: the lm_head (30 MB, from
             * memory) took 4.1 ms at M = 1 on one thread without this, 2.3 ms with it */
            if (c == 0)
                UNROLL
                for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(w + r * row_bytes + b * bb + PF), _MM_HINT_T0);
            UNROLL
            for (int r = 0; r < NR; r++) s[r] = chunk_scales_v(w + r * row_bytes + b * bb, fmt, c);
            const float *xb = x + (b * nc + c) * 32;
            UNROLL
            for (int p = 0; p < 4; p++) {
                __m256 wv[WR];
                UNROLL
                for (int r = 0; r < NR; r++) wv[r] = part_w(w + r * row_bytes + b * bb, fmt, c, p, s[r]);
                UNROLL
                for (int i = 0; i < MR; i++) {
                    const __m256 xv = _mm256_loadu_ps(xb + i * ldx + 8 * p);
                    UNROLL
                    for (int r = 0; r < NR; r++) acc[r][i][p % J] = _mm256_fmadd_ps(wv[r], xv, acc[r][i][p % J]);
                }
            }
        }
    UNROLL
    for (int r = 0; r < NR; r++)
        UNROLL
        for (int i = 0; i < MR; i++) {
            __m256 t = acc[r][i][0];
            UNROLL
            for (int j = 1; j < J; j++) t = _mm256_add_ps(t, acc[r][i][j]);
            y[i * ldy + r] = hsum(t);
        }
}

/* the panel's fp32 kernel: NR rows of dequantized W (wb, rows KB apart) x MR rows of x over kn values,
 * adding to NR x MR x J partial sums kept in memory between K-blocks (acc; from zero when `first`) */
INLINE void micro(const float *x, int64_t ldx, const float *wb, int kn, __m256 *acc, int first, const int NR,
                  const int MR, const int J) {
    __m256 a[WR][MR_MAX][4];
    UNROLL
    for (int r = 0; r < NR; r++)
        UNROLL
        for (int i = 0; i < MR; i++)
            UNROLL
            for (int j = 0; j < J; j++) a[r][i][j] = first ? _mm256_setzero_ps() : acc[(r * MR + i) * J + j];
    for (int k = 0; k < kn; k += 32)
        UNROLL
        for (int p = 0; p < 4; p++) {
            /* The empty asms pin each loaded vector in a register: gcc otherwise folds the loads into the
             * FMAs as memory operands, loading every vector NR or MR times (48 loads for 32 FMAs, past the
             * 2 a cycle the core does; 24 with this). M = 8: 262 -> 234 us on one thread. */
            __m256 wv[WR];
            UNROLL
            for (int r = 0; r < NR; r++) {
                wv[r] = _mm256_load_ps(wb + r * KB + k + 8 * p);
                __asm__("" : "+x"(wv[r]));
            }
            UNROLL
            for (int i = 0; i < MR; i++) {
                __m256 xv = _mm256_loadu_ps(x + i * ldx + k + 8 * p);
                __asm__("" : "+x"(xv));
                UNROLL
                for (int r = 0; r < NR; r++) a[r][i][p % J] = _mm256_fmadd_ps(wv[r], xv, a[r][i][p % J]);
            }
        }
    UNROLL
    for (int r = 0; r < NR; r++)
        UNROLL
        for (int i = 0; i < MR; i++)
            UNROLL
            for (int j = 0; j < J; j++) acc[(r * MR + i) * J + j] = a[r][i][j];
}

INLINE void reduce(const __m256 *acc, float *y, int64_t ldy, const int NR, const int MR, const int J) {
    UNROLL
    for (int r = 0; r < NR; r++)
        UNROLL
        for (int i = 0; i < MR; i++) {
            __m256 t = acc[(r * MR + i) * J];
            UNROLL
            for (int j = 1; j < J; j++) t = _mm256_add_ps(t, acc[(r * MR + i) * J + j]);
            y[i * ldy + r] = hsum(t);
        }
}

/* Panel: NR rows of W against M (<= 32) rows of x. Each K-block of KB values of the NR rows is
 * dequantized once into an L1 buffer, then every tile of 4 rows of x runs the fp32 kernel over it (the
 * direct tile would dequantize again for each). M = 8, 1536 x 576 q4_1, one thread: 282 us direct, 234
 * through the panel (the base's one row of W x 8 rows of x: 347). */
INLINE void panel(const float *x, int64_t M, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t K,
                  float *y, int64_t ldy, const int fmt, const int NR) {
    _Alignas(32) float wb[WR * KB];
    __m256 acc[WR * 32 * 4]; /* NR x M x J partial sums, J <= 4 a row of x */
    const int bb = block_bytes(fmt), nc = block_chunks(fmt), vb = 32 * nc; /* values a block */
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int kn = K - k0 < KB ? (int)(K - k0) : KB;
        for (int r = 0; r < NR; r++)
            for (int k = 0; k < kn; k += 32) {
                const uint8_t *b = w + r * row_bytes + (k0 + k) / vb * bb;
                const int c = (k0 + k) / 32 % nc;
                if (c == 0) _mm_prefetch((const char *)(b + PF), _MM_HINT_T0);
                const scales s = chunk_scales_v(b, fmt, c);
                UNROLL
                for (int p = 0; p < 4; p++) _mm256_store_ps(wb + r * KB + k + 8 * p, part_w(b, fmt, c, p, s));
            }
        __m256 *at = acc;
#define MICRO(m, MR) (micro(x + (m) * ldx + k0, ldx, wb, kn, at, k0 == 0, NR, MR, J_OF(MR)), at += NR * MR * J_OF(MR))
        FOR_M_TILES(M, MICRO);
#undef MICRO
    }
    __m256 *at = acc;
#define REDUCE(m, MR) (reduce(at, y + (m) * ldy, ldy, NR, MR, J_OF(MR)), at += NR * MR * J_OF(MR))
    FOR_M_TILES(M, REDUCE);
#undef REDUCE
}

/* NR (<= WR) rows of W against all M rows of x */
INLINE void rows(const float *x, int64_t M, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t nb,
                 float *y, int64_t ldy, const int fmt, const int NR) {
    if (M >= PANEL_MIN) {
        for (int64_t m = 0; m < M; m += 32)
            panel(x + m * ldx, M - m < 32 ? M - m : 32, ldx, w, row_bytes, nb * 32 * block_chunks(fmt),
                  y + m * ldy, ldy, fmt, NR);
        return;
    }
    if (M == 1 && (fmt == Q4_K || fmt == Q5_K)) {
        /* one row of W at a time: two rows' K-quant scales and sums spill at M = 1 (3072 x 512, one thread:
         * Q4_K 312 -> 240 us, Q5_K 370 -> 335; Q6_K was no faster). Same sums: J depends on MR alone. */
        for (int r = 0; r < NR; r++) tile(x, ldx, w + r * row_bytes, row_bytes, nb, y + r, ldy, fmt, 1, 1, J_OF(1));
        return;
    }
#define TILE(m, MR) tile(x + (m) * ldx, ldx, w, row_bytes, nb, y + (m) * ldy, ldy, fmt, NR, MR, J_OF(MR))
    FOR_M_TILES(M, TILE);
#undef TILE
}

#ifdef RAD_ZMM
/* AVX-512 tiles for Q4_0 / Q4_1 / Q8_0 at any M where the AMX path does not run (header): a block's
 * 32 weights of a row are two zmm vectors made in registers, gguf's values bit for bit (Q4: the 16 values a
 * nibble can take, d * q (+ m) rounded as gguf rounds each, looked up by vpermps; Q8_0: d * q), and each
 * feeds the FMAs of up to ZM rows of x. Each (W row, x row) keeps one sum of 16 lanes (two from fewer than 5
 * rows of x: lo and hi halves apart, for chains enough to hide the FMA's latency), added across lanes at the
 * end: a row's result depends on that row of W and of x and on M's tiling alone, not on the thread count. */
#define ZM 8 /* rows of x a tile: WR x 8 sums + W's WR rows as 4 vectors + a row of x's 2 vectors: 22 of 32 zmm */
#define Z_J(MR) ((MR) > 4 ? 1 : 2) /* sums a (W row, x row) */

/* the 32 weights of one row's block: values 0..15 in lo, 16..31 in hi */
INLINE void z_block(const uint8_t *blk, const int fmt, __m512 *lo, __m512 *hi) {
    const __m512 d = _mm512_set1_ps(half(blk));
    if (fmt == Q8_0) {
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
        return;
    }
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 t = _mm512_mul_ps(d, fmt == Q4_0 ? _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)) : iota);
    if (fmt == Q4_1) t = _mm512_add_ps(t, _mm512_set1_ps(half(blk + 2)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (fmt == Q4_1 ? 4 : 2))));
    *lo = _mm512_permutexvar_ps(q, t); /* byte i's low nibble: vpermps reads an index's low 4 bits */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t);
}

/* NR rows of W against MR rows of x over nb blocks */
INLINE void z_tile(const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t nb, float *y,
                   int64_t ldy, const int fmt, const int NR, const int MR, const int J) {
    const int bb = block_bytes(fmt);
    __m512 acc[WR][ZM][2];
    UNROLL
    for (int r = 0; r < NR; r++)
        UNROLL
        for (int i = 0; i < MR; i++)
            UNROLL
            for (int j = 0; j < J; j++) acc[r][i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo[WR], hi[WR];
        UNROLL
        for (int r = 0; r < NR; r++) {
            const uint8_t *blk = w + r * row_bytes + b * bb;
            _mm_prefetch((const char *)(blk + PF), _MM_HINT_T0);
            z_block(blk, fmt, &lo[r], &hi[r]);
        }
        const float *xb = x + b * 32;
        UNROLL
        for (int i = 0; i < MR; i++) {
            __m512 x0 = _mm512_loadu_ps(xb + i * ldx), x1 = _mm512_loadu_ps(xb + i * ldx + 16);
            __asm__("" : "+v"(x0), "+v"(x1)); /* loaded once, not folded into each row's FMA */
            UNROLL
            for (int r = 0; r < NR; r++) {
                acc[r][i][0] = _mm512_fmadd_ps(lo[r], x0, acc[r][i][0]);
                acc[r][i][J - 1] = _mm512_fmadd_ps(hi[r], x1, acc[r][i][J - 1]);
            }
        }
    }
    UNROLL
    for (int r = 0; r < NR; r++)
        UNROLL
        for (int i = 0; i < MR; i++)
            y[i * ldy + r] = _mm512_reduce_add_ps(J == 2 ? _mm512_add_ps(acc[r][i][0], acc[r][i][1]) : acc[r][i][0]);
}

INLINE void z_rows(const float *x, int64_t M, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t nb,
                   float *y, int64_t ldy, const int fmt, const int NR) {
    int64_t m = 0;
    for (; m + ZM <= M; m += ZM) z_tile(x + m * ldx, ldx, w, row_bytes, nb, y + m * ldy, ldy, fmt, NR, ZM, Z_J(ZM));
#define Z_CASE(MR) case MR: z_tile(x + m * ldx, ldx, w, row_bytes, nb, y + m * ldy, ldy, fmt, NR, MR, Z_J(MR)); break;
    switch (M - m) { Z_CASE(7) Z_CASE(6) Z_CASE(5) Z_CASE(4) Z_CASE(3) Z_CASE(2) Z_CASE(1) }
#undef Z_CASE
}

#endif

/* NR (<= WR) rows of W against all M rows of x by this build's tiles for fmt: the AVX-512 tiles where they read
 * it, else the AVX2 tiles (a row's sums depend on M's tiling alone either way) */
INLINE void any_rows(const float *x, int64_t M, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t nb,
                     float *y, int64_t ldy, const int fmt, const int NR) {
#ifdef RAD_ZMM
    if (fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0) {
        z_rows(x, M, ldx, w, row_bytes, nb, y, ldy, fmt, NR);
        return;
    }
#endif
    rows(x, M, ldx, w, row_bytes, nb, y, ldy, fmt, NR);
}

/* W's rows n .. n + WR - 1 of its N (an odd N's last, n = N - 1, alone: the same sums) against all M rows of x,
 * into y's columns from n */
INLINE void rows_at(const float *x, int64_t M, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t nb,
                    float *y, int64_t ldy, const int fmt, int64_t n, int64_t N) {
    if (n + WR <= N) any_rows(x, M, ldx, w + n * row_bytes, row_bytes, nb, y + n, ldy, fmt, WR);
    else any_rows(x, M, ldx, w + n * row_bytes, row_bytes, nb, y + n, ldy, fmt, 1);
}

/* one format's product: the threads take static shares of W's tiles of WR rows (`rows_at`) */
#define MATMUL_FMT(FMT)                                                                                        \
    static void matmul_##FMT(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,  \
                             int64_t row_bytes, float *y, int64_t ldy, int threads) {                         \
        const int64_t nb = K / (32 * block_chunks(FMT)), tiles = (N + WR - 1) / WR;                           \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                     \
        for (int64_t t = 0; t < tiles; t++) rows_at(x, M, ldx, w, row_bytes, nb, y, ldy, FMT, t * WR, N);      \
    }

/* out [N, K] = W's values: each chunk's 32 weights stored as made */
#define DEQUANT_FMT(FMT)                                                                                       \
    static void dequant_##FMT(const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, float *out,          \
                              int threads) {                                                                  \
        const int nc = block_chunks(FMT), bb = block_bytes(FMT);                                              \
        const int64_t nb = K / (32 * nc);                                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                     \
        for (int64_t n = 0; n < N; n++)                                                                       \
            for (int64_t b = 0; b < nb; b++)                                                                  \
                for (int c = 0; c < nc; c++) {                                                                \
                    const uint8_t *blk = w + n * row_bytes + b * bb;                                          \
                    const scales s = chunk_scales_v(blk, FMT, c);                                             \
                    float *o = out + n * K + (b * nc + c) * 32;                                               \
                    UNROLL                                                                                    \
                    for (int p = 0; p < 4; p++) _mm256_storeu_ps(o + 8 * p, part_w(blk, FMT, c, p, s));       \
                }                                                                                             \
    }

#define EACH_FMT(X) X(Q4_0) X(Q4_1) X(Q8_0) X(Q4_K) X(Q5_K) X(Q6_K)
EACH_FMT(MATMUL_FMT)
EACH_FMT(DEQUANT_FMT)
#endif

#ifdef RAD_AMX
/* AMX: x's rows as three bf16 parts (A tiles), W's chunks as exact bf16 integers (B tiles, built by AVX-512
 * from W's blocks), a chunk's dot products in a C tile, scaled in AVX-512 (the header says why and what it
 * costs). */
#define XG 16      /* rows of x a pass: an A tile's 16 rows */
#define KS 512     /* values of K a segment: its packed x (3 parts: up to 48 KiB, Q6_K's 6: 96) on the stack */

/* rows of x from which the AMX path beats the AVX2 tiles, by format (measured: header). Q8_0 and Q6_K lose
 * below: the AVX2 tiles read Q8_0's bytes at memory speed at M = 1-3, and Q6_K's two half chunks double the
 * tile work. */
static const int amx_min[] = {[Q4_0] = 1, [Q4_1] = 1, [Q8_0] = 4, [Q4_K] = 2, [Q5_K] = 2, [Q6_K] = 8};
/* (Measured against the AVX2 tiles; below them such a CPU now runs the AVX-512 tiles for Q4_0 / Q4_1 / Q8_0, not
 * yet measured there: no Sapphire Rapids since.) */

/* Whether this process may use the tiles: Linux hands out the tile state on request (arch_prctl
 * ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18), once for the process; where it refuses
 * (an old kernel), the AVX2 tiles run. Asked at most a few times (a race asks twice, with one answer). */
static int amx_granted(void) {
    static int state; /* 0: not asked, 1: granted, -1: refused */
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELAXED);
    }
    return s > 0;
}

/* Tiles: 2-4 A (x's mg rows, a chunk's 32 values as bf16: part 1, 2, 3), 1 and 6 B (16 rows, each a pair of
 * the chunk's values for W's 16 rows: 32-bit lane n is W's row n), 0 and 7 C (x's mg rows x W's 16 rows,
 * fp32); amx_tile alternates the B and C pairs */
static void amx_configure(int mg) {
    struct { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = t == 1 || t == 6 ? 16 : mg;
    __asm__ volatile("" : : "m"(cfg)); /* gcc 12 does not see ldtilecfg read cfg: its stores were dropped */
    _tile_loadconfig(&cfg);
}

/* B row j holds two values of the chunk: (2j, 2j + 1), or for Q4_0 / Q4_1 (j, j + 16), the two nibbles of
 * byte j (one byte a row); x's A rows pair its values the same way */
static inline int nibble_pairs(int fmt) { return fmt == Q4_0 || fmt == Q4_1; }

/* bf16 bit patterns of the quant values for index i (0..31; Q6_K's 32..63 with `upper`), for vpermw, which
 * reads an index's low 5 bits: Q4's i & 15 lets a byte's high nibble ride along in bits 4-7 */
static __m512i q_table(int fmt, int upper) {
    _Alignas(64) float f[32];
    for (int i = 0; i < 32; i++) {
        const int v = i + 32 * upper;
        f[i] = (float)(fmt == Q4_0 ? (v & 15) - 8 : fmt == Q5_K ? v : fmt == Q6_K ? v - 32 : v & 15);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(f + 16), _mm512_load_ps(f));
}

/* bytes 4j .. 4j + 3 at p of W's rows (`rows`: their offsets; rows past nr, masked off, read as zero) */
INLINE __m512i gather4(const uint8_t *p, __m512i rows, __mmask16 rmask) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rmask, rows, p, 1);
}

/* byte k of each 32-bit lane into its word 0 and byte k + 1 into word 1 (k + 1 = 0x80: zero), zero-extended */
INLINE __m512i bytes_to_words(__m512i g, int k, int k1) {
    const __m512i lane = _mm512_set_epi32(0xC000C, 0x80008, 0x40004, 0, 0xC000C, 0x80008, 0x40004, 0, 0xC000C,
                                          0x80008, 0x40004, 0, 0xC000C, 0x80008, 0x40004, 0); /* 4p: lane p's bytes */
    return _mm512_shuffle_epi8(g, _mm512_add_epi32(lane, _mm512_set1_epi32(k | 0x80 << 8 | k1 << 16 | 0x80 << 24)));
}

/* chunk c of the blocks at blk (W's 16 rows, offsets `rows`) as the 16 B rows in b: exact bf16 integers */
INLINE void b_rows(const uint8_t *blk, __m512i rows, __mmask16 rmask, const int fmt, int c, __m512i tab,
                   __m512i tab_hi, uint32_t (*b)[16]) {
    switch (fmt) {
    case Q4_0: case Q4_1: { /* row j: byte j's nibbles; word 1 = byte >> 4, word 0 = byte (vpermw reads i & 15) */
        const __m512i hi = _mm512_set1_epi32(0x00040000);
        UNROLL
        for (int j = 0; j < 4; j++) {
            const __m512i g = gather4(blk + (fmt == Q4_1 ? 4 : 2) + 4 * j, rows, rmask);
            UNROLL
            for (int i = 0; i < 4; i++)
                _mm512_store_si512(b[4 * j + i],
                                   _mm512_permutexvar_epi16(_mm512_srlv_epi16(bytes_to_words(g, i, i), hi), tab));
        }
        break;
    }
    case Q8_0: { /* byte k of a lane, sign-extended, to fp32 (exact), whose top half is its bf16 */
        const __m512i top = _mm512_set1_epi32((int)0xFFFF0000);
        UNROLL
        for (int j = 0; j < 8; j++) {
            const __m512i g = gather4(blk + 2 + 4 * j, rows, rmask);
            __m512i f[4];
            UNROLL
            for (int k = 0; k < 4; k++)
                f[k] = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(g, 24 - 8 * k), 24)));
            UNROLL
            for (int h = 0; h < 2; h++) /* (f[2h] >> 16) | (f[2h + 1] & top) */
                _mm512_store_si512(b[2 * j + h],
                                   _mm512_ternarylogic_epi32(_mm512_srli_epi32(f[2 * h], 16), f[2 * h + 1], top, 0xD8));
        }
        break;
    }
    default: { /* K-quants: value i is byte i's bits (shifted, masked) and, Q5_K / Q6_K, high bits from qh */
        const uint8_t *ql = fmt == Q4_K ? blk + 16 + 32 * (c / 2) : fmt == Q5_K ? blk + 48 + 32 * (c / 2)
                          : blk + 64 * (c / 4) + 32 * (c % 4 % 2);
        const uint8_t *qh = fmt == Q5_K ? blk + 16 : blk + 128 + 32 * (c / 4);
        const int lo_shift = fmt == Q6_K ? 4 * (c % 4 / 2) : 4 * (c % 2), hi_shift = fmt == Q6_K ? 2 * (c % 4) : c;
        const __m512i m15 = _mm512_set1_epi16(15), hmask = _mm512_set1_epi16(fmt == Q6_K ? 3 : 1);
        UNROLL
        for (int j = 0; j < 8; j++) {
            const __m512i g = gather4(ql + 4 * j, rows, rmask);
            __m512i gh = _mm512_setzero_si512();
            if (fmt != Q4_K) gh = gather4(qh + 4 * j, rows, rmask);
            UNROLL
            for (int h = 0; h < 2; h++) {
                __m512i q = _mm512_srl_epi16(bytes_to_words(g, 2 * h, 2 * h + 1), _mm_cvtsi32_si128(lo_shift));
                if (fmt != Q4_K) {
                    const __m512i u =
                        _mm512_srl_epi16(bytes_to_words(gh, 2 * h, 2 * h + 1), _mm_cvtsi32_si128(hi_shift));
                    q = _mm512_or_si512(_mm512_and_si512(q, m15), _mm512_slli_epi16(_mm512_and_si512(u, hmask), 4));
                }
                _mm512_store_si512(b[2 * j + h], fmt == Q6_K ? _mm512_permutex2var_epi16(tab, q, tab_hi)
                                                             : _mm512_permutexvar_epi16(q, tab));
            }
        }
    }
    }
}

/* x's row m, chunk ci of the segment, into the segment's A tiles: x = x1 + x2 + x3, xk = bf16(x - x1 - ...
 * - xk-1) (round to nearest even; each difference exact in fp32), so the three parts carry x's 24 bits and
 * each q * xk is exact in fp32. Also the chunk's sum of x (sx) for the min. */
INLINE void pack_x(const float *xr, int m, int mg, int64_t ci, uint32_t *xb, float *sx, const int fmt) {
    const int parts = fmt == Q6_K ? 6 : 3;
    __m512 v0 = _mm512_loadu_ps(xr), v1 = _mm512_loadu_ps(xr + 16);
    sx[ci * XG + m] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    uint32_t *t = xb + ci * parts * 16 * mg + 16 * m;
    for (int s = 0; s < 3; s++) {
        const __m512i p = (__m512i)_mm512_cvtne2ps_pbh(v1, v0); /* words 0..15: values 0..15, 16..31: 16..31 */
        const __m512i w0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(p));
        const __m512i w1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(p, 1));
        v0 = _mm512_sub_ps(v0, _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16))); /* x minus its bf16, exact */
        v1 = _mm512_sub_ps(v1, _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)));
        const __m512i q = nibble_pairs(fmt) ? _mm512_permutexvar_epi16(pairs, p) : p;
        if (fmt == Q6_K) { /* A tiles 0-2: values 0..15 (lanes 0..7), 3-5: 16..31, the other lanes zero */
            _mm512_store_si512(t + s * 16 * mg, _mm512_maskz_mov_epi32(0x00FF, q));
            _mm512_store_si512(t + (s + 3) * 16 * mg, _mm512_maskz_mov_epi32(0xFF00, q));
        } else {
            _mm512_store_si512(t + s * 16 * mg, q);
        }
    }
}

/* W's rows [0, nr) (nr <= 16) against x's packed rows over the segment's ncs chunks from chunk c0, into y
 * (y's rows [0, mg)): from zero on the first segment, else adding to y. Per chunk (a step; Q6_K: two, one a
 * half of 16 values with its own scale, the A tiles of the other half zero), per x row m and W row n:
 * y += d * (sum of x1 q + sum of x2 q + sum of x3 q) (+ or - m * sum of x), the C tile's fp32 sums of exact
 * products; so a row's result depends on that row of W and of x alone.
 *
 * A software pipeline: step s + 1's B rows are made (AVX-512 stores) while step s's tiles run, step s - 1's
 * C is stored and step s - 2's scaled; memory one side writes and the other reads waits until the stores
 * have left the core, so neither waits on the step it follows (header: measured). W's next tile of rows is
 * prefetched a row or more a step: the q8_0 lm_head at M = 8, 2 threads, 3 rounds: 2.2-2.7 ms with, 3.3-4.3
 * without; 3072 x 576 q4_1 64 against 68 us. */
INLINE void amx_tile(const uint8_t *w, int64_t row_bytes, int nr, int next, int64_t c0, int64_t ncs,
                     const uint32_t *xb, const float *sx, float *y, int64_t ldy, int mg, int first, const int fmt,
                     __m512i tab, __m512i tab_hi) {
    const int bb = block_bytes(fmt), nc = block_chunks(fmt), halves = fmt == Q6_K ? 2 : 1;
    const int has_min = fmt == Q4_1 || fmt == Q4_K || fmt == Q5_K;
    const int64_t steps = ncs * halves, rps = (16 + steps - 1) / steps; /* next tile's rows to prefetch a step */
    const int64_t seg0 = c0 / nc * bb, seg_bytes = (ncs + nc - 1) / nc * bb;
    _Alignas(64) uint32_t b[2][16][16];
    _Alignas(64) float c[2][16][16], d[4][16], mn[4][16];
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)row_bytes));
    const __mmask16 rmask = (__mmask16)((1u << nr) - 1);
    __m512 acc[XG]; /* acc[m]: x's row m, lane n: W's row n */
    UNROLL
    for (int m = 0; m < XG; m++)
        acc[m] = first || m >= mg ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(rmask, y + m * ldy);

    /* step s's B rows into b[s % 2], its scales into d[s % 4], mn[s % 4]; a share of the next tile prefetched */
#define PREP(s)                                                                                                \
    do {                                                                                                       \
        const int64_t cg_ = c0 + (s) / halves;                                                                 \
        const int h_ = (int)((s) % halves), cc_ = (int)(cg_ % nc), q_ = (int)((s) & 3);                       \
        for (int64_t r_ = (s) * rps; r_ < ((s) + 1) * rps && r_ < next; r_++)                                  \
            for (int64_t o_ = 0; o_ < seg_bytes; o_ += 64)                                                     \
                _mm_prefetch((const char *)(w + (16 + r_) * row_bytes + seg0 + o_), _MM_HINT_T0);             \
        const uint8_t *blk_ = w + cg_ / nc * bb;                                                               \
        b_rows(blk_, rows, rmask, fmt, cc_, tab, tab_hi, b[(s) & 1]);                                          \
        if (fmt <= Q8_0) { /* the 16 rows' fp16 d (and m) at the block's start */                              \
            const __m512i g_ = gather4(blk_, rows, rmask);                                                     \
            _mm512_store_ps(d[q_], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g_)));                                 \
            if (has_min) _mm512_store_ps(mn[q_], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g_, 16)))); \
        } else {                                                                                               \
            for (int r = 0; r < 16; r++) {                                                                     \
                float dd_[2] = {0.0f, 0.0f}, m_ = 0.0f;                                                        \
                if (r < nr) chunk_scales(blk_ + r * row_bytes, fmt, cc_, dd_, &m_);                            \
                d[q_][r] = dd_[h_], mn[q_][r] = -m_;                                                           \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)
    /* step s on B tile TB and C tile TC (TP: the other C, holding step s - 1) */
#define STEP(TB, TC, TP, s)                                                                                    \
    do {                                                                                                       \
        if ((s) + 1 < steps) PREP((s) + 1);                                                                    \
        const uint32_t *xt_ = xb + (s) * 3 * 16 * mg;                                                          \
        _tile_loadd(TB, b[(s) & 1], 64);                                                                       \
        _tile_zero(TC);                                                                                        \
        _tile_loadd(2, xt_, 64);                                                                               \
        _tile_loadd(3, xt_ + 16 * mg, 64);                                                                     \
        _tile_loadd(4, xt_ + 32 * mg, 64);                                                                     \
        if ((s) > 0) _tile_stored(TP, c[((s) - 1) & 1], 64); /* before step s's products: the unit runs in order */ \
        _tile_dpbf16ps(TC, 2, TB);                                                                             \
        _tile_dpbf16ps(TC, 3, TB);                                                                             \
        _tile_dpbf16ps(TC, 4, TB);                                                                             \
        if ((s) > 1) SCALE((s) - 2);                                                                           \
    } while (0)
    /* acc[m] += d * C[m] (+ mn * the chunk's sum of x's row m), step s's stored C; lanes: W's rows */
#define SCALE(s)                                                                                               \
    do {                                                                                                       \
        const float *sx_ = sx + (s) / halves * XG;                                                             \
        const __m512 d_ = _mm512_load_ps(d[(s) & 3]), mn_ = _mm512_load_ps(mn[(s) & 3]);                       \
        UNROLL                                                                                                 \
        for (int m = 0; m < XG; m++)                                                                           \
            if (m < mg) {                                                                                      \
                acc[m] = _mm512_fmadd_ps(d_, _mm512_load_ps(c[(s) & 1][m]), acc[m]);                           \
                if (has_min) acc[m] = _mm512_fmadd_ps(mn_, _mm512_set1_ps(sx_[m]), acc[m]);                    \
            }                                                                                                  \
    } while (0)
    PREP(0);
    for (int64_t s = 0; s < steps; s += 2) {
        STEP(1, 0, 7, s);
        if (s + 1 < steps) STEP(6, 7, 0, s + 1);
    }
    if (steps % 2) _tile_stored(0, c[(steps - 1) & 1], 64);
    else _tile_stored(7, c[(steps - 1) & 1], 64);
    if (steps > 1) SCALE(steps - 2);
    SCALE(steps - 1);
#undef PREP
#undef STEP
#undef SCALE
    UNROLL
    for (int m = 0; m < XG; m++)
        if (m < mg) _mm512_mask_storeu_ps(y + m * ldy, rmask, acc[m]);
}

/* One format's AMX product. Each thread takes a static share of W's tiles of 16 rows and, for each 16 rows
 * of x and each segment of K, packs x's segment itself (on its own stack) before its tiles: the same work on
 * every thread, but no barrier between packing and products, where a thread the machine's other jobs delay
 * holds all. */
INLINE void amx_share(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t t0, int64_t t1,
                      int64_t N, int64_t row_bytes, float *y, int64_t ldy, const int fmt) {
    _Alignas(64) uint32_t xb[KS / 32 * (fmt == Q6_K ? 6 : 3) * 16 * XG];
    _Alignas(64) float sx[KS / 32 * XG];
    const __m512i tab = q_table(fmt, 0), tab_hi = q_table(fmt, 1);
    const int64_t chunks = K / 32;
    for (int64_t m0 = 0; m0 < M; m0 += XG) {
        const int mg = M - m0 < XG ? (int)(M - m0) : XG;
        amx_configure(mg);
        for (int64_t c0 = 0; c0 < chunks; c0 += KS / 32) {
            const int64_t ncs = chunks - c0 < KS / 32 ? chunks - c0 : KS / 32;
            for (int64_t i = 0; i < ncs * mg; i++)
                pack_x(x + (m0 + i % mg) * ldx + (c0 + i / mg) * 32, (int)(i % mg), mg, i / mg, xb, sx, fmt);
            for (int64_t t = t0; t < t1; t++) {
                const int64_t n = 16 * t, nr = N - n < 16 ? N - n : 16;
                const int64_t next = t + 1 < t1 ? (N - n - 16 < 16 ? N - n - 16 : 16) : 0; /* rows of the next tile */
                amx_tile(w + n * row_bytes, row_bytes, (int)nr, (int)next, c0, ncs, xb, sx, y + m0 * ldy + n, ldy, mg,
                         c0 == 0, fmt, tab, tab_hi);
            }
        }
    }
    _tile_release();
}

#define AMX_FMT(FMT)                                                                                           \
    static void amx_##FMT(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,     \
                          int64_t row_bytes, float *y, int64_t ldy, int threads) {                            \
        const int64_t tiles = (N + 15) / 16;                                                                  \
        _Pragma("omp parallel num_threads(threads)")                                                          \
        {                                                                                                     \
            const int64_t share = (tiles + omp_get_num_threads() - 1) / omp_get_num_threads();               \
            const int64_t t0 = omp_get_thread_num() * share, t1 = t0 + share < tiles ? t0 + share : tiles;    \
            if (t0 < t1) amx_share(x, M, K, ldx, w, t0, t1, N, row_bytes, y, ldy, FMT);                       \
        }                                                                                                     \
    }
EACH_FMT(AMX_FMT)
#endif


#ifdef RAD_AVX2
/* SwiGLU: y [M, N] = silu(x @ G.T) * (x @ U.T) for an MLP's gate G and up U [N, K] (one format and row length),
 * one parallel region instead of two products and torch's silu and mul after them: each thread takes chunks
 * of SW_COLS output columns, their rows of G and of U through this build's product for the format (the AVX-512
 * tiles or the AVX2 tiles, the values a product of G or U alone gives: a row's sums do not depend on its
 * neighbours) into L1 buffers, then silu(g) * u over them in registers, as torch's fp32 silu computes it,
 * g / (1 + e^-g), with cpu_exp.h's e^x (within 2 units of fp32 rounding of torch's). Refused (-1) where the AMX
 * path takes the format at M: its products are faster apart (the caller runs them, then the silu). Why: the
 * silu and mul after two products of [8, 1536] took 17 + 5 us a layer in a decode step on the Zen 4 EPYC (a fresh
 * copy: 7 + 2), their input half in the other core's cache, and the second product's call and region ~7 us more. */
#define SW_COLS 16 /* output columns a chunk */
#define SW_ROWS 64 /* rows of x at most (a decode batch, a short prefill chunk): the chunk's buffers on the stack */

/* buf [M, nr] (row stride SW_COLS) = x @ W[0 .. nr).T, W's nr (<= SW_COLS) rows of row_bytes each */
INLINE void chunk_product(const float *x, int64_t M, int64_t ldx, const uint8_t *w, int64_t row_bytes, int64_t nb,
                          int nr, float *buf, const int fmt) {
    for (int r = 0; r < nr; r += WR) rows_at(x, M, ldx, w, row_bytes, nb, buf, SW_COLS, fmt, r, nr);
}

/* y's nr columns of each of M rows = silu(g) * u (cpu_exp.h), g and u rows SW_COLS apart */
static inline void silu_mul(const float *g, const float *u, int64_t M, int nr, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) rad_silu_mul(g + m * SW_COLS, u + m * SW_COLS, y + m * ldy, nr);
}

#define SWIGLU_FMT(FMT)                                                                                        \
    static void swiglu_##FMT(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *wg,            \
                             const uint8_t *wu, int64_t N, int64_t row_bytes, float *y, int64_t ldy,          \
                             int threads) {                                                                   \
        const int64_t nb = K / (32 * block_chunks(FMT)), chunks = (N + SW_COLS - 1) / SW_COLS;               \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                     \
        for (int64_t c = 0; c < chunks; c++) {                                                                \
            _Alignas(32) float g[SW_ROWS * SW_COLS], u[SW_ROWS * SW_COLS];                                    \
            const int64_t n = c * SW_COLS;                                                                    \
            const int nr = N - n < SW_COLS ? (int)(N - n) : SW_COLS;                                         \
            chunk_product(x, M, ldx, wg + n * row_bytes, row_bytes, nb, nr, g, FMT);                          \
            chunk_product(x, M, ldx, wu + n * row_bytes, row_bytes, nb, nr, u, FMT);                          \
            silu_mul(g, u, M, nr, y + n, ldy);                                                                \
        }                                                                                                     \
    }
EACH_FMT(SWIGLU_FMT)
#endif

#ifndef RAD_AVX2
static void row(const float *x, int64_t M, int64_t ldx, const uint8_t *wrow, int64_t nb, int fmt, float *y,
                int64_t ldy) {
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
}
#endif

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T, W's N rows of row_bytes each; on
 * `threads` OpenMP threads (torch's own runtime: the same libgomp.so.1 is already loaded). */
void rad_blocks_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                       int64_t row_bytes, int fmt, float *y, int64_t ldy, int threads) {
#ifdef RAD_AMX
#define CALL_AMX(FMT) case FMT: amx_##FMT(x, M, K, ldx, w, N, row_bytes, y, ldy, threads); return;
    if (M >= amx_min[fmt] && amx_granted()) switch (fmt) { EACH_FMT(CALL_AMX) }
#endif
#ifdef RAD_AVX2
#define CALL_MATMUL(FMT) case FMT: matmul_##FMT(x, M, K, ldx, w, N, row_bytes, y, ldy, threads); break;
    switch (fmt) { EACH_FMT(CALL_MATMUL) }
#else
    const int64_t nb = K / (32 * block_chunks(fmt));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) row(x, M, ldx, w + n * row_bytes, nb, fmt, y + n, ldy);
#endif
}

/* y [M, N] (row stride ldy) = silu(x @ G.T) * (x @ U.T), G at wg and U at wu, N rows of row_bytes each: 0 when
 * done, -1 where this build and process do not fuse it (no AVX2, M past SW_ROWS, or the AMX path takes fmt at M):
 * the caller runs the two products and the silu itself */
int rad_blocks_swiglu(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *wg, const uint8_t *wu,
                      int64_t N, int64_t row_bytes, int fmt, float *y, int64_t ldy, int threads) {
#ifdef RAD_AMX
    if (M >= amx_min[fmt] && amx_granted()) return -1;
#endif
#ifdef RAD_AVX2
    if (M <= SW_ROWS) {
#define CALL_SWIGLU(FMT) case FMT: swiglu_##FMT(x, M, K, ldx, wg, wu, N, row_bytes, y, ldy, threads); return 0;
        switch (fmt) { EACH_FMT(CALL_SWIGLU) }
    }
#else
    (void)x, (void)M, (void)K, (void)ldx, (void)wg, (void)wu, (void)N, (void)row_bytes, (void)fmt, (void)y;
    (void)ldy, (void)threads;
#endif
    return -1;
}

/* rows of x past which dequantizing W (rad_blocks_dequantize) and a GEMM library beat rad_blocks_matmul on
 * format fmt in this build and process, 0 where the product is faster at every M measured (header) */
int rad_blocks_gemm_rows(int fmt) {
    const int tiles = fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0;
#ifdef RAD_AMX
    if (tiles && amx_granted()) return 0;
#endif
#ifdef RAD_ZMM
    if (tiles) return ZMM_GEMM_ROWS;
#endif
    (void)tiles;
    return AVX2_GEMM_ROWS;
}

/* rows of x from which rad_blocks_matmul runs the AMX path for format fmt on this machine and process; 0
 * where it does not (built without AMX, or the kernel refused the tile state) */
int rad_blocks_amx_rows(int fmt) {
#ifdef RAD_AMX
    return amx_granted() ? amx_min[fmt] : 0;
#else
    (void)fmt;
    return 0;
#endif
}

/* out [N, K] fp32 = W's values (gguf's dequantization, bit for bit) */
void rad_blocks_dequantize(const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, int fmt, float *out,
                           int threads) {
#ifdef RAD_AVX2
#define CALL_DEQUANT(FMT) case FMT: dequant_##FMT(w, N, K, row_bytes, out, threads); break;
    switch (fmt) { EACH_FMT(CALL_DEQUANT) }
#else
    const int nc = block_chunks(fmt), bb = block_bytes(fmt);
    const int64_t nb = K / (32 * nc);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++)
            for (int c = 0; c < nc; c++) dequant_scalar(w + n * row_bytes + b * bb, fmt, c, out + n * K + (b * nc + c) * 32);
#endif
}
