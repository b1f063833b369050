"""Rotary position embedding on CUDA (rotate-half, full or partial), optionally fused with the qk-norm.

One kernel, grid (T, tensors): a program takes one token of q (or of k) with all
its heads, [heads, D] at once, and

- takes its angles from its position: position * inv_freq[i] in fp32, then
  cos and sin (libdevice's, as torch's fp32 cos and sin on CUDA), so a step
  needs no cos/sin tables (torch made them in eight launches);
- optionally RMS-normalizes each head (Qwen3's per-head q/k norm; plain or
  zero-centred);
- rotates the first R = 2 * len(inv_freq) dims by rotate-half: (x1, x2) ->
  (x1 c - x2 s, x2 c + x1 s), each dim beside its partner (read a second time,
  R/2 dims away); dims R .. D-1 pass through (partial rotary).

All of it runs in fp32 and is rounded once, at the store: closer to the fp32
truth than the reference's bf16 chain (which rounds after the norm, the weight,
cos/sin and each product), by design. `rotate_rows` is that math for any rows of
heads of one token; the decode attention kernel (kernels/attention.py,
`rotary_paged_attention`) runs it in its own launch, on its q tile and on the new
token's k. Every rounding in it is fixed by the code, not by the compiler: the
sum of squares is added in a set order (`_sum_sq`, not tl.sum's tree, which
follows the tile's layout) and the rotation's products are explicit FMAs, so
both kernels give every head the same bits.

`rotary_qk` does q and k in one launch instead of the reference's two norms and
two rotations; `apply_rotary` is the same kernel on one tensor; `rotary_write_kv`
also stores the rotated k and the v beside it at their KV slots (a third
program per token copies v), instead of a separate scatter launch. Heads may be
strided views of a projection (only the last dim must be contiguous); outputs
are new contiguous tensors. No host sync (graph-capturable).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from radianced.kernels import kv_fp8, pdl
from radianced.kernels.kv_quant import KVPlane
from radianced.kernels.paged import CacheViews, cache_views, check_kv_write, slot_offset

# -- kernel ----------------------------------------------------------------------------------------


@triton.jit
def _sum_sq(x):
    """Each row's sum of squares of x [R, N] (N a power of two, at least 2), as [R, 1], in an order
    the code fixes: neighbours as fma(x0, x0, x1 * x1), then neighbouring sums pairwise. (tl.sum's
    tree follows the compiler's layout of x, and the compiler may fuse a square into either add
    of a pair.) So every kernel and tile shape gets the same bits."""
    even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    x = tl.fma(even, even, odd * odd)
    for _ in tl.static_range(16):  # up to N = 2 ** 17
        if x.shape[1] > 1:
            a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
            x = a + b
    return x


@triton.jit
def _normed(x, w_ptr, cols, ok, sum_sq, eps, D: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """x [R, n] times rsqrt(mean square + eps) and the weight at `cols` [n], fp32."""
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
    if ZERO_CENTRED:
        w = 1.0 + w
    return x * tl.rsqrt(sum_sq / D + eps) * w


@triton.jit
def rotate_rows(src, row_ok, pos, inv_freq_ptr, w_ptr, eps, D: tl.constexpr, ROT: tl.constexpr,
                BLOCK_D: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Heads of one token at integer position `pos`, RMS-normalized (NORM: weight at w_ptr) and
    rotated: fp32 [R, BLOCK_D] for src [R] (each head's first element; rows read where row_ok,
    zeros elsewhere and past D), for the caller to round once. The decode attention kernel
    (kernels/attention.py) runs it on its q tile and on the new token's k.

    Rotate-half over dims [0, ROT): dim i < ROT/2 becomes x_i c_i - x_{i+ROT/2} s_i and dim
    ROT/2 + i becomes x_{ROT/2+i} c_i + x_i s_i (c_i, s_i: cos, sin of pos * inv_freq[i]);
    dims ROT .. D-1 pass through."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, BLOCK_D)
    first = d < HALF  # x1's dims; x2's are [HALF, ROT)
    second = (d >= HALF) & (d < ROT)
    rows = src[:, None]
    ok = row_ok[:, None]
    x = tl.load(rows + d[None, :], mask=ok & (d < D)[None, :], other=0.0).to(tl.float32)
    # each rotated dim's partner in rotate-half: x2's dim for one of x1, x1's for one of x2
    other = tl.where(first[None, :], tl.load(rows + (d + HALF)[None, :], mask=ok & first[None, :], other=0.0),
                     tl.load(rows + (d - HALF)[None, :], mask=ok & second[None, :], other=0.0)).to(tl.float32)
    if NORM:
        sum_sq = _sum_sq(x)
        x = _normed(x, w_ptr, d, d < D, sum_sq, eps, D, ZERO_CENTRED)
        other = _normed(other, w_ptr, tl.where(first, d + HALF, d - HALF), first | second, sum_sq, eps, D,
                        ZERO_CENTRED)
    freqs = pos.to(tl.float32) * tl.load(inv_freq_ptr + tl.where(first, d, d - HALF), mask=first | second, other=0.0)
    if LIBDEVICE:  # torch's fp32 cos and sin on CUDA
        c = libdevice.cos(freqs)[None, :]
        s = libdevice.sin(freqs)[None, :]
    else:  # Triton's interpreter (numpy's); tl.cos on CUDA may be the approximate cos.approx.f32
        c = tl.cos(freqs)[None, :]
        s = tl.sin(freqs)[None, :]
    # explicit FMAs: the rounding is the code's, not the compiler's choice of products to fuse
    return tl.where(first[None, :], tl.fma(x, c, -(other * s)), tl.where(second[None, :], tl.fma(x, c, other * s), x))


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, q_heads, k_heads, eps,
                   stride_qt, stride_qh, stride_kt, stride_kh,
                   v_ptr, v_cache_ptr, slot_ptr, blocks_per_page, stride_vt, stride_vh,
                   stride_kp, stride_kn, stride_ks, stride_kch, stride_vp, stride_vn, stride_vs, stride_vch,
                   ks_ptr, vs_ptr, stride_ksp, stride_ksn, stride_kss, stride_ksh,
                   stride_vsp, stride_vsn, stride_vss, stride_vsh,
                   D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_KV: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                   LIBDEVICE: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr):
    """Program (t, 0) rotates q's token t, (t, 1) k's; WRITE_KV: k goes to its KV slot (k_out_ptr is
    the K cache), and program (t, 2) copies v to its slot; a slot < 0 writes nothing. KV_FP8: the
    caches hold E4M3 codes and ks_ptr, vs_ptr their fp16 scales (kernels/kv_fp8.py); k is rounded
    to q_out's dtype (as `rotary_qk` returns it), then quantized as the residual from its block's
    first token, which is row t - offset of this launch when that row's slot is the block's first
    (recomputed here from its input: no race with its own program), else read from the cache."""
    pdl.wait(PDL)
    t = tl.program_id(0)
    which = tl.program_id(1)
    t64 = t.to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = (d < D)[None, :]
    k_dst = k_out_ptr + t64 * k_heads * D
    stride_kd = D
    if WRITE_KV:
        slot = tl.load(slot_ptr + t64).to(tl.int64)
        if (which > 0) & (slot < 0):
            return
        if which == 2:
            mask = (h < k_heads)[:, None] & d_ok
            v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
            v_dst = v_cache_ptr + slot_offset(slot, blocks_per_page, stride_vp, stride_vn, stride_vs, BLOCK_SIZE)
            if KV_FP8:
                vs_dst = vs_ptr + slot_offset(slot, blocks_per_page, stride_vsp, stride_vsn, stride_vss, BLOCK_SIZE)
                kv_fp8.store_rows(v.to(tl.float32), v_dst + h * stride_vch, vs_dst + h * stride_vsh, h < k_heads, d,
                                  d < D)
            else:
                tl.store(v_dst + h[:, None] * stride_vch + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)
            return
        k_dst = k_out_ptr + slot_offset(slot, blocks_per_page, stride_kp, stride_kn, stride_ks, BLOCK_SIZE)
        stride_kd = stride_kch
    pos = tl.load(pos_ptr + t64)
    if which == 0:
        x = rotate_rows(q_ptr + t64 * stride_qt + h * stride_qh, h < q_heads, pos, inv_freq_ptr, qw_ptr, eps,
                        D, ROT, BLOCK_D, NORM, ZERO_CENTRED, LIBDEVICE)
        tl.store(q_out_ptr + t64 * q_heads * D + h[:, None] * D + d[None, :], x.to(q_out_ptr.dtype.element_ty),
                 mask=(h < q_heads)[:, None] & d_ok)
    else:
        x = rotate_rows(k_ptr + t64 * stride_kt + h * stride_kh, h < k_heads, pos, inv_freq_ptr, kw_ptr, eps,
                        D, ROT, BLOCK_D, NORM, ZERO_CENTRED, LIBDEVICE)
        if KV_FP8:
            x = x.to(q_out_ptr.dtype.element_ty).to(tl.float32)
            ks_dst = ks_ptr + slot_offset(slot, blocks_per_page, stride_ksp, stride_ksn, stride_kss, BLOCK_SIZE)
            off = slot % BLOCK_SIZE
            if off > 0:  # the residual from the block's first token
                row = tl.maximum(t64 - off, 0)
                if (t64 >= off) & (tl.load(slot_ptr + row) == slot - off):  # written by this launch: row t - off
                    first = rotate_rows(k_ptr + row * stride_kt + h * stride_kh, h < k_heads, tl.load(pos_ptr + row),
                                        inv_freq_ptr, kw_ptr, eps, D, ROT, BLOCK_D, NORM, ZERO_CENTRED, LIBDEVICE)
                    codes, scale = kv_fp8.quantize_rows(first.to(q_out_ptr.dtype.element_ty).to(tl.float32))
                    x = x - kv_fp8.dequantize_rows(codes, scale)
                else:  # by an earlier launch
                    x = x - kv_fp8.load_rows(k_dst - off * stride_ks + h * stride_kd, ks_dst - off * stride_kss
                                             + h * stride_ksh, h < k_heads, d, d < D)
            kv_fp8.store_rows(x, k_dst + h * stride_kd, ks_dst + h * stride_ksh, h < k_heads, d, d < D)
        else:
            tl.store(k_dst + h[:, None] * stride_kd + d[None, :], x.to(k_out_ptr.dtype.element_ty),
                     mask=(h < k_heads)[:, None] & d_ok)


# -- launcher --------------------------------------------------------------------------------------


def _check_heads(name: str, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, H, D], got shape {tuple(x.shape)}")
    if x.shape[0] != positions.shape[0]:
        raise ValueError(f"{name} has {x.shape[0]} tokens, positions has {positions.shape[0]}")
    if x.device != positions.device:
        raise ValueError(f"{name} is on {x.device}, positions on {positions.device}")
    return x if x.stride(2) == 1 else x.contiguous()


def norm_weights(op: str, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q_weight, k_weight), or None without a qk-norm; ValueError naming `op` if only one is given."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError(f"{op} needs both q_weight and k_weight, or neither")
    return None if q_weight is None else (q_weight, k_weight)


def check_rotary(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor,
                 weights: tuple[torch.Tensor, torch.Tensor] | None,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Raise ValueError unless q: [T, Hq, D] and k: [T, Hk, D] (None: q alone), positions [T],
    inv_freq [R / 2] and the norm weights ([D] each) fit. Returns q and k with a contiguous last
    dim (k is q without k) and the dtype of the rotated heads (`rotary_qk`'s)."""
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [T] int32 or int64, got shape {tuple(positions.shape)} {positions.dtype}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.device != positions.device:
        raise ValueError(f"inv_freq must be [R / 2] float32 on {positions.device}, got shape "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype} on {inv_freq.device}")
    rot = 2 * inv_freq.shape[0]
    q = _check_heads("q", q, positions)
    k = q if k is None else _check_heads("k", k, positions)
    d = q.shape[2]
    if k.shape[2] != d or rot > d:
        raise ValueError(f"rotary dim {rot} must be even and at most the head dim of q ({d}) and k ({k.shape[2]})")
    if weights is None:
        return q, k, q.dtype
    for name, w in zip(("q", "k"), weights):
        if w.shape != (d,) or w.device != q.device:
            raise ValueError(f"the {name} norm weight must be [{d}] on {q.device}, got {tuple(w.shape)} on {w.device}")
    return q, k, q.dtype if zero_centred else torch.promote_types(q.dtype, weights[0].dtype)


def rotary_constexprs(inv_freq: torch.Tensor, weights: tuple | None, zero_centred: bool) -> dict:
    """The `rotate_rows` constexprs of a launch (all but D and BLOCK_D)."""
    return dict(ROT=2 * inv_freq.shape[0], NORM=weights is not None, ZERO_CENTRED=zero_centred,
                LIBDEVICE=os.environ.get("TRITON_INTERPRET") != "1")


def _launch(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor,
            weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float, zero_centred: bool,
            kv: tuple[torch.Tensor, CacheViews, torch.Tensor] | None = None):
    """kv: (v, the caches' views, slot_mapping): k and v go to their KV slots (k is not returned)."""
    one = k is None
    q, k, out_dtype = check_rotary(q, k, positions, inv_freq, weights, zero_centred)
    q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if kv is not None:
        v, views, slots = kv
        v = v if v.stride(2) == 1 else v.contiguous()
        k_out, v_cache = views.k, views.v  # k's destination: its slots
        scales = views.scale_args()
    else:
        k_out = q_out if one else torch.empty(k.shape, dtype=out_dtype, device=q.device)
        v, v_cache, slots = q, q_out, positions  # unused without WRITE_KV
        scales = (q_out, q_out) + (0,) * 8
    if q.shape[0] == 0:
        return q_out, k_out
    qw, kw = weights if weights is not None else (inv_freq, inv_freq)  # unused without NORM
    d = q.shape[2]
    block_h = triton.next_power_of_2(max(q.shape[1], k.shape[1]))
    block_d = triton.next_power_of_2(d)
    caches = (*k_out.stride()[:4], *v_cache.stride()[:4]) if kv is not None else (0,) * 8
    grid = (q.shape[0], 1 if one else 2 if kv is None else 3)
    _rotary_kernel[grid](
        q, k, q_out, k_out, qw.contiguous(), kw.contiguous(), positions.contiguous(), inv_freq.contiguous(),
        q.shape[1], k.shape[1], eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v, v_cache, slots, k_out.shape[1] if kv is not None else 1, v.stride(0), v.stride(1), *caches, *scales,
        D=d, BLOCK_H=block_h, BLOCK_D=block_d, WRITE_KV=kv is not None,
        BLOCK_SIZE=k_out.shape[2] if kv is not None else 1, **rotary_constexprs(inv_freq, weights, zero_centred),
        KV_FP8=kv is not None and kv[1].fp8,
        num_warps=4 if block_h * block_d <= 2048 else 8, **pdl.launch(q.device, grid[0] * grid[1]))
    return q_out, k_out


# -- public ops ------------------------------------------------------------------------------------


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R = 2 * len(inv_freq) dims of x: [T, H, D]; the rest passes (Triton).

    Same contract as `reference.apply_rotary`: positions: [T] int32 or int64;
    inv_freq: [R / 2] fp32 (`reference.rotary_inv_freq`), R <= D. Returns a new
    [T, H, D] tensor in x's dtype.
    """
    return _launch(x, None, positions, inv_freq, None, 0.0, False)[0]


def rotary_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
              zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention prologue in one launch (Triton): per-head RMSNorm of q and k, then RoPE on both.

    Same contract as `reference.rotary_qk`: q: [T, Hq, D], k: [T, Hk, D] (last
    dim contiguous); positions, inv_freq as in `apply_rotary`. With `q_weight`, `k_weight` ([D] each)
    each head is first RMS-normalized (`zero_centred`: times 1 + weight) as
    `reference.rms_norm` does; without them only the rotation runs. Returns new
    (q, k) tensors in the normalized dtype (q's dtype without norm).
    """
    weights = norm_weights("rotary_qk", q_weight, k_weight)
    return _launch(q, k, positions, inv_freq, weights, eps, zero_centred)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane,
                    slot_mapping: torch.Tensor,
                    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                    zero_centred: bool = False) -> torch.Tensor:
    """`rotary_qk`, then k and v stored at their KV slots, in one launch (Triton); returns q.

    Same contract as `reference.rotary_write_kv`: q, k, positions, inv_freq and the norms as
    in `rotary_qk`; v: [T, Hkv, D] like k; caches and slot_mapping [T] as in
    `reference.write_kv` (a slot < 0 writes nothing; slots distinct). The cache
    holds k as `rotary_qk` returns it, cast to the cache's dtype; an fp8 cache (`KVPlane`s) the bytes
    `KVPlane.store` writes for that k and v, quantized in this launch. There a sequence's new rows
    must be consecutive with consecutive slots (the engine's steps are), so that a block's first
    token written in this launch is the row `offset` rows up (kernels/kv_fp8.py).
    """
    weights = norm_weights("rotary_write_kv", q_weight, k_weight)
    views = cache_views(k_cache, v_cache)
    check_kv_write(views.k, views.v, k, v, slot_mapping)
    return _launch(q, k, positions, inv_freq, weights, eps, zero_centred, (v, views, slot_mapping))[0]


__all__ = ["apply_rotary", "check_rotary", "norm_weights", "rotary_constexprs", "rotary_qk", "rotary_write_kv",
           "rotate_rows"]
