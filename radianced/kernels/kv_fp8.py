"""The `fp8` KV format (kernels/kv_formats.py) inside the Triton kernels: the fused write's quantize
and the attention loop's reads (also fp8_v4's K plane, through kernels/kv_int.py).

`kv_quant.KVPlane` is the reference: `quantize_rows` gives its bytes bit for bit
(`fp8_scale` and `fp8_quantize`: the fp16 scale amax / 448, one fp16 step up where
it rounded below, x / scale rounded to E4M3), and `delta_rows` its K residual: a
block's offset-0 token is stored as itself, a later one as its residual from that
token's stored value (codes x scale: exact in fp32, so the compiler's choice to
fuse the product into the subtraction changes no bit). Every division is IEEE
(`div_rn`: Triton's `/` is the approximate `div.full.f32` on the GPU) and fp32 ->
E4M3 is round-to-nearest-even on both sides (`cvt.rn.satfinite` on the GPU, torch on
the host; nothing reaches 448's saturation, the scale sees to that).

Who computes a delta token's base without a race: the first token of the token's
block is either written in the same launch, then by the row `offset` rows before
it (a sequence's new tokens are consecutive rows with consecutive slots: the
engine's layout, model/batch.py), which the caller recomputes from its input, or
by an earlier launch, then read from the cache; decode has one new token per
sequence, so only the latter.

In the attention loop a key's logit is q . k_j = s_j (q . c_j) (+ the same of its
block's first token when j is not the first): one dot of q with the codes as they
are (E4M3 values are exact in fp16 and fp32: `kv_int.dot_operand`), the per-token scale on the logit
(`key_logits`), the first token's part taken from the same tile (a BLOCK_N tile
holds whole blocks). V's scale goes into P before P @ V (`scaled_values`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from radianced.kernels import kv_formats

FP8_MAX = tl.constexpr(kv_formats.FP8_MAX)  # a constexpr value: a plain or annotated global does not compile on the GPU


@triton.jit
def quantize_rows(x):
    """x fp32 [R, BLOCK_D] (zeros past the head dim) -> (E4M3 codes as uint8 [R, BLOCK_D], fp16
    scales [R]): `kv_quant.fp8_quantize`'s bits."""
    amax = tl.max(tl.abs(x), 1)
    scale = tl.math.div_rn(amax, FP8_MAX).to(tl.float16)
    up = (scale.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)  # nextafter(scale, inf): scale >= 0
    scale = tl.where(scale.to(tl.float32) * FP8_MAX < amax, up, scale)
    s = scale.to(tl.float32)
    y = tl.math.div_rn(x, tl.where(s > 0, s, 1.0)[:, None])
    y = tl.where(s[:, None] > 0, tl.clamp(y, -FP8_MAX, FP8_MAX), 0.0)
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), scale


@triton.jit
def dequantize_rows(codes, scale):
    """uint8 codes [R, BLOCK_D] and fp16 scales [R]: fp32 values (each exact)."""
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale.to(tl.float32)[:, None]


@triton.jit
def load_rows(codes_src, scale_src, row_ok, d, d_ok):
    """The stored fp32 values of rows at codes_src [R] (each row's first code) and scale_src [R]."""
    codes = tl.load(codes_src[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0)
    return dequantize_rows(codes, tl.load(scale_src, mask=row_ok, other=0.0))


@triton.jit
def store_rows(x, codes_dst, scale_dst, row_ok, d, d_ok):
    """Quantize x fp32 [R, BLOCK_D] and store its codes at codes_dst [R] and its scales at scale_dst [R]."""
    codes, scale = quantize_rows(x)
    tl.store(codes_dst[:, None] + d[None, :], codes, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(scale_dst, scale, mask=row_ok)


@triton.jit
def key_logits(q, codes, scales, offsets, DOT_PRECISION: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """q [M, BLOCK_D] against a tile of delta-K codes [N, BLOCK_D] (uint8) with fp16 scales [N] at block
    offsets [N]: fp32 q . k_j [M, N] (`add_block_first`)."""
    own = tl.dot(q, tl.trans(codes.to(tl.float8e4nv, bitcast=True).to(q.dtype)), input_precision=DOT_PRECISION)
    return add_block_first(own * scales.to(tl.float32)[None, :], offsets, BLOCK_SIZE)


@triton.jit
def add_block_first(own, offsets, BLOCK_SIZE: tl.constexpr):
    """Logits [M, N] of q against a delta-K tile's stored rows (each key's residual; a block's first key
    as itself) at block offsets [N]: q . k_j. The tile holds whole blocks (N a multiple of BLOCK_SIZE,
    starting on a block), so each block's first key is in it: its logit is added to each later key's
    of its block."""
    M: tl.constexpr = own.shape[0]
    N: tl.constexpr = own.shape[1]
    tl.static_assert(N % BLOCK_SIZE == 0)
    per_block = tl.reshape(own, [M, N // BLOCK_SIZE, BLOCK_SIZE])
    is_first = (tl.arange(0, BLOCK_SIZE) == 0)[None, None, :]
    first = tl.sum(tl.where(is_first, per_block, 0.0), 2)  # [M, N / S]: one term each, exact
    first = tl.reshape(tl.broadcast_to(first[:, :, None], [M, N // BLOCK_SIZE, BLOCK_SIZE]), [M, N])
    return own + tl.where((offsets > 0)[None, :], first, 0.0)


@triton.jit
def scaled_values(p, codes, scales, dtype: tl.constexpr):
    """P [M, N] fp32 and a V tile of codes [N, BLOCK_D] (uint8) with fp16 scales [N]: the operands of
    P @ V in `dtype` (P times each key's scale, then rounded as P alone is for an auto cache; the codes
    exact)."""
    p = p * scales.to(tl.float32)[None, :]
    return p.to(dtype), codes.to(tl.float8e4nv, bitcast=True).to(dtype)


__all__ = ["add_block_first", "dequantize_rows", "key_logits", "load_rows", "quantize_rows", "scaled_values",
           "store_rows"]
