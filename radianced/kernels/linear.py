"""The skinny linear: `residual + (rms_norm(x) @ W^T + bias)` for a few rows in one pass over W.

x: [T, K] (last dim contiguous, rows may be strided), weight: [N, K] (rows
contiguous), bias: [N] or None, residual: [T, N] or None (last dim contiguous),
all of one dtype (bf16, fp16 or fp32). Returns a new [T, N] in that dtype, or
stored as `out_dtype` (the lm_head's fp32 logits: the values rounded to x's
dtype, as `F.linear(...).float()` gives them, without a cast launch).

At decode a projection is a weight stream: Qwen3-30B-A3B's q/k/v (2048 -> 5120,
21 MB of bf16) makes a few rows of outputs from every weight byte, so its floor
is the weight's bytes over HBM bandwidth (5.0 us on an H200). Two kernels:

- "gemv" (T = 1): a program loads its BLOCK_N whole weight rows at once, every
  load in flight together (no K loop, nothing for a pipeline to hide), and sums
  the products with x's row in fp32 on the CUDA cores. Thousands of small
  programs keep HBM busy; at T > 1 it redoes the convert, multiply and sum over
  its rows once per row of x and loses.
- "dot" (1 < T <= 16): the grid is over column tiles of BLOCK_N outputs; a
  program holds all T rows of x as one 16-row tile (tl.dot's smallest M, T
  padded with masked rows) and loops over K in steps of BLOCK_K through
  Triton's shared-memory pipeline (`num_stages` tiles in flight); tensor cores
  for bf16 / fp16, IEEE products for fp32. Each weight byte is read once.

Both epilogues add the bias to the fp32 accumulator and round once to the dtype
(cuBLAS's bias epilogue does the same, and so does torch's CPU F.linear), then
add the residual in fp32 and round again: the reference's
`residual + F.linear(x, W, b)`, two roundings. The residual add is what o_proj
gains most from: cuBLAS needs a second launch for it. The gemv kernel also takes
the layer's RMSNorm (`norm=`): each program loads x's whole row anyway, so it
normalizes it (kernels/norm.py's rounding steps) before its products, and
program 0 can keep the normed row (`keep_normed`: the router's launch hands it
to the experts); one launch a norm less. Other paths run the norm kernel first.

The lm_head (Qwen3's 2048 -> 151,936, 622 MB) is the gemv too, with the final
norm in its launch and fp32 logits out: 142 us on an H200 where the norm
kernel, cuBLAS and the fp32 cast took 155 (4.38 against 4.01 TB/s).

`linear_config` picks the kernel and tiles from the H200 sweep of
`tools/bench_kernels.py` (the numbers are in its docstring), or None where cuBLAS is
faster: then torch's F.linear, and the residual add, run instead
(`reference.linear`), as they do above 16 rows (prefill: a real GEMM).
The launch has no host sync (graph-capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radianced.kernels import norm as norm_kernels
from radianced.kernels import pdl
from radianced.kernels import reference
from radianced.kernels.reference import Norm

SKINNY_MAX_ROWS = 16  # rows up to which the "dot" kernel runs: one 16-row tile (tl.dot's smallest M)
ROW_BYTES_PER_STEP = 1024  # bytes of each weight row a "dot" program loads per K step (512 bf16 elements)
CUBLAS_MIN_N = 4096  # from this many outputs cuBLAS beats the "dot" tiles at 1 < T <= 16

# -- heuristics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearConfig:
    block_n: int  # outputs (weight rows) per program
    block_k: int  # reduction step ("gemv": ignored, a program holds whole rows)
    num_warps: int
    num_stages: int
    kind: str = "dot"  # "dot": tensor-core tiles over a K loop; "gemv": whole rows in registers


GEMV_MAX_K = 8192  # "gemv" holds block_n whole weight rows in registers: K up to this
GEMV_WIDE_N = 32768  # from this many outputs (an lm_head) a gemv program takes 4 rows, not 2


def linear_config(t: int, n: int, k: int, dtype: torch.dtype) -> LinearConfig | None:
    """The kernel and tiles for T rows against an [N, K] weight of `dtype`, or None: torch's
    F.linear (cuBLAS) does better. From the H200 sweep (tools/bench_kernels.py, Qwen3-30B-A3B's
    q/k/v 2048 -> 5120, o_proj 4096 -> 2048 with the residual, router 2048 -> 128, bf16):

    - T = 1: "gemv", two rows a program, 8 warps: 7.7, 6.9 and 2.1 us, where cuBLAS takes 9.0,
      11.5 (with its separate add) and 5.3; the tensor-core tiles 9.2-9.7, 9.3-11 and 4.6-5.7.
      From GEMV_WIDE_N outputs four rows a program: the lm_head (151,936 x 2048 with the final
      norm) 142.1 us at 4 rows, 142.6 at 8, 144.7 at 16 and 168.5 at 2 (38K programs, not 76K).
    - 1 < T <= 16: "dot" tiles of 16 columns x 1,024 bytes of K (512 bf16 elements), 3 stages:
      o_proj 9.6 us (cuBLAS and the add 11.7), the router 4.6-4.8 (5.3-5.5); "gemv" re-reads its
      rows per row of x (13-46 us). For N >= 4096 (q/k/v) cuBLAS wins (8.4-8.8 us, the best tiles
      9.4), so None. (Until session 5 this picked 512 bytes, 256 elements: o_proj 12.2 us, the
      router 6.0; bench/results/2026-11-29-h200-8e96349-kernels-linear-*.json.)
    - T > 16: None (prefill: a real GEMM).
    """
    if t == 1 and k <= GEMV_MAX_K:
        return LinearConfig(4 if n >= GEMV_WIDE_N else 2, 0, num_warps=8, num_stages=1, kind="gemv")
    if t > SKINNY_MAX_ROWS or n >= CUBLAS_MIN_N:
        return None
    block_k = min(ROW_BYTES_PER_STEP // dtype.itemsize, max(16, triton.next_power_of_2(k)))
    return LinearConfig(16, block_k, num_warps=4, num_stages=3)


# -- kernel ----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, num_rows, n, k,
                   stride_x, stride_w, stride_b, stride_r, stride_o,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < n
    r64 = rows.to(tl.int64)[:, None]
    x_row = x_ptr + r64 * stride_x
    w_row = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        x = tl.load(x_row + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_row + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    ty = x_ptr.dtype.element_ty
    y = acc.to(ty)
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:  # torch's `residual + y`: y rounded first, the sum rounded again
        r = tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(ty)
    tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, norm_w_ptr, normed_ptr, num_rows, n, k, eps,
                 stride_x, stride_w, stride_b, stride_r, stride_o, stride_normed,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr,
                 ZERO_CENTRED: tl.constexpr, KEEP_NORMED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """CUDA-core products: a program loads its BLOCK_N whole weight rows at once (every load in
    flight together, no loop), then for each of the T rows of x multiplies and sums over K in fp32.
    NORM: each program RMS-normalizes x's whole row first, with kernels/norm.py's rounding steps
    (plain: `weight * round(x * rstd)`, zero-centred: `x * rstd * (1 + weight)`, each rounded to
    x's dtype); KEEP_NORMED: program 0 also stores the normed row. Under PDL the weight loads are
    issued before the grid wait: they overlap the previous kernel's tail. Results are rounded to
    x's dtype, then stored in out's."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < k
    w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)
    if NORM:
        norm_w = tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    pdl.wait(PDL)
    ty = x_ptr.dtype.element_ty
    for t in range(num_rows):
        x = tl.load(x_ptr + t * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, 0) / k + eps)
            if ZERO_CENTRED:
                x = (x * rstd * (1.0 + norm_w)).to(ty).to(tl.float32)
            else:
                x = ((x * rstd).to(ty).to(tl.float32) * norm_w).to(ty).to(tl.float32)
            if KEEP_NORMED:
                if tl.program_id(0) == 0:
                    tl.store(normed_ptr + t * stride_normed + kk, x.to(ty), mask=k_ok)
        acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            acc += bias
        y = acc.to(ty)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + t * stride_r + cols, mask=col_ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(ty)
        tl.store(out_ptr + t * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


# -- launcher --------------------------------------------------------------------------------------


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not supported (bf16, fp16, fp32)")
    t, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, K={k}] with contiguous rows, got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [N={n}], got shape {tuple(bias.shape)}")
    if residual is not None and (tuple(residual.shape) != (t, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [T={t}, N={n}] with a contiguous last dim, got shape "
                         f"{tuple(residual.shape)} strides {residual.stride()}")
    for name, tensor in (("weight", weight), ("bias", bias), ("residual", residual)):
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name} is {tensor.dtype}, x is {x.dtype}: all operands must share x's dtype")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: Norm | None = None, keep_normed: bool = False, *,
           out_dtype: torch.dtype | None = None,
           cfg: LinearConfig | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`residual + (rms_norm(x) @ weight^T + bias)` (Triton for T <= SKINNY_MAX_ROWS, else torch);
    contract of `reference.linear`.

    x: [T, K] (last dim contiguous); weight: [N, K] (rows contiguous); bias: [N] or
    None; residual: [T, N] (last dim contiguous) or None; norm: (weight [K] in x's
    dtype, eps, zero_centred) or None; one dtype for all. Returns a new [T, N] in
    x's dtype (its values rounded to x's dtype, stored as `out_dtype` when given),
    or (that, the normed x) with `keep_normed`. The gemv kernel does the norm in
    the same launch; the other paths run kernels/norm.py's first.
    `cfg` overrides `linear_config` (benchmarks).
    """
    _check(x, weight, bias, residual)
    if norm is not None and (norm[0].shape != (x.shape[1],) or norm[0].dtype != x.dtype
                             or norm[0].device != x.device):
        raise ValueError(f"the norm weight must be [K={x.shape[1]}] {x.dtype} on {x.device}, got "
                         f"{tuple(norm[0].shape)} {norm[0].dtype} on {norm[0].device}")
    t, k = x.shape
    n = weight.shape[0]
    cfg = cfg or linear_config(t, n, k, x.dtype)
    gemv = t > 0 and cfg is not None and cfg.kind == "gemv" and k <= GEMV_MAX_K
    if norm is not None and not gemv:
        x = norm_kernels.rms_norm(x, *norm)  # its own launch, then the projection of the normed rows
    if gemv:
        out = torch.empty((t, n), dtype=out_dtype or x.dtype, device=x.device)
        fused = norm is not None
        normed = torch.empty_like(x) if fused and keep_normed else x
        programs = triton.cdiv(n, cfg.block_n)
        _gemv_kernel[(programs,)](
            x, weight, x if bias is None else bias, x if residual is None else residual, out,
            norm[0] if fused else x, normed, t, n, k, norm[1] if fused else 0.0,
            x.stride(0), weight.stride(0), 0 if bias is None else bias.stride(0),
            0 if residual is None else residual.stride(0), out.stride(0), normed.stride(0),
            HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, NORM=fused,
            ZERO_CENTRED=fused and norm[2], KEEP_NORMED=fused and keep_normed, BLOCK_N=cfg.block_n,
            BLOCK_K=triton.next_power_of_2(k), num_warps=cfg.num_warps, num_stages=1, **pdl.launch(x.device, programs),
        )
        return (out, normed) if keep_normed else out
    if t == 0 or cfg is None or t > SKINNY_MAX_ROWS:
        return reference.linear(x, weight, bias, residual, keep_normed=keep_normed, out_dtype=out_dtype)
    out = torch.empty((t, n), dtype=out_dtype or x.dtype, device=x.device)
    programs = triton.cdiv(n, cfg.block_n)
    _linear_kernel[(programs,)](
        x, weight, x if bias is None else bias, x if residual is None else residual, out, t, n, k,
        x.stride(0), weight.stride(0), 0 if bias is None else bias.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=SKINNY_MAX_ROWS,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(x.device, programs),
    )
    return (out, x) if keep_normed else out


__all__ = ["SKINNY_MAX_ROWS", "LinearConfig", "linear", "linear_config"]
