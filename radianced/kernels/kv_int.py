"""The `fp8_v4` and `k6_v4` KV formats (kernels/kv_formats.py) inside the Triton kernels: the int6
and int4 planes' quantize on write and reads in the attention loop, and the plane helpers the
kernels call for every quantized K and V (fp8's from kernels/kv_fp8.py).

`kv_quant.KVPlane` is the reference. An int plane's bytes are `int_quantize`'s bit for
bit: per group of 32 dims min and (max - min) / top are rounded to fp16 (round to
nearest even, as torch does), each code is (x - min) / step (IEEE `div_rn`), clamped
to 0..top, then rounded half to even (adding and subtracting 1.5 * 2**23 in fp32:
exact for 0..2**22; the interpreter has no libdevice `rint`). Its stored value
q * step + min is exact in fp32 up to the one rounding of the sum (q has 6 bits, step
11), so the compiler's choice to fuse it into an FMA changes no bit: a delta K token's
residual from its block's first token matches the reference's as fp8's does.

The int4 V plane is rotated: each token-head is stored as v @ C.T (C the DCT-II basis,
`KVPlane.basis`), computed by `dct_rows` as a sum over the head's dims in order with
explicit FMAs, so the fused decode and the two launches write the same bits. Against
`KVPlane.store` (a torch matmul, its own summation order) a rotated value may differ in
its last bit, so a code may flip by one where the value sits on a rounding boundary
(and a group's fp16 min or step by one step of fp16); the tests count such flips. K
planes are bit-exact. Attention is linear in V, so the loop accumulates P @ Y in the
rotated basis and `store_unrotated` applies C once to each output row, 32 output dims
a dot: one [D, D] product a program instead of one a key tile. It loses nothing: in
the interpreter (D 128, 197 keys, fp32) the output is within 3.4e-7 (fp8_v4) and
4.2e-7 (k6_v4) of a float64 attention over the same bytes; the reference, which
rotates each token in fp32, is 5.1e-7 away (bf16: 3.8e-3 against fp8's 2.8e-3, the
int4 values' rounding to bf16). The product is an IEEE dot for an fp32 output and a
tf32 one otherwise: tf32 rounds o and C to 11 bits, an error of about 2**-11 of the
row's norm / sqrt(D) a dim, well inside a bf16 output's rounding, and ptxas (sm_90,
offline) shows why: a bf16 prefill at D 256 spills 35 KB with the IEEE (FMA) dot,
900 bytes with tf32 (fp8's kernel: 850).

In the loop an int6 K tile is dequantized to values (its residuals; the dot in q's
dtype, the block's first key's logit added as fp8 adds it: `kv_fp8.add_block_first`),
an int4 V tile to values in q's dtype beside P (bf16: rounded as an auto cache holds
V). Codes are read a byte once (int4: its two nibbles joined; int6: the three bytes of four dims as one
word, its four codes joined back in dim order); scales a group at a time.

`rotary_write_kv` here is `rope.rotary_write_kv` for these two formats (its kernel takes
fp8 and auto only): q, k and v in one launch, K as the residual from its block's first
token (recomputed from the input when this launch writes it, else read back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radianced.kernels import kv_fp8, pdl, rope
from radianced.kernels import kv_formats
from radianced.kernels.kv_formats import FP8_DELTA, INT4_ROTATED, INT6_DELTA
from radianced.kernels.kv_quant import KVPlane
from radianced.kernels.paged import CacheViews, cache_views, check_kv_write, slot_offset

GROUP = tl.constexpr(kv_formats.GROUP)  # a constexpr value: a plain or annotated global does not compile on the GPU
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + ROUND - ROUND rounds x (0 <= x < 2**22) half to even


# -- int rows -------------------------------------------------------------------------------------


@triton.jit
def _per_dim(s, BLOCK_D: tl.constexpr):
    """Per-group values s [R, groups] as [R, BLOCK_D] (each group's value on its dims)."""
    R: tl.constexpr = s.shape[0]
    NG: tl.constexpr = s.shape[1]
    return tl.reshape(tl.broadcast_to(s[:, :, None], [R, NG, BLOCK_D // NG]), [R, BLOCK_D])


@triton.jit
def _quantize_int(x, d_ok, BITS: tl.constexpr):
    """x fp32 [R, BLOCK_D] -> (codes int32 [R, BLOCK_D] (0 past the head dim), fp16 steps and mins
    [R, groups]): `kv_quant.int_quantize`'s."""
    R: tl.constexpr = x.shape[0]
    BLOCK_D: tl.constexpr = x.shape[1]
    GW: tl.constexpr = min(GROUP, BLOCK_D)
    TOP: tl.constexpr = (1 << BITS) - 1
    lo = tl.min(tl.reshape(tl.where(d_ok[None, :], x, float("inf")), [R, BLOCK_D // GW, GW]), 2).to(tl.float16)
    hi = tl.max(tl.reshape(tl.where(d_ok[None, :], x, float("-inf")), [R, BLOCK_D // GW, GW]), 2)
    step = tl.math.div_rn(hi - lo.to(tl.float32), TOP * 1.0).to(tl.float16)
    s = _per_dim(step.to(tl.float32), BLOCK_D)
    y = tl.math.div_rn(x - _per_dim(lo.to(tl.float32), BLOCK_D), tl.where(s > 0, s, 1.0))
    y = tl.where(s > 0, tl.clamp(y, 0.0, TOP * 1.0), 0.0)
    q = ((y + ROUND) - ROUND).to(tl.int32)
    return tl.where(d_ok[None, :], q, 0), step, lo


@triton.jit
def _dequantize_int(q, step, lo, d_ok):
    """Codes int32 [R, BLOCK_D] with fp16 steps and mins [R, groups]: fp32 values, 0 past the head dim."""
    BLOCK_D: tl.constexpr = q.shape[1]
    x = q.to(tl.float32) * _per_dim(step.to(tl.float32), BLOCK_D) + _per_dim(lo.to(tl.float32), BLOCK_D)
    return tl.where(d_ok[None, :], x, 0.0)


@triton.jit
def _groups(D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The group index [BLOCK_D // GW] of a row's scales and which of them exist."""
    GW: tl.constexpr = min(GROUP, BLOCK_D)
    g = tl.arange(0, BLOCK_D // GW)
    return g, g < (D + GROUP - 1) // GROUP


@triton.jit
def _store_int(x, codes_dst, scale_dst, row_ok, d_ok, D: tl.constexpr, BITS: tl.constexpr):
    """Quantize x fp32 [R, BLOCK_D] and store its packed codes at codes_dst [R] (each row's first byte)
    and its (step, min) pairs at scale_dst [R]."""
    R: tl.constexpr = x.shape[0]
    BLOCK_D: tl.constexpr = x.shape[1]
    q, step, lo = _quantize_int(x, d_ok, BITS)
    if BITS == 4:  # two a byte, the even dim low
        even, odd = tl.split(tl.reshape(q, [R, BLOCK_D // 2, 2]))
        j = tl.arange(0, BLOCK_D // 2)
        tl.store(codes_dst[:, None] + j[None, :], (even | (odd << 4)).to(tl.uint8),
                 mask=row_ok[:, None] & (j < (D + 1) // 2)[None, :])
    else:  # four to three bytes, 24 bits little-endian, dim 4i lowest
        a, b = tl.split(tl.reshape(q, [R, BLOCK_D // 4, 2, 2]))  # a: dims 4i, 4i + 2; b: 4i + 1, 4i + 3
        c0, c2 = tl.split(a)
        c1, c3 = tl.split(b)
        word = c0 | (c1 << 6) | (c2 << 12) | (c3 << 18)
        j = tl.arange(0, BLOCK_D // 4)
        ok = row_ok[:, None] & (j < (D + 3) // 4)[None, :]
        for i in tl.static_range(3):
            tl.store(codes_dst[:, None] + 3 * j[None, :] + i, ((word >> (8 * i)) & 255).to(tl.uint8), mask=ok)
    g, g_ok = _groups(D, BLOCK_D)
    at = scale_dst[:, None] + 2 * g[None, :]
    tl.store(at, step, mask=row_ok[:, None] & g_ok[None, :])
    tl.store(at + 1, lo, mask=row_ok[:, None] & g_ok[None, :])


@triton.jit
def _load_int(codes_src, scale_src, row_ok, d, d_ok, D: tl.constexpr, BITS: tl.constexpr):
    """The stored fp32 values [R, BLOCK_D] of rows at codes_src [R] and scale_src [R]; 0 on rows not
    row_ok and past the head dim."""
    BLOCK_D: tl.constexpr = d.shape[0]
    R: tl.constexpr = codes_src.shape[0]
    if BITS == 4:  # each byte read once: its low nibble the even dim, its high the odd (`_store_int`'s split undone)
        j = tl.arange(0, BLOCK_D // 2)
        byte = tl.load(codes_src[:, None] + j[None, :], mask=row_ok[:, None] & (j < (D + 1) // 2)[None, :],
                       other=0).to(tl.int32)
        q = tl.reshape(tl.join(byte & 15, byte >> 4), [R, BLOCK_D])
    else:  # each 3-byte word of four dims read once, its codes joined back in dim order
        j = tl.arange(0, BLOCK_D // 4)
        at = codes_src[:, None] + 3 * j[None, :]
        ok = row_ok[:, None] & (j < (D + 3) // 4)[None, :]
        word = tl.load(at, mask=ok, other=0).to(tl.int32) | (tl.load(at + 1, mask=ok, other=0).to(tl.int32) << 8) \
            | (tl.load(at + 2, mask=ok, other=0).to(tl.int32) << 16)
        a = tl.join(word & 63, (word >> 12) & 63)  # dims 4i, 4i + 2
        b = tl.join((word >> 6) & 63, (word >> 18) & 63)  # 4i + 1, 4i + 3
        q = tl.reshape(tl.join(a, b), [R, BLOCK_D])
    g, g_ok = _groups(D, BLOCK_D)
    at = scale_src[:, None] + 2 * g[None, :]
    step = tl.load(at, mask=row_ok[:, None] & g_ok[None, :], other=0.0)
    lo = tl.load(at + 1, mask=row_ok[:, None] & g_ok[None, :], other=0.0)
    return _dequantize_int(q, step, lo, d_ok)


# -- any quantized plane (BITS: 8 fp8, 6 int6, 4 int4) --------------------------------------------


@triton.jit
def store_rows(x, codes_dst, scale_dst, row_ok, d, d_ok, D: tl.constexpr, BITS: tl.constexpr):
    """Quantize x fp32 [R, BLOCK_D] into rows at codes_dst [R] and scale_dst [R]."""
    if BITS == 8:
        kv_fp8.store_rows(x, codes_dst, scale_dst, row_ok, d, d_ok)
    else:
        _store_int(x, codes_dst, scale_dst, row_ok, d_ok, D, BITS)


@triton.jit
def load_rows(codes_src, scale_src, row_ok, d, d_ok, D: tl.constexpr, BITS: tl.constexpr):
    """The stored fp32 values [R, BLOCK_D] of rows at codes_src [R] and scale_src [R]."""
    if BITS == 8:
        return kv_fp8.load_rows(codes_src, scale_src, row_ok, d, d_ok)
    else:
        return _load_int(codes_src, scale_src, row_ok, d, d_ok, D, BITS)


@triton.jit
def stored_rows(x, d_ok, BITS: tl.constexpr):
    """What x fp32 [R, BLOCK_D] reads back as once stored (quantized and dequantized in registers)."""
    if BITS == 8:
        codes, scale = kv_fp8.quantize_rows(x)
        return kv_fp8.dequantize_rows(codes, scale)
    else:
        q, step, lo = _quantize_int(x, d_ok, BITS)
        return _dequantize_int(q, step, lo, d_ok)


@triton.jit
def dct_rows(src, row_ok, basis_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows at src [R] (each row's first value, any float dtype) in the DCT basis: fp32 [R, BLOCK_D]
    x @ C.T (basis_ptr: C [D, D] fp32), summed over the dims in order with explicit FMAs (the same bits
    for any R, on any kernel)."""
    R: tl.constexpr = src.shape[0]
    k = tl.arange(0, BLOCK_D)
    acc = tl.zeros([R, BLOCK_D], tl.float32)
    for i in range(D):
        x = tl.load(src + i, mask=row_ok, other=0.0).to(tl.float32)
        c = tl.load(basis_ptr + k * D + i, mask=k < D, other=0.0)  # C[k, i]
        acc = tl.fma(x[:, None], c[None, :], acc)
    return acc


@triton.jit
def dot_operand(q):
    """q's operand for the dots over a quantized cache: fp16 where q is bf16, else q. The codes go to
    the dot's dtype in the loop, every tile: E4M3 to fp16 is one instruction a pair on sm_89 and later
    (exact), to bf16 it goes through fp32; bf16's 8 bits are exact in fp16 in its normal range (2^-14
    to 65,504: a query or key beyond it would not be a transformer's), and P and the dequantized int
    rows are rounded to 11 bits, not 8. Products accumulate in fp32 either way."""
    return q.to(tl.float16) if q.dtype == tl.bfloat16 else q


@triton.jit
def key_logits(q, codes_src, scale_src, k_ok, offsets, d, d_ok, D: tl.constexpr, BITS: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """q [M, BLOCK_D] against a tile of delta-K rows at codes_src [N] and scale_src [N] (whole blocks,
    block offsets [N]): fp32 q . k_j [M, N], keys not k_ok 0."""
    if BITS == 8:
        codes = tl.load(codes_src[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0)
        return kv_fp8.key_logits(q, codes, tl.load(scale_src, mask=k_ok, other=0.0), offsets, DOT_PRECISION,
                                 BLOCK_SIZE)
    else:
        k = _load_int(codes_src, scale_src, k_ok, d, d_ok, D, BITS)  # residuals; first keys as themselves
        own = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        return kv_fp8.add_block_first(own, offsets, BLOCK_SIZE)


@triton.jit
def value_operands(p, codes_src, scale_src, k_ok, d, d_ok, D: tl.constexpr, BITS: tl.constexpr,
                   dtype: tl.constexpr):
    """P [M, N] fp32 and a V tile at codes_src [N] and scale_src [N]: the operands of P @ V in `dtype`
    (int4: values in the rotated basis)."""
    if BITS == 8:
        codes = tl.load(codes_src[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0)
        return kv_fp8.scaled_values(p, codes, tl.load(scale_src, mask=k_ok, other=0.0), dtype)
    else:
        return p.to(dtype), _load_int(codes_src, scale_src, k_ok, d, d_ok, D, BITS).to(dtype)


@triton.jit
def store_unrotated(o, basis_ptr, dst, row_ok, D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Store o @ C (o fp32 [M, BLOCK_D], attention's output over a rotated V; C [D, D] at basis_ptr) at
    dst [M] (each row's first element), in the destination's dtype, 32 output dims a dot (in the
    attention's dot precision: IEEE for fp32, tf32 otherwise)."""
    BLOCK_D: tl.constexpr = o.shape[1]
    CW: tl.constexpr = min(32, BLOCK_D)
    i = tl.arange(0, BLOCK_D)
    for c in tl.static_range(BLOCK_D // CW):
        k = c * CW + tl.arange(0, CW)
        basis = tl.load(basis_ptr + i[:, None] * D + k[None, :], mask=(i < D)[:, None] & (k < D)[None, :], other=0.0)
        part = tl.dot(o, basis, input_precision=DOT_PRECISION)
        tl.store(dst[:, None] + k[None, :], part.to(dst.dtype.element_ty), mask=row_ok[:, None] & (k < D)[None, :])


# -- the write launch of fp8_v4 and k6_v4 ------------------------------------------------------------


@triton.jit
def _rotary_write_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, slot_ptr, basis_ptr,
                         q_heads, k_heads, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         kc_ptr, vc_ptr, ks_ptr, vs_ptr, blocks_per_page,
                         stride_kcp, stride_kcn, stride_kcs, stride_kch, stride_vcp, stride_vcn, stride_vcs, stride_vch,
                         stride_ksp, stride_ksn, stride_kss, stride_ksh, stride_vsp, stride_vsn, stride_vss, stride_vsh,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         ROT: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr, LIBDEVICE: tl.constexpr,
                         K_BITS: tl.constexpr, PDL: tl.constexpr):
    """Program (t, 0) rotates q's token t as rope's kernel does; (t, 1) stores its rotated k (rounded to
    q_out's dtype) as its residual from its block's first token, which is row t - offset of this launch
    when that row's slot is the block's first (recomputed from its input), else read from the cache;
    (t, 2) stores its v in the DCT basis as int4. A slot < 0 writes nothing."""
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    pos = tl.load(pos_ptr + t)
    if which == 0:
        x = rope.rotate_rows(q_ptr + t * stride_qt + h * stride_qh, h < q_heads, pos, inv_freq_ptr, qw_ptr, eps,
                             D, ROT, BLOCK_D, NORM, ZERO_CENTRED, LIBDEVICE)
        tl.store(q_out_ptr + t * q_heads * D + h[:, None] * D + d[None, :], x.to(q_out_ptr.dtype.element_ty),
                 mask=(h < q_heads)[:, None] & d_ok[None, :])
        return
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    if which == 2:
        y = dct_rows(v_ptr + t * stride_vt + h * stride_vh, h < k_heads, basis_ptr, D, BLOCK_D)
        v_dst = vc_ptr + slot_offset(slot, blocks_per_page, stride_vcp, stride_vcn, stride_vcs, BLOCK_SIZE)
        vs_dst = vs_ptr + slot_offset(slot, blocks_per_page, stride_vsp, stride_vsn, stride_vss, BLOCK_SIZE)
        _store_int(y, v_dst + h * stride_vch, vs_dst + h * stride_vsh, h < k_heads, d_ok, D, 4)
        return
    x = rope.rotate_rows(k_ptr + t * stride_kt + h * stride_kh, h < k_heads, pos, inv_freq_ptr, kw_ptr, eps,
                         D, ROT, BLOCK_D, NORM, ZERO_CENTRED, LIBDEVICE).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    k_dst = kc_ptr + slot_offset(slot, blocks_per_page, stride_kcp, stride_kcn, stride_kcs, BLOCK_SIZE)
    ks_dst = ks_ptr + slot_offset(slot, blocks_per_page, stride_ksp, stride_ksn, stride_kss, BLOCK_SIZE)
    off = slot % BLOCK_SIZE
    if off > 0:  # the residual from the block's first token
        row = tl.maximum(t - off, 0)
        if (t >= off) & (tl.load(slot_ptr + row) == slot - off):  # written by this launch: row t - off
            first = rope.rotate_rows(k_ptr + row * stride_kt + h * stride_kh, h < k_heads, tl.load(pos_ptr + row),
                                     inv_freq_ptr, kw_ptr, eps, D, ROT, BLOCK_D, NORM, ZERO_CENTRED, LIBDEVICE)
            x = x - stored_rows(first.to(q_out_ptr.dtype.element_ty).to(tl.float32), d_ok, K_BITS)
        else:  # by an earlier launch
            x = x - load_rows(k_dst - off * stride_kcs + h * stride_kch, ks_dst - off * stride_kss + h * stride_ksh,
                              h < k_heads, d, d_ok, D, K_BITS)
    store_rows(x, k_dst + h * stride_kch, ks_dst + h * stride_ksh, h < k_heads, d, d_ok, D, K_BITS)


# -- host -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelCache:
    """A layer's K and V as the Triton kernels take them: `views` (paged.CacheViews: values, or codes
    and scales) and what those do not say.

    shape: [P, N, S, Hkv, D], the plain cache view's (a packed plane's codes have fewer bytes than D).
    k_bits, v_bits: 0 (auto), 8 (fp8), 6 (int6 K), 4 (int4 V, rotated).
    basis: the DCT basis C [D, D] fp32 of a rotated V; None otherwise.
    """

    views: CacheViews
    shape: tuple[int, int, int, int, int]
    k_bits: int = 0
    v_bits: int = 0
    basis: torch.Tensor | None = None

    @property
    def rotated(self) -> bool:
        return self.basis is not None

    def check_write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """`paged.check_kv_write` of k, v and slot_mapping against these caches (an int plane's codes
        against the cache's [P, N, S, Hkv, D], not their own widths)."""
        check_kv_write(self.views.k, self.views.v, k, v, slot_mapping, self.shape if self.rotated else None)


_INT_PAIRS = {(FP8_DELTA, INT4_ROTATED): (8, 4), (INT6_DELTA, INT4_ROTATED): (6, 4)}


def kernel_cache(k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane) -> KernelCache:
    """A layer's caches for the kernels: auto and fp8 through `paged.cache_views` (which refuses any other
    pair of planes), fp8_v4 and k6_v4 here."""
    pair = (getattr(k_cache, "fmt", None), getattr(v_cache, "fmt", None))
    if pair in _INT_PAIRS:
        k_bits, v_bits = _INT_PAIRS[pair]
        views = CacheViews(k_cache.codes, v_cache.codes, k_cache.scales, v_cache.scales)
        return KernelCache(views, k_cache.shape, k_bits, v_bits, v_cache.basis)
    views = cache_views(k_cache, v_cache)
    return KernelCache(views, tuple(views.k.shape), 8 if views.fp8 else 0, 8 if views.fp8 else 0)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, k_cache: KVPlane, v_cache: KVPlane, slot_mapping: torch.Tensor,
                    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                    zero_centred: bool = False) -> torch.Tensor:
    """`rope.rotary_write_kv` (the same contract) into an fp8_v4 or k6_v4 cache, one launch; returns q.
    The cache holds the bytes `KVPlane.store` writes for k as `rope.rotary_qk` returns it and for v
    (up to the rotation's last bit: see the module docstring). A sequence's new rows must be
    consecutive with consecutive slots, as for fp8."""
    weights = rope.norm_weights("rotary_write_kv", q_weight, k_weight)
    cache = kernel_cache(k_cache, v_cache)
    if not cache.rotated:
        raise ValueError("kv_int.rotary_write_kv writes fp8_v4 and k6_v4 caches; rope.rotary_write_kv the others")
    cache.check_write(k, v, slot_mapping)
    q, k, out_dtype = rope.check_rotary(q, k, positions, inv_freq, weights, zero_centred)
    v = v if v.stride(2) == 1 else v.contiguous()
    q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    t, hq, d = q.shape
    if t == 0:
        return q_out
    qw, kw = weights if weights is not None else (inv_freq, inv_freq)  # unused without NORM
    views = cache.views
    block_h = triton.next_power_of_2(max(hq, k.shape[1]))
    block_d = triton.next_power_of_2(d)
    _rotary_write_kernel[(t, 3)](
        q, k, v, q_out, qw.contiguous(), kw.contiguous(), positions.contiguous(), inv_freq.contiguous(),
        slot_mapping, cache.basis, hq, k.shape[1], eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), views.k, views.v, views.k_scales, views.v_scales, views.k.shape[1],
        *views.k.stride()[:4], *views.v.stride()[:4], *views.k_scales.stride()[:4], *views.v_scales.stride()[:4],
        D=d, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_SIZE=views.k.shape[2],
        **rope.rotary_constexprs(inv_freq, weights, zero_centred), K_BITS=cache.k_bits,
        num_warps=4 if block_h * block_d <= 2048 else 8, **pdl.launch(q.device, 3 * t))
    return q_out


__all__ = ["KernelCache", "dct_rows", "dot_operand", "kernel_cache", "key_logits", "load_rows",
           "rotary_write_kv", "store_rows", "store_unrotated", "stored_rows", "value_operands"]
