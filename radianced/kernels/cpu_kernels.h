/* The host backend's C library's functions that its other sources call (cpu_blocks.c's products, cpu_attention.c's
 * decode attention: cpu_layer.c builds a layer of them): one declaration each, which the defining source includes
 * too, so a signature that drifts fails to compile. */
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
#endif
