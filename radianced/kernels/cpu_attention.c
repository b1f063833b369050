/* One decode step's attention over the host backend's paged KV cache, K and V read in place from the cache
 * pair's rows (kernels/cpu_attention.py says why and what it was measured at; kernels/cpu.py `_Rows` the layout).
 *
 * The cache pair is rows of Hkv * D fp32 values (`kv`): token c of sequence b is the row
 * block_rows[b, c / S] + c % S, its V row that plus v_rows. Each (sequence, KV head) pair is one task: its
 * Hq / Hkv query heads go over the head's keys together (each key and value row fetched once), in chunks of
 * CHUNK keys: the chunk's scores (q . k, then times scale, as the reference rounds them), one rescale of the
 * running sums to the chunk's maximum, then e^(score - max) and the weighted V rows added. Output
 * o = sum p v / sum p. All in fp32; no key past a sequence's length is read. No allocation, no state: safe
 * from any thread.
 *
 * A dot product keeps 8 lane sums, added across lanes at the end (8 keys' together where AVX2 is compiled in and
 * D is a multiple of 8); each output value's weighted V sum runs in key order. Measured per step below
 * (kernels/cpu_attention.py).
 *
 * In a decode step the context comes from memory, not cache (each layer's weights pass in between): each task's
 * first chunk of K rows is prefetched (into L2) while the prologue runs, each chunk's V rows and the next chunk's K
 * rows while the chunk is scored. SmolLM2 at b8, 2 threads, contexts ~45-125 (tools/cpu_step.py, 3 interleaved
 * runs of 80 steps): the attention 4.85 -> 3.9 ms a step, the step 20.1 -> 18.9 ms; b1 the same. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define CHUNK 32 /* keys scored before one rescale */
#define G_MAX 16 /* query heads a KV head (GQA ratio) */
#define LANES 8

/* e^x (cpu_exp.h): every argument here is a score less the running maximum, <= 0 */
#include "cpu_exp.h"
#include "cpu_kernels.h" /* rad_decode_attention's declaration */

/* p[0 .. n - 1] = e^(p - top), summed (in order) into *l */
static inline void exps(float *p, int64_t n, float top, float *l) {
    int64_t t = 0;
#ifdef __AVX2__
    for (; t + 8 <= n; t += 8)
        _mm256_storeu_ps(p + t, rad_exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(top))));
#endif
    for (; t < n; t++) p[t] = rad_expf(p[t] - top);
    for (t = 0; t < n; t++) *l += p[t];
}

#ifdef __AVX2__
/* the 8 scores q . k_u of the keys at kv + at[u] (d a multiple of 8): each key's 8 lane sums, then the 8 keys'
 * lanes added together (hadd: lanes 0+1, 2+3, those two, then the halves), one vector of 8 scores. 8 keys
 * at a time: 8 independent sums and one reduction instead of 8 (a dot and its reduction a key took the kernel
 * 60 -> 50 us at b8, contexts 45-70, one thread). */
static inline __m256 dot8(const float *q, const float *kv, const int64_t *at, int64_t d) {
    __m256 a[8];
    for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 x = _mm256_loadu_ps(q + i);
        for (int u = 0; u < 8; u++) a[u] = _mm256_add_ps(a[u], _mm256_mul_ps(x, _mm256_loadu_ps(kv + at[u] + i)));
    }
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

/* a . b over d values: 8 lane sums, added in lane order at the end */
static inline float dot(const float *a, const float *b, int64_t d) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += a[i + l] * b[i + l];
    for (int l = 0; i < d; i++, l++) lane[l] += a[i] * b[i];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += lane[l];
    return s;
}

/* p[j][t] = (q_j . k_t) * scale for the chunk's cn keys (K row t at kv + at[t]) and the g heads */
static inline void scores(const float *q, const float *kv, int64_t *at, int64_t cn, int64_t g, int64_t d,
                          float scale, float (*p)[CHUNK]) {
#ifdef __AVX2__
    if (d % 8 == 0) {
        for (int64_t t = cn; t < (cn + 7) / 8 * 8; t++) at[t] = at[cn - 1]; /* a last 8 filled with a read key */
        for (int64_t t = 0; t < cn; t += 8)
            for (int64_t j = 0; j < g; j++)
                _mm256_storeu_ps(p[j] + t, _mm256_mul_ps(dot8(q + j * d, kv, at + t, d), _mm256_set1_ps(scale)));
        return;
    }
#endif
    for (int64_t t = 0; t < cn; t++)
        for (int64_t j = 0; j < g; j++) p[j][t] = dot(q + j * d, kv + at[t], d) * scale;
}

#ifdef __AVX2__
/* add_values' work for NJ (a constant) heads from j: their 8 sums at i kept in registers over the chunk */
static inline __attribute__((always_inline)) void values_at(float *o, const float (*p)[CHUNK], const float *v,
                                                            const int64_t *at, int64_t cn, int64_t j, int64_t d,
                                                            int64_t i, const int NJ) {
    __m256 acc[4];
    for (int h = 0; h < NJ; h++) acc[h] = _mm256_loadu_ps(o + (j + h) * d + i);
    for (int64_t t = 0; t < cn; t++) {
        const __m256 x = _mm256_loadu_ps(v + at[t] + i);
        for (int h = 0; h < NJ; h++) acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(_mm256_set1_ps(p[j + h][t]), x));
    }
    for (int h = 0; h < NJ; h++) _mm256_storeu_ps(o + (j + h) * d + i, acc[h]);
}
#endif

/* o[j] += sum over the chunk's keys t of p[j][t] v_t, for the g heads (V row t at v + at[t]): each sum in key
 * order, so the same values whichever way it runs. With AVX2 and D a multiple of 8, up to 4 heads' 8 sums at a
 * time stay in registers over the chunk (o read and written once a chunk, not once a key: the store-bound
 * lane-wise loop was ~30% of the kernel, which took 75 -> 61 us at b8, one thread); otherwise lane-wise over o. */
static inline void add_values(float *o, const float (*p)[CHUNK], const float *v, const int64_t *at, int64_t cn,
                              int64_t g, int64_t d) {
#ifdef __AVX2__
    if (d % 8 == 0) {
        for (int64_t i = 0; i < d; i += 8)
            for (int64_t j = 0; j < g; j += 4) switch (g - j < 4 ? g - j : 4) {
                case 4: values_at(o, p, v, at, cn, j, d, i, 4); break;
                case 3: values_at(o, p, v, at, cn, j, d, i, 3); break;
                case 2: values_at(o, p, v, at, cn, j, d, i, 2); break;
                default: values_at(o, p, v, at, cn, j, d, i, 1);
                }
        return;
    }
#endif
    for (int64_t t = 0; t < cn; t++)
        for (int64_t j = 0; j < g; j++) {
            const float w = p[j][t], *x = v + at[t];
            float *oj = o + j * d;
            for (int64_t i = 0; i < d; i++) oj[i] += w * x[i];
        }
}

/* at[t] = the offset (in floats) of key c0 + t's K row, for the n keys from c0 */
static inline void key_rows(const int64_t *block_rows, int64_t bs, int64_t row, int64_t c0, int64_t n, int64_t *at) {
    for (int64_t t = 0; t < n; t++) at[t] = (block_rows[(c0 + t) / bs] + (c0 + t) % bs) * row;
}

/* the d floats at base + at[t] for the n rows, into the cache (a cache line a 16 floats) */
static inline void prefetch_rows(const float *base, const int64_t *at, int64_t n, int64_t d) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(base + at[t] + i, 0, 3);
}

/* the online softmax's running state of g heads: maxima m, sums l, outputs o (g rows of D) at zero */
static inline void softmax_start(int64_t g, int64_t d, float *m, float *l, float *o) {
    for (int64_t j = 0; j < g; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        for (int64_t i = 0; i < d; i++) o[j * d + i] = 0.0f;
    }
}

/* a chunk's scores p (cn keys, g heads) into weights e^(p - max), the sums so far rescaled to the new maximum
 * (none before the first chunk: `first`) */
static inline void softmax_chunk(float (*p)[CHUNK], int64_t cn, int64_t g, int64_t d, int first, float *m, float *l,
                                 float *o) {
    for (int64_t j = 0; j < g; j++) {
        float top = m[j];
        for (int64_t t = 0; t < cn; t++) top = p[j][t] > top ? p[j][t] : top;
        if (top > m[j]) {
            if (!first) {
                const float r = rad_expf(m[j] - top);
                l[j] *= r;
                for (int64_t i = 0; i < d; i++) o[j * d + i] *= r;
            }
            m[j] = top;
        }
        exps(p[j], cn, top, &l[j]);
    }
}

/* o = sum p v / sum p; n = 0: 0 / 0 would be NaN, so no key read is an output of zeros */
static inline void softmax_end(int64_t g, int64_t d, const float *l, float *o) {
    for (int64_t j = 0; j < g; j++)
        if (l[j] > 0.0f)
            for (int64_t i = 0; i < d; i++) o[j * d + i] /= l[j];
}

/* one (sequence, KV head): the g query heads at q (D apart) over its n keys, into o (g rows of D) */
static void attend(const float *q, const float *kv, int64_t row, int64_t v_rows, const int64_t *block_rows,
                   int64_t bs, int64_t n, int64_t g, int64_t d, float scale, float *o) {
    float m[G_MAX], l[G_MAX], p[G_MAX][CHUNK];
    int64_t rows[2][CHUNK], *at = rows[0], *next = rows[1]; /* this chunk's key rows, the next one's */
    softmax_start(g, d, m, l, o);
    key_rows(block_rows, bs, row, 0, n < CHUNK ? n : CHUNK, at);
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t cn = n - c0 < CHUNK ? n - c0 : CHUNK;
        prefetch_rows(kv + v_rows * row, at, cn, d); /* the chunk's V rows, read after its scores */
        if (c0 + CHUNK < n) { /* the next chunk's K rows */
            const int64_t nn = n - c0 - CHUNK < CHUNK ? n - c0 - CHUNK : CHUNK;
            key_rows(block_rows, bs, row, c0 + CHUNK, nn, next);
            prefetch_rows(kv, next, nn, d);
        }
        scores(q, kv, at, cn, g, d, scale, p);
        softmax_chunk(p, cn, g, d, c0 == 0, m, l, o);
        add_values(o, p, kv + v_rows * row, at, cn, g, d);
        int64_t *done = at; /* the next chunk's rows, found above, are its own */
        at = next;
        next = done;
    }
    softmax_end(g, d, l, o);
}

/* y = rotate-half RoPE of x (d values) by the row's cos and signed sin (r values each, -sin on the first half):
 * y_i = x_i cos_i + x_(i + r/2 mod r) sin_i for i < r, each product rounded, then their sum (the build's
 * -ffp-contract=off: no fused multiply-add), which is kernels/cpu.py `_rotate`'s x * cos + roll(x) * sin bit for
 * bit; the values past r pass. */
static inline void rotate(const float *x, const float *cos, const float *sin, int64_t r, int64_t d, float *y) {
    const int64_t half = r / 2;
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int64_t i = half; i < r; i++) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
    for (int64_t i = r; i < d; i++) y[i] = x[i];
}

/* out [B, Hq, D] = attention of q [B, Hq, D] (rows ldq apart, heads D apart) over each sequence b's lens[b]
 * keys: K rows of kv (Hkv * D values a row) at block_rows[b, c / bs] + c % bs (block_rows: [B, nb]), V rows
 * v_rows further. Query head i reads KV head i / (Hq / Hkv). On `threads` OpenMP threads, a (b, KV head)
 * pair each task.
 *
 * First the step's new token (the decode layer's prologue, kernels/cpu.py `_decode`): q and k [B, Hkv, D]
 * (rows ldk apart) rotated by row b's cos and sin (`rotate`: [B, r] each), the rotated q into q_rot
 * [B, Hq, D] (what is attended), and where write_rows[b] >= 0 the rotated k into K row write_rows[b] and v
 * (rows ldv apart) into its V row; all written (one barrier) before any key is read, as the torch path's
 * write precedes its read. */
void rad_decode_attention(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                          const float *cos, const float *sin, int64_t r, const int64_t *write_rows, float *q_rot,
                          float *kv, int64_t v_rows, const int64_t *block_rows, int64_t nb, const int64_t *lens,
                          int64_t bs, int64_t B, int64_t hq, int64_t hkv, int64_t d, float scale, float *out,
                          int threads) {
    const int64_t g = hq / hkv, row = hkv * d;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * hkv; task++) {
            const int64_t b = task / hkv, h = task % hkv;
            const float *cb = cos + b * r, *sb = sin + b * r;
            for (int64_t j = h * g; j < (h + 1) * g; j++)
                rotate(q + b * ldq + j * d, cb, sb, r, d, q_rot + (b * hq + j) * d);
            if (write_rows[b] >= 0) {
                float *kr = kv + write_rows[b] * row + h * d;
                rotate(k + b * ldk + h * d, cb, sb, r, d, kr);
                memcpy(kr + v_rows * row, v + b * ldv + h * d, d * sizeof(float));
            }
            int64_t first[CHUNK]; /* the task's first K rows, on their way (into L2) */
            const int64_t fn = lens[b] < CHUNK ? lens[b] : CHUNK;
            key_rows(block_rows + b * nb, bs, row, 0, fn, first);
            for (int64_t t = 0; t < fn; t++)
                for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(kv + h * d + first[t] + i, 0, 2);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * hkv; task++) {
            const int64_t b = task / hkv, h = task % hkv;
            attend(q_rot + b * hq * d + h * g * d, kv + h * d, row, v_rows, block_rows + b * nb, bs, lens[b], g, d, scale,
                   out + (b * hq + h * g) * d);
        }
    }
}


/* -- quantized planes (kernels/kv_formats.py: fp8, int6, int4): a decode step's keys and values read as codes -- */

#define D_MAX 256 /* head dims the planes' path holds a chunk of (K and V: 2 x 32 KiB on the stack) */
#define GROUP 32  /* dims per (step, min) of an int plane (kv_formats.GROUP) */
enum { PLANE_FP8 = 0, PLANE_INT6 = 1, PLANE_INT4 = 2 }; /* a plane's kind (cpu_attention.py `PLANE_KINDS`) */

/* an fp16 value's bits as fp32 (exact: every fp16 value is an fp32 value) */
static inline float half_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) {
        v = (float)m * 0x1p-24f; /* subnormal: m x 2^-24, exact */
    } else {
        const uint32_t bits = e == 31 ? 0x7f800000u | m << 13 : (e + 112) << 23 | m << 13; /* rebias 15 -> 127 */
        memcpy(&v, &bits, sizeof v);
    }
    return h & 0x8000 ? -v : v;
#endif
}

/* out[i] = E4M3 code c[i] x s, for the d codes: what kernels/kv_quant.py `fp8_dequantize` computes, bit for bit
 * (the code's value is exact in fp32, its product with s rounded once; E4M3's NaN codes, 0x7F and 0xFF, NaN).
 * With F16C: the code's sign and 7 magnitude bits moved into an fp16's (E4M3's exponent bias 7 against fp16's
 * 15: the fp16 is the value / 2^8, subnormals included), converted 8 at a time, times s x 2^8 (both scalings
 * exact); fp16 has no NaN there (its exponent 15 is a normal one), so those codes are made NaN after. */
static inline void fp8_values(const uint8_t *c, float s, int64_t d, float *out) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    const __m256 sv = _mm256_set1_ps(s * 256.0f), nan = _mm256_set1_ps(NAN);
    const __m128i sign = _mm_set1_epi16(0x80), mag = _mm_set1_epi16(0x7F);
    for (; i + 8 <= d; i += 8) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(c + i)));
        const __m128i m = _mm_and_si128(b, mag);
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign), 8), _mm_slli_epi16(m, 7));
        const __m256 is_nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(m, mag)));
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), sv), nan, is_nan));
    }
#endif
    for (; i < d; i++) { /* the same fp16 made by hand: sign, then the 7 bits under fp16's exponent */
        const uint16_t h = (uint16_t)((c[i] & 0x80) << 8 | (c[i] & 0x7F) << 7);
        out[i] = (c[i] & 0x7F) == 0x7F ? NAN : half_float(h) * (s * 256.0f);
    }
}

/* an int plane's code of dim i: int4 two a byte, the even dim in the low nibble; int6 four in three bytes,
 * little-endian, dim 0 lowest */
static inline uint32_t int_code(const uint8_t *c, int kind, int64_t i) {
    if (kind == PLANE_INT4) return c[i / 2] >> (4 * (i & 1)) & 15u;
    const uint8_t *w = c + 3 * (i / 4);
    return ((uint32_t)w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16) >> (6 * (i & 3)) & 63u;
}

#ifdef __AVX2__
/* the codes of dims i .. i + 7 (i a multiple of 8) as 8 int32 lanes */
static inline __m256i int_codes8(const uint8_t *c, int kind, int64_t i) {
    if (kind == PLANE_INT4) { /* 4 bytes: each byte's low nibble, then its high one */
        uint32_t w;
        memcpy(&w, c + i / 2, sizeof w);
        const __m256i b = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        return _mm256_and_si256(b, _mm256_set1_epi32(15));
    }
    const uint8_t *b = c + 3 * (i / 4); /* 6 bytes: two 24-bit words of four codes each */
    const int w0 = b[0] | b[1] << 8 | b[2] << 16, w1 = b[3] | b[4] << 8 | b[5] << 16;
    const __m256i w = _mm256_setr_epi32(w0, w0, w0, w0, w1, w1, w1, w1);
    return _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18)),
                            _mm256_set1_epi32(63));
}
#endif

/* an int plane's d values of one token-head: codes c (`int_code`) and per group of GROUP dims an fp16 (step, min)
 * at sm: q * step + min, each product and sum rounded once: kernels/kv_quant.py `int_dequantize`'s, bit for bit */
static inline void int_values(const uint8_t *c, const uint16_t *sm, int kind, int64_t d, float *out) {
    for (int64_t g0 = 0; g0 < d; g0 += GROUP) {
        const float step = half_float(sm[2 * (g0 / GROUP)]), lo = half_float(sm[2 * (g0 / GROUP) + 1]);
        const int64_t end = g0 + GROUP < d ? g0 + GROUP : d;
        int64_t i = g0;
#ifdef __AVX2__
        const __m256 sv = _mm256_set1_ps(step), mv = _mm256_set1_ps(lo);
        for (; i + 8 <= end; i += 8)
            _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(int_codes8(c, kind, i)), sv), mv));
#endif
        for (; i < end; i++) out[i] = (float)int_code(c, kind, i) * step + lo;
    }
}

/* a plane's layout, as kernels/kv_quant.py `KVPlane` views it: the codes of (block id, token t, head h) at
 * codes + (id / per_page) * cs[0] + (id % per_page) * cs[1] + t * cs[2] + h * cs[3] (bytes); its fp16 scale (fp8)
 * or (step, min) pairs (int) at scales + the same with ss (elements), the pairs contiguous */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    const int64_t *cs, *ss;
    int64_t per_page;
    int kind;
} q_plane;

/* where head h of block `id` starts in plane `pl`: its token 0's codes and scales (tokens cs[2] / ss[2] further) */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
} plane_at;

static inline plane_at block_at(const q_plane *pl, int64_t id, int64_t h) {
    const int64_t p = id / pl->per_page, i = id % pl->per_page;
    return (plane_at){pl->codes + p * pl->cs[0] + i * pl->cs[1] + h * pl->cs[3],
                      pl->scales + p * pl->ss[0] + i * pl->ss[1] + h * pl->ss[3]};
}

/* token t's d dequantized values of a block's head (`block_at`) into out: `kv_quant.dequantize`'s, bit for bit */
static inline void token_values(const q_plane *pl, plane_at at, int64_t t, int64_t d, float *out) {
    if (pl->kind == PLANE_FP8)
        fp8_values(at.codes + t * pl->cs[2], half_float(at.scales[t * pl->ss[2]]), d, out);
    else
        int_values(at.codes + t * pl->cs[2], at.scales + t * pl->ss[2], pl->kind, d, out);
}

/* o (g rows of d) = o @ C: a rotated V's weighted sums brought back from the DCT basis C [d, d] (row-major), each
 * value a sum over the basis rows in order */
static inline void unrotate(float *o, const float *C, int64_t g, int64_t d) {
    float y[D_MAX];
    for (int64_t j = 0; j < g; j++) {
        float *oj = o + j * d;
        for (int64_t i = 0; i < d; i++) y[i] = 0.0f;
        for (int64_t k = 0; k < d; k++)
            for (int64_t i = 0; i < d; i++) y[i] += oj[k] * C[k * d + i];
        memcpy(oj, y, d * sizeof(float));
    }
}

/* `attend` over quantized planes: each chunk of keys dequantized into buffers first (K a delta plane: a block's
 * token 0 stored as itself, every later token as its residual from it, so k = residual + token 0's value, as
 * `KVPlane.blocks` adds them), then the same scores, softmax and sums; a rotated V (basis C, else NULL) is summed
 * in its basis and brought back once (attention is linear in V). A block's addresses and its token 0's K values
 * are found once, as its first key is reached. block_ids: the sequence's block-table row (flat ids). */
static void attend_planes(const float *q, const q_plane *kp, const q_plane *vp, const float *C, int64_t h,
                          const int64_t *block_ids, int64_t bs, int64_t n, int64_t g, int64_t d, float scale,
                          float *o) {
    float m[G_MAX], l[G_MAX], p[G_MAX][CHUNK], first[D_MAX];
    float kb[CHUNK * D_MAX], vb[CHUNK * D_MAX];
    int64_t at[CHUNK], bi = 0, off = 0; /* the next key's block (in the table) and token in it */
    plane_at kat = {0}, vat = {0};
    softmax_start(g, d, m, l, o);
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t cn = n - c0 < CHUNK ? n - c0 : CHUNK;
        for (int64_t t = 0; t < CHUNK; t++) at[t] = t * d; /* `scores` pads a last partial 8 in place */
        for (int64_t t = 0; t < cn; t++) {
            float *k = kb + t * d;
            if (off == 0) { /* a block's first key (a sequence's keys start at one): its addresses, K's base */
                kat = block_at(kp, block_ids[bi], h);
                vat = block_at(vp, block_ids[bi], h);
                token_values(kp, kat, 0, d, first);
            }
            if (off) {
                token_values(kp, kat, off, d, k);
                for (int64_t i = 0; i < d; i++) k[i] += first[i];
            } else {
                memcpy(k, first, d * sizeof(float));
            }
            token_values(vp, vat, off, d, vb + t * d);
            if (++off == bs) {
                off = 0;
                bi++;
            }
        }
        scores(q, kb, at, cn, g, d, scale, p);
        softmax_chunk(p, cn, g, d, c0 == 0, m, l, o);
        add_values(o, p, vb, at, cn, g, d);
    }
    softmax_end(g, d, l, o);
    if (C) unrotate(o, C, g, d);
}

/* the K and V planes of `P` */
static inline q_plane k_plane(const rad_kv_planes *P) {
    return (q_plane){P->k_codes, P->k_scales, P->kcs, P->kss, P->per_page, (int)P->k_kind};
}

static inline q_plane v_plane(const rad_kv_planes *P) {
    return (q_plane){P->v_codes, P->v_scales, P->vcs, P->vss, P->per_page, (int)P->v_kind};
}

/* out [B, Hq, D] = attention of q [B, Hq, D] (contiguous) over each sequence b's lens[b] keys in the planes `P`,
 * key c in block block_ids[b, c / bs] (block_ids: [B, nb] flat block ids) at token c % bs; Hq / Hkv query heads a
 * KV head, d at most D_MAX. On `threads` OpenMP threads, a (b, KV head) pair each task. */
void rad_decode_attention_planes(const float *q, const rad_kv_planes *P, const int64_t *block_ids, int64_t nb,
                                 const int64_t *lens, int64_t bs, int64_t B, int64_t hq, int64_t hkv, int64_t d,
                                 float scale, float *out, int threads) {
    const int64_t g = hq / hkv;
    const q_plane kp = k_plane(P), vp = v_plane(P);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < B * hkv; task++) {
        const int64_t b = task / hkv, h = task % hkv;
        attend_planes(q + (b * hq + h * g) * d, &kp, &vp, P->basis, h, block_ids + b * nb, bs, lens[b], g, d, scale,
                      out + (b * hq + h * g) * d);
    }
}

/* -- quantized planes written: kernels/kv_quant.py `KVPlane.store`, its bytes bit for bit (a rotated plane's up to
 * its rotation's last bit: a sum over the dims in order, where the reference is a torch matmul) ------------- */

/* float -> fp16 bits, rounded to nearest even: F16C's, or by hand (a NaN as fp16's quiet NaN, magnitudes from
 * 65520 on, which round past fp16's largest, as infinities) */
static inline uint16_t float_half(float x) {
#ifdef __F16C__
    return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    const uint16_t sign = (uint16_t)(b >> 16 & 0x8000);
    const float a = fabsf(x);
    if (a != a) return sign | 0x7E00;
    if (a >= 65520.0f) return sign | 0x7C00;
    if (a < 0x1p-14f) return sign | (uint16_t)nearbyintf(a * 0x1p24f); /* subnormal: units of 2^-24 */
    memcpy(&b, &a, sizeof b);
    uint32_t h = ((b >> 23) - 112) << 10 | (b >> 13 & 1023), rem = b & 0x1FFF; /* a carry moves the exponent */
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return sign | (uint16_t)h;
#endif
}

/* the E4M3 code of y (|y| <= 448, or NaN), rounded to nearest even as torch's float8_e4m3fn conversion */
static inline uint8_t e4m3_code(float y) {
    uint32_t b;
    memcpy(&b, &y, sizeof b);
    const uint8_t sign = (uint8_t)(b >> 24 & 0x80);
    const float a = fabsf(y);
    if (a != a) return sign | 0x7F;
    if (a < 0x1p-6f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* subnormal: units of 2^-9; 8 is 2^-6's code */
    memcpy(&b, &a, sizeof b);
    uint32_t e = (b >> 23) - 120, m = b >> 20 & 7, rem = b & 0xFFFFF; /* E4M3's exponent (bias 7), 3 bits */
    if (rem > 0x80000 || (rem == 0x80000 && (m & 1))) {
        if (++m == 8) {
            m = 0;
            e++;
        }
    }
    return sign | (uint8_t)(e << 3 | m);
}

/* one token-head's d values x into its codes and scale: `fp8_scale` (amax / 448 in fp16, one fp16 step up where
 * that went below) and `fp8_quantize` (x / scale, clamped to 448, its E4M3 code; all 0 for a zero scale) */
static inline void fp8_put(const float *x, int64_t d, uint8_t *codes, uint16_t *scale) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax || a != a ? a : amax; /* NaN wins, as torch's amax */
    }
    uint16_t h = float_half(amax / 448.0f);
    if (half_float(h) * 448.0f < amax) h++; /* one step up (a positive fp16's next value is its bits + 1) */
    *scale = h;
    const float s = half_float(h);
    for (int64_t i = 0; i < d; i++) {
        float y = s > 0.0f ? x[i] / s : 0.0f;
        y = y > 448.0f ? 448.0f : y < -448.0f ? -448.0f : y;
        codes[i] = e4m3_code(y);
    }
}

/* one token-head's d values x of an int plane (`kind`) into its packed codes and per group of GROUP dims its fp16
 * (step, min) at sm: `int_quantize`'s, bit for bit: min rounded to fp16 first, step = (max - min) / top rounded to
 * fp16, each code (x - min) / step rounded half to even and clamped to 0..top (0 where the step is 0) */
static inline void int_put(const float *x, int64_t d, int kind, uint8_t *codes, uint16_t *sm) {
    const float top = kind == PLANE_INT4 ? 15.0f : 63.0f;
    uint8_t q[D_MAX + 4] = {0}; /* past d: zeros, as `pack` pads */
    for (int64_t g0 = 0; g0 < d; g0 += GROUP) {
        const int64_t end = g0 + GROUP < d ? g0 + GROUP : d;
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t i = g0; i < end; i++) {
            lo = x[i] < lo || x[i] != x[i] ? x[i] : lo; /* NaN wins, as torch's amin and amax */
            hi = x[i] > hi || x[i] != x[i] ? x[i] : hi;
        }
        const uint16_t lo16 = float_half(lo);
        const float m = half_float(lo16);
        const uint16_t step16 = float_half((hi - m) / top);
        const float st = half_float(step16);
        sm[2 * (g0 / GROUP)] = step16;
        sm[2 * (g0 / GROUP) + 1] = lo16;
        for (int64_t i = g0; i < end; i++) {
            float y = st > 0.0f ? nearbyintf((x[i] - m) / st) : 0.0f;
            y = y >= 0.0f ? (y > top ? top : y) : 0.0f; /* a NaN (a NaN in the group) codes 0, not undefined */
            q[i] = (uint8_t)y;
        }
    }
    if (kind == PLANE_INT4) {
        for (int64_t j = 0; j < (d + 1) / 2; j++) codes[j] = (uint8_t)(q[2 * j] | q[2 * j + 1] << 4);
    } else {
        for (int64_t j = 0; j < (d + 3) / 4; j++) {
            const uint32_t w = q[4 * j] | q[4 * j + 1] << 6 | q[4 * j + 2] << 12 | (uint32_t)q[4 * j + 3] << 18;
            codes[3 * j] = (uint8_t)w;
            codes[3 * j + 1] = (uint8_t)(w >> 8);
            codes[3 * j + 2] = (uint8_t)(w >> 16);
        }
    }
}

/* one token-head's d values into a plane of `kind` */
static inline void put(const float *x, int64_t d, int kind, uint8_t *codes, uint16_t *scales) {
    if (kind == PLANE_FP8)
        fp8_put(x, d, codes, scales);
    else
        int_put(x, d, kind, codes, scales);
}

/* KVPlane.store for a plane (`q_plane`: strides [page, block, token, head]): x [T, Hkv, D] (rows ldx apart, each
 * row's heads contiguous) into the flat slots [T] (block slot / bs, token slot % bs; -1: the row is not written;
 * the others distinct). A rotated plane (basis C [D, D], else NULL) stores x @ C.T, each value a sum over the dims
 * in order. A delta plane (K) stores each block's token 0 first, as itself, then every other token as its residual
 * from token 0's stored value (written now or earlier): `KVPlane.store`'s order and values. On `threads` OpenMP
 * threads, a (token, head) each task. */
static void store_plane(const float *x, int64_t ldx, const int64_t *slots, int64_t T, const q_plane *pl, int64_t bs,
                        int64_t hkv, int64_t d, int delta, const float *C, int threads) {
#pragma omp parallel num_threads(threads)
    for (int pass = 0; pass < 2; pass++) { /* a delta plane's tokens 0, then the rest; a plain one's all at once */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < T * hkv; task++) {
            const int64_t t = task / hkv, h = task % hkv, off = slots[t] % bs;
            if (slots[t] < 0 || (delta ? (off == 0) != (pass == 0) : pass == 1)) continue;
            const plane_at at = block_at(pl, slots[t] / bs, h);
            uint8_t *c = (uint8_t *)at.codes + off * pl->cs[2];
            uint16_t *sc = (uint16_t *)at.scales + off * pl->ss[2];
            const float *xt = x + t * ldx + h * d;
            float y[D_MAX];
            if (C) { /* y = x @ C.T */
                for (int64_t i = 0; i < d; i++) {
                    float sum = 0.0f;
                    for (int64_t j = 0; j < d; j++) sum += xt[j] * C[i * d + j];
                    y[i] = sum;
                }
                xt = y;
            }
            if (delta && off) {
                float first[D_MAX], r[D_MAX];
                token_values(pl, at, 0, d, first);
                for (int64_t i = 0; i < d; i++) r[i] = xt[i] - first[i];
                put(r, d, pl->kind, c, sc);
            } else {
                put(xt, d, pl->kind, c, sc);
            }
        }
    }
}

/* a step's new K and V rows, k and v [T, Hkv, D] (rows ldk and ldv apart), stored into the planes `P` at the flat
 * slots [T] (`store_plane`: K as a delta plane, V rotated by P's basis where it has one) */
void rad_store_planes(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots, int64_t T,
                      const rad_kv_planes *P, int64_t bs, int64_t hkv, int64_t d, int threads) {
    const q_plane kp = k_plane(P), vp = v_plane(P);
    store_plane(k, ldk, slots, T, &kp, bs, hkv, d, 1, NULL, threads);
    store_plane(v, ldv, slots, T, &vp, bs, hkv, d, 0, P->basis, threads);
}

/* rad_decode_attention's over quantized planes `P`: q and k [B, Hkv, D] (rows ldq and ldk apart, heads D apart)
 * rotated by row b's cos and sin (`rotate`), the rotated q into q_rot [B, Hq, D] and k into k_rot [B, Hkv, D];
 * where slots[b] >= 0 the rotated k and v (rows ldv apart) stored into that slot of the K and V planes
 * (`rad_store_planes`); then each sequence's attention over its context (`rad_decode_attention_planes`). The same
 * values, bytes and sums as kernels/cpu.py's op path over the planes (its `_rotate`, `PlanePair.store` and
 * `PlanePair.decode`). */
void rad_decode_attention_planes_rotary(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v,
                                        int64_t ldv, const float *cos, const float *sin, int64_t r,
                                        const int64_t *slots, float *q_rot, float *k_rot, const rad_kv_planes *P,
                                        const int64_t *block_ids, int64_t nb, const int64_t *lens, int64_t bs,
                                        int64_t B, int64_t hq, int64_t hkv, int64_t d, float scale, float *out,
                                        int threads) {
    const int64_t g = hq / hkv;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < B * hkv; task++) {
        const int64_t b = task / hkv, h = task % hkv;
        const float *cb = cos + b * r, *sb = sin + b * r;
        for (int64_t j = h * g; j < (h + 1) * g; j++)
            rotate(q + b * ldq + j * d, cb, sb, r, d, q_rot + (b * hq + j) * d);
        rotate(k + b * ldk + h * d, cb, sb, r, d, k_rot + (b * hkv + h) * d);
    }
    rad_store_planes(k_rot, hkv * d, v, ldv, slots, B, P, bs, hkv, d, threads);
    rad_decode_attention_planes(q_rot, P, block_ids, nb, lens, bs, B, hq, hkv, d, scale, out, threads);
}
