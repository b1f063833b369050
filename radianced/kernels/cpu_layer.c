/* One dense decoder layer of a decode step on the host backend in one call (kernels/cpu_layer.py says why and
 * what it measured): Llama's pre-norm attention and SiLU MLP, each added to the residual, made of the library's
 * own products in the order the model makes them (model/llama.py, model/layers.py):
 *
 *   h = RMSNorm(x); [q | k | v] = h @ Wqkv.T; rad_decode_attention (RoPE, the new K/V rows written, each
 *   sequence's attention over its context in place; over quantized planes rad_decode_attention_planes_rotary: the
 *   same with the new rows quantized and the context read as codes); y = x + att @ Wo.T; h = RMSNorm(y);
 *   g = silu(h @ Wg.T) * (h @ Wu.T) (rad_blocks_swiglu, or two products and cpu_exp.h's silu where AMX takes
 *   the format: the op path's silu there is torch's, within 2 units of fp32 rounding);
 *   y = y + g @ Wd.T.
 *
 * Every product is the one the op-by-op path runs (the same calls); the residual adds round once as
 * `residual + out` does. RMSNorm here: x * r * w with r = 1 / sqrt(sum(x^2) / D + eps), each step rounded once
 * as the reference (kernels/reference.py) rounds it, sum(x^2) in 8 lane sums added in lane order (the
 * reference's products summed in another order: r within a few units of fp32 rounding of its r). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_exp.h"     /* rad_silu_mul: the MLP's where the SwiGLU is not fused */
#include "cpu_kernels.h" /* the products and the attention */

/* a layer's weights and shape (cpu_layer.py `_Layer`, fixed while the model lives) */
typedef struct {
    const float *in_norm, *post_norm;
    const uint8_t *wqkv, *wo, *wg, *wu, *wd;
    int64_t qkv_bytes, o_bytes, gu_bytes, d_bytes; /* each matrix's row bytes */
    int64_t qkv_fmt, o_fmt, gu_fmt, d_fmt;
    int64_t hidden, inter, hq, hkv, d;
    float eps, scale;
} rad_dense_layer;

/* a decode step's: where the context lies and where the new tokens go, in the cache's own addressing (a plain
 * cache's rows: cpu_attention.Context's block_rows and write_rows; quantized planes: the flat block ids and the slots,
 * cpu_attention.PlaneReads' and PlaneSlots'), -1 for no write; the rotation; scratch for T rows */
typedef struct {
    const int64_t *block_rows, *lens, *write_rows;
    int64_t nb, bs, r;
    const float *cos, *sin;
    float *h, *qkv, *att, *q_rot, *g, *u, *t, *k_rot; /* [T, hidden], [T, qkv], [T, hq d] x 2, [T, inter] x 2,
                                                        [T, hidden], [T, hkv d] */
} rad_decode_step;

static float sum_squares(const float *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    for (int l = 0; l < 8; l++) s += lane[l];
#endif
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static void rms_norm(const float *x, int64_t T, int64_t n, const float *w, float eps, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        float *yt = y + t * n;
        const float r = 1.0f / sqrtf(sum_squares(xt, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) yt[i] = xt[i] * r * w[i];
    }
}

/* y = x + a, T x n values */
static void add(const float *x, const float *a, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) y[i] = x[i] + a[i];
}

/* [q | k | v] of x [T, hidden] into S->qkv: the input norm and the product */
static void layer_in(const rad_dense_layer *L, const rad_decode_step *S, const float *x, int64_t T, int threads) {
    const int64_t n = L->hidden, nqkv = (L->hq + 2 * L->hkv) * L->d;
    rms_norm(x, T, n, L->in_norm, L->eps, S->h);
    rad_blocks_matmul(S->h, T, n, n, L->wqkv, nqkv, L->qkv_bytes, (int)L->qkv_fmt, S->qkv, nqkv, threads);
}

/* y = the layer's rest after the attention (S->att): the output product and its residual add, the MLP and its */
static void layer_out(const rad_dense_layer *L, const rad_decode_step *S, const float *x, float *y, int64_t T,
                      int threads) {
    const int64_t n = L->hidden, qd = L->hq * L->d;
    rad_blocks_matmul(S->att, T, qd, qd, L->wo, n, L->o_bytes, (int)L->o_fmt, S->t, n, threads);
    add(x, S->t, y, T * n);
    rms_norm(y, T, n, L->post_norm, L->eps, S->h);
    const int fmt = (int)L->gu_fmt;
    if (rad_blocks_swiglu(S->h, T, n, n, L->wg, L->wu, L->inter, L->gu_bytes, fmt, S->g, L->inter, threads)) {
        rad_blocks_matmul(S->h, T, n, n, L->wg, L->inter, L->gu_bytes, fmt, S->g, L->inter, threads);
        rad_blocks_matmul(S->h, T, n, n, L->wu, L->inter, L->gu_bytes, fmt, S->u, L->inter, threads);
        rad_silu_mul(S->g, S->u, S->g, T * L->inter);
    }
    rad_blocks_matmul(S->g, T, L->inter, L->inter, L->wd, n, L->d_bytes, (int)L->d_fmt, S->t, n, threads);
    add(y, S->t, y, T * n);
}

/* y [T, hidden] = the layer of x [T, hidden] (y may be x); kv: the layer's cache pair's rows (K from row 0, V v_rows
 * further) */
void rad_dense_layer_decode(const rad_dense_layer *L, const rad_decode_step *S, float *kv, int64_t v_rows,
                            const float *x, float *y, int64_t T, int threads) {
    const int64_t qd = L->hq * L->d, nqkv = qd + 2 * L->hkv * L->d;
    layer_in(L, S, x, T, threads);
    rad_decode_attention(S->qkv, nqkv, S->qkv + qd, nqkv, S->qkv + qd + L->hkv * L->d, nqkv, S->cos, S->sin, S->r,
                         S->write_rows, S->q_rot, kv, v_rows, S->block_rows, S->nb, S->lens, S->bs, T, L->hq,
                         L->hkv, L->d, L->scale, S->att, threads);
    layer_out(L, S, x, y, T, threads);
}

/* the same over a layer's quantized planes `P` (S's block_rows the flat block ids, its write_rows the slots) */
void rad_dense_layer_decode_planes(const rad_dense_layer *L, const rad_decode_step *S, const rad_kv_planes *P,
                                   const float *x, float *y, int64_t T, int threads) {
    const int64_t qd = L->hq * L->d, nqkv = qd + 2 * L->hkv * L->d;
    layer_in(L, S, x, T, threads);
    rad_decode_attention_planes_rotary(S->qkv, nqkv, S->qkv + qd, nqkv, S->qkv + qd + L->hkv * L->d, nqkv, S->cos,
                                       S->sin, S->r, S->write_rows, S->q_rot, S->k_rot, P, S->block_rows, S->nb,
                                       S->lens, S->bs, T, L->hq, L->hkv, L->d, L->scale, S->att, threads);
    layer_out(L, S, x, y, T, threads);
}
