"""Rotary position embedding on CUDA (rotate-half, full or partial), optionally fused with the qk-norm.

One kernel, grid (T, tensors): a program takes one token of q (or of k) with all
its heads, read once in three parts per head (dims [0, R/2), [R/2, R) and the
pass-through [R, D), R = 2 * len(inv_freq), each padded to a power of two), and

- takes its angles from its position: position * inv_freq[i] in fp32, then
  cos and sin (libdevice's, as torch's fp32 cos and sin on CUDA), so a step
  needs no cos/sin tables (torch made them in eight launches);
- optionally RMS-normalizes each head (Qwen3's per-head q/k norm; plain or
  zero-centred);
- rotates the first R dims by rotate-half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s);
  dims R .. D-1 pass through (partial rotary).

All of it runs in fp32 and is rounded once, at the store: closer to the fp32
truth than the reference's bf16 chain (which rounds after the norm, the weight,
cos/sin and each product), by design.

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

from radianced.kernels import pdl
from radianced.kernels.attention import check_kv_write, slot_offset

# -- kernel ----------------------------------------------------------------------------------------


@triton.jit
def _normed(x, w_ptr, cols, ok, sum_sq, eps, D: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """x [BLOCK_H, n] times rsqrt(mean square + eps) and the weight at `cols` (x itself without NORM), fp32."""
    if NORM:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
        if ZERO_CENTRED:
            w = 1.0 + w
        x = x * tl.rsqrt(sum_sq / D + eps) * w
    return x


@triton.jit
def _rotate_token(x_ptr, dst_ptr, stride_dh, w_ptr, t, n_heads, stride_xt, stride_xh, c, s, eps,
                  D: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_PASS: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """Normalize (optionally) and rotate the n_heads heads of token t into dst_ptr (token t's first
    head) + head * stride_dh: a row of the contiguous [T, n_heads, D] output, or a KV cache slot.

    Each head is read in three parts: x1 = dims [0, R/2), x2 = [R/2, R), the pass-through [R, D)."""
    HALF: tl.constexpr = ROT // 2
    h = tl.arange(0, BLOCK_H)
    h_ok = (h < n_heads)[:, None]
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    p = ROT + tl.arange(0, BLOCK_PASS)
    p_ok = p < D
    src = x_ptr + t.to(tl.int64) * stride_xt + h[:, None] * stride_xh
    dst = dst_ptr + h[:, None] * stride_dh
    x1 = tl.load(src + j[None, :], mask=h_ok & j_ok[None, :], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j[None, :], mask=h_ok & j_ok[None, :], other=0.0).to(tl.float32)
    xp = tl.load(src + p[None, :], mask=h_ok & p_ok[None, :], other=0.0).to(tl.float32)
    sum_sq = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1))[:, None]
    x1 = _normed(x1, w_ptr, j, j_ok, sum_sq, eps, D, NORM, ZERO_CENTRED)
    x2 = _normed(x2, w_ptr, HALF + j, j_ok, sum_sq, eps, D, NORM, ZERO_CENTRED)
    xp = _normed(xp, w_ptr, p, p_ok, sum_sq, eps, D, NORM, ZERO_CENTRED)
    ty = dst_ptr.dtype.element_ty
    tl.store(dst + j[None, :], (x1 * c[None, :] - x2 * s[None, :]).to(ty), mask=h_ok & j_ok[None, :])
    tl.store(dst + HALF + j[None, :], (x2 * c[None, :] + x1 * s[None, :]).to(ty), mask=h_ok & j_ok[None, :])
    tl.store(dst + p[None, :], xp.to(ty), mask=h_ok & p_ok[None, :])


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, q_heads, k_heads, eps,
                   stride_qt, stride_qh, stride_kt, stride_kh,
                   v_ptr, v_cache_ptr, slot_ptr, blocks_per_page, stride_vt, stride_vh,
                   stride_kp, stride_kn, stride_ks, stride_kch, stride_vp, stride_vn, stride_vs, stride_vch,
                   D: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_PASS: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                   WRITE_KV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, LIBDEVICE: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (t, 0) rotates q's token t, (t, 1) k's; WRITE_KV: k goes to its KV slot (k_out_ptr is
    the K cache), and program (t, 2) copies v to its slot; a slot < 0 writes nothing."""
    pdl.wait(PDL)
    t = tl.program_id(0)
    which = tl.program_id(1)
    t64 = t.to(tl.int64)
    k_dst = k_out_ptr + t64 * k_heads * D
    stride_kd = D
    if WRITE_KV:
        slot = tl.load(slot_ptr + t64).to(tl.int64)
        if (which > 0) & (slot < 0):
            return
        if which == 2:
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            mask = (h < k_heads)[:, None] & (d < D)[None, :]
            v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
            v_dst = v_cache_ptr + slot_offset(slot, blocks_per_page, stride_vp, stride_vn, stride_vs, BLOCK_SIZE)
            tl.store(v_dst + h[:, None] * stride_vch + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)
            return
        k_dst = k_out_ptr + slot_offset(slot, blocks_per_page, stride_kp, stride_kn, stride_ks, BLOCK_SIZE)
        stride_kd = stride_kch
    j = tl.arange(0, BLOCK_HALF)
    freqs = tl.load(pos_ptr + t64).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=j < ROT // 2, other=0.0)
    if LIBDEVICE:  # the angle of both rotary halves, with torch's fp32 cos and sin on CUDA
        c = libdevice.cos(freqs)
        s = libdevice.sin(freqs)
    else:  # Triton's interpreter (numpy's); tl.cos on CUDA may be the approximate cos.approx.f32
        c = tl.cos(freqs)
        s = tl.sin(freqs)
    if which == 0:
        _rotate_token(q_ptr, q_out_ptr + t64 * q_heads * D, D, qw_ptr, t, q_heads, stride_qt, stride_qh,
                      c, s, eps, D, ROT, BLOCK_H, BLOCK_HALF, BLOCK_PASS, NORM, ZERO_CENTRED)
    else:
        _rotate_token(k_ptr, k_dst, stride_kd, kw_ptr, t, k_heads, stride_kt, stride_kh,
                      c, s, eps, D, ROT, BLOCK_H, BLOCK_HALF, BLOCK_PASS, NORM, ZERO_CENTRED)


# -- launcher --------------------------------------------------------------------------------------


def _check_heads(name: str, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, H, D], got shape {tuple(x.shape)}")
    if x.shape[0] != positions.shape[0]:
        raise ValueError(f"{name} has {x.shape[0]} tokens, positions has {positions.shape[0]}")
    if x.device != positions.device:
        raise ValueError(f"{name} is on {x.device}, positions on {positions.device}")
    return x if x.stride(2) == 1 else x.contiguous()


def _check_rope(positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [T] int32 or int64, got shape {tuple(positions.shape)} {positions.dtype}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.device != positions.device:
        raise ValueError(f"inv_freq must be [R / 2] float32 on {positions.device}, got shape "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype} on {inv_freq.device}")


def _launch(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor,
            weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float, zero_centred: bool,
            kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """kv: (v, k_cache, v_cache, slot_mapping): k and v go to their KV slots (k is not returned)."""
    _check_rope(positions, inv_freq)
    rot = 2 * inv_freq.shape[0]
    q = _check_heads("q", q, positions)
    k = q if k is None else _check_heads("k", k, positions)
    d = q.shape[2]
    if k.shape[2] != d or rot % 2 or rot > d:
        raise ValueError(f"rotary dim {rot} must be even and at most the head dim of q ({d}) and k ({k.shape[2]})")
    out_dtype = q.dtype
    if weights is not None:
        for name, w in zip(("q", "k"), weights):
            if w.shape != (d,) or w.device != q.device:
                raise ValueError(f"the {name} norm weight must be [{d}] on {q.device}, got {tuple(w.shape)} "
                                 f"on {w.device}")
        if not zero_centred:
            out_dtype = torch.promote_types(q.dtype, weights[0].dtype)
    q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if kv is not None:
        v, k_cache, v_cache, slots = kv
        v = v if v.stride(2) == 1 else v.contiguous()
        k_out = k_cache  # k's destination: its slots
    else:
        k_out = q_out if k is q else torch.empty(k.shape, dtype=out_dtype, device=q.device)
        v, v_cache, slots = q, q_out, positions  # unused without WRITE_KV
    if q.shape[0] == 0:
        return q_out, k_out
    qw, kw = weights if weights is not None else (inv_freq, inv_freq)  # unused without NORM
    block_h = triton.next_power_of_2(max(q.shape[1], k.shape[1]))
    block_half = triton.next_power_of_2(max(rot // 2, 1))
    block_pass = triton.next_power_of_2(max(d - rot, 1))
    elems = block_h * (2 * block_half + block_pass)
    caches = (*k_out.stride()[:4], *v_cache.stride()[:4]) if kv is not None else (0,) * 8
    grid = (q.shape[0], 1 if k is q else 2 if kv is None else 3)
    _rotary_kernel[grid](
        q, k, q_out, k_out, qw.contiguous(), kw.contiguous(), positions.contiguous(), inv_freq.contiguous(),
        q.shape[1], k.shape[1], eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v, v_cache, slots, k_out.shape[1] if kv is not None else 1, v.stride(0), v.stride(1), *caches,
        D=d, ROT=rot, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        NORM=weights is not None, ZERO_CENTRED=zero_centred, WRITE_KV=kv is not None,
        BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=k_out.shape[2] if kv is not None else 1,
        LIBDEVICE=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=4 if elems <= 2048 else 8, **pdl.launch(q.device, grid[0] * grid[1]))
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
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rotary_qk needs both q_weight and k_weight, or neither")
    weights = None if q_weight is None else (q_weight, k_weight)
    return _launch(q, k, positions, inv_freq, weights, eps, zero_centred)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                    zero_centred: bool = False) -> torch.Tensor:
    """`rotary_qk`, then k and v stored at their KV slots, in one launch (Triton); returns q.

    Same contract as `reference.rotary_write_kv`: q, k, positions, inv_freq and the norms as
    in `rotary_qk`; v: [T, Hkv, D] like k; caches and slot_mapping [T] as in
    `reference.write_kv` (a slot < 0 writes nothing; slots distinct). The cache
    holds k as `rotary_qk` returns it, cast to the cache's dtype.
    """
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rotary_write_kv needs both q_weight and k_weight, or neither")
    check_kv_write(k_cache, v_cache, k, v, slot_mapping)
    weights = None if q_weight is None else (q_weight, k_weight)
    return _launch(q, k, positions, inv_freq, weights, eps, zero_centred, (v, k_cache, v_cache, slot_mapping))[0]


__all__ = ["apply_rotary", "rotary_qk", "rotary_write_kv"]
