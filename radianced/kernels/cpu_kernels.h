/* The host backend's C library's functions that its other sources call (cpu_blocks.c's products, cpu_attention.c's
 * decode attention, over a plain cache or quantized planes: cpu_layer.c builds a layer of them): one declaration each,
 * which the defining source includes too, so a signature that drifts fails to compile. */
#ifndef RAD_CPU_KERNELS_H
#define RAD_CPU_KERNELS_H
#include <stdint.h>

void rad_blocks_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                       int64_t row_bytes, int fmt, float *y, int64_t ldy, int threads);
int rad_blocks_swiglu(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *wg, const uint8_t *wu,
                      int64_t N, int64_t row_bytes, int fmt, float *y, int64_t ldy, int threads);
void rad_decode_attention(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                          const float *cos, const float *sin, int64_t r, const int64_t *write_rows, float *q_rot,
                          float *kv, int64_t v_rows, const int64_t *block_rows, int64_t nb, const int64_t *lens,
                          int64_t bs, int64_t B, int64_t hq, int64_t hkv, int64_t d, float scale, float *out,
                          int threads);

/* a layer's quantized K and V planes (kernels/kv_quant.py `KVPlane`s, cpu_attention.py `PlanePair`): the codes of
 * (block id, token t, head h) at codes + (id / per_page) * cs[0] + (id % per_page) * cs[1] + t * cs[2] + h * cs[3]
 * (bytes), its fp16 scale (fp8) or (step, min) pairs (int6, int4) at scales + the same with ss (elements). K is a
 * delta plane, V a plain one, rotated (stored in the DCT basis C [D, D] at `basis`) where basis is not NULL.
 * kinds: 0 fp8, 1 int6, 2 int4 (cpu_attention.c's PLANE_*). */
typedef struct {
    uint8_t *k_codes;
    const int64_t *kcs;
    uint16_t *k_scales;
    const int64_t *kss;
    uint8_t *v_codes;
    const int64_t *vcs;
    uint16_t *v_scales;
    const int64_t *vss;
    int64_t per_page, k_kind, v_kind;
    const float *basis;
} rad_kv_planes;

void rad_decode_attention_planes_rotary(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v,
                                        int64_t ldv, const float *cos, const float *sin, int64_t r,
                                        const int64_t *slots, float *q_rot, float *k_rot, const rad_kv_planes *P,
                                        const int64_t *block_ids, int64_t nb, const int64_t *lens, int64_t bs,
                                        int64_t B, int64_t hq, int64_t hkv, int64_t d, float scale, float *out,
                                        int threads);
#endif
