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

Compact weights (`CompactWeight` in q8_0, q4_0, q4_1 or fp8_b128: kernels/formats.py) are
read as their bytes and dequantized in registers (kernels/weight_tiles.py, the format a
constexpr), each tile in fp32 as `dequant.py` does, then rounded to x's dtype before the
products, as the reference rounds a dequantized weight: within fp32 rounding of
`reference.linear` on `CompactWeight.dequantize`. They have no cuBLAS path, so every T runs a
kernel: the gemv at T = 1, the "dot" tiles above, and above 16 rows the same "dot" kernel with
BLOCK_M rows a program over a second grid axis (up to 128; a tile-wise GEMM). That rather than
dequantizing the whole matrix into a workspace per call and handing it to cuBLAS, because the
rows past 16 are decode batches first (b32 is a graph-captured weight stream): q/k/v at
2048 -> 5120 in q4_0 is 5.9 MB, where the workspace path reads it, writes the 21.0 MB bf16
copy and cuBLAS reads that again (47.9 MB, 2.3x a bf16 weight's own bytes and 8x q4_0's), and
the receipt would charge a workspace of the largest such matrix (and the decode graphs' pool
a copy). The price is at long prefill: each M tile dequantizes the whole weight again (from
L2; weight_tiles.py loads a block's scale once and its quants as words) against 2 * BLOCK_M
tensor-core FLOPs. Measured on the H200 (tests/gpu/test_linear_compact_gpu.py, bench/README
session 13): at T = 4,096 q/k/v and o_proj ran at 0.14-0.37x of bf16 cuBLAS (0.28-0.92 ms against
0.10-0.13), the number that argues for a workspace (or fp8 tensor-core) path above some T. RowStack weights ([q | k | v]
of several formats) run one launch per part into column slices of one output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radianced.kernels import gemm
from radianced.kernels import norm as norm_kernels
from radianced.kernels import pdl
from radianced.kernels.compact import CompactWeight, RowStack
from radianced.kernels.formats import COMPACT_TILES
from radianced.kernels.reference import Norm
from radianced.kernels.weight_tiles import weight_tile

SKINNY_MAX_ROWS = 16  # rows up to which the "dot" kernel runs: one 16-row tile (tl.dot's smallest M)
ROW_BYTES_PER_STEP = 1024  # bytes of each weight row a "dot" program loads per K step (512 bf16 elements)
CUBLAS_MIN_N = 4096  # from this many outputs cuBLAS beats the "dot" tiles at 1 < T <= 16
COMPACT_MAX_BLOCK_M = 128  # rows a "dot" program takes of a compact weight's many-row GEMM
COMPACT_STEP = 512  # values of K a compact weight's skinny "dot" step takes (`_compact_config`)
COMPACT_MAX_BYTES = 2 ** 31  # weight_tiles.py's int32 byte offsets

# -- heuristics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearConfig:
    block_n: int  # outputs (weight rows) per program
    block_k: int  # reduction step ("gemv": ignored, a program holds whole rows)
    num_warps: int
    num_stages: int
    kind: str = "dot"  # "dot": tensor-core tiles over a K loop; "gemv": whole rows in registers
    block_m: int = SKINNY_MAX_ROWS  # "dot": rows of x per program (the grid's second axis covers T)


GEMV_MAX_K = 8192  # "gemv" holds block_n whole weight rows in registers: K up to this
GEMV_WIDE_N = 32768  # from this many outputs (an lm_head) a gemv program takes 4 rows, not 2


def linear_config(t: int, n: int, k: int, dtype: torch.dtype, fmt: str | None = None) -> LinearConfig | None:
    """The kernel and tiles for T rows against an [N, K] weight of `dtype` (or in compact format
    `fmt`), or None: torch's F.linear (cuBLAS) does better. From the H200 sweep (tools/bench_kernels.py,
    Qwen3-30B-A3B's q/k/v 2048 -> 5120, o_proj 4096 -> 2048 with the residual, router 2048 -> 128, bf16):

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

    A compact weight is never None (`_compact_config`).
    """
    if t == 1 and k <= GEMV_MAX_K:
        return LinearConfig(4 if n >= GEMV_WIDE_N else 2, 0, num_warps=8, num_stages=1, kind="gemv")
    if fmt is not None:
        return _compact_config(t, k, dtype)
    if t > SKINNY_MAX_ROWS or n >= CUBLAS_MIN_N:
        return None
    block_k = min(ROW_BYTES_PER_STEP // dtype.itemsize, max(16, triton.next_power_of_2(k)))
    return LinearConfig(16, block_k, num_warps=4, num_stages=3)


def _compact_config(t: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """"dot" tiles for a compact weight at T > 1 (or K over GEMV_MAX_K). Up to 16 rows the skinny tiles
    with K steps of COMPACT_STEP values (at most next_pow2(K)): a compact weight's step is a stream of
    few bytes (512 values are 272-320 bytes of GGUF blocks, 516 of fp8_b128, where bf16's 1,024-byte
    step holds 512 values), and each value is dequantized in fp32 registers (8,192 a [16, 512] tile, 64
    a thread at 4 warps: the MoE's decode tile); the wider step halves the K loop's steps against
    the 256 first chosen. Shared memory at 3 stages (2 buffers of each prefetched load, kernels/moe.py
    `moe_config`): bf16 x [16, 512] 16 KB a stage and at most 17 KB of weight words (q8_0's 16 blocks
    a row, 17 words each), 66 KB, plus 16 KB to convert the tile for the dot; fp32 x ~130 KB. Above
    16 rows BLOCK_M = next_pow2(T) up to COMPACT_MAX_BLOCK_M over 64 x 64 tiles, the MoE kernel's
    prefill shape, 8 warps at 128 rows. On the H200 (tests/gpu/test_linear_compact_gpu.py, bench/README
    session 13) the skinny tiles ran at 0.49-1.32x of bf16's speed at T = 8 and 32, the many-row ones at
    0.14-0.37x at T = 4,096."""
    if t <= SKINNY_MAX_ROWS:
        return LinearConfig(16, min(COMPACT_STEP, max(32, triton.next_power_of_2(k))), num_warps=4, num_stages=3)
    block_m = min(COMPACT_MAX_BLOCK_M, triton.next_power_of_2(t))
    return LinearConfig(64, 64, num_warps=8 if block_m > 64 else 4,
                        num_stages=2 if dtype == torch.float32 else 3, block_m=block_m)


# -- kernel ----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, num_rows, n, k,
                   stride_x, stride_w, stride_b, stride_r, stride_o,
                   FMT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): outputs [j * BLOCK_M, +BLOCK_M) x [i * BLOCK_N, +BLOCK_N) over a K loop. FMT "":
    the weight in x's dtype (rows `stride_w` apart); else `w_ptr` is a compact matrix's bytes, each
    tile dequantized in fp32 (`weight_tile`) and rounded to x's dtype before the dot."""
    pdl.wait(PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
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
        w_mask = col_ok[:, None] & k_ok[None, :]
        if FMT == "":
            w = tl.load(w_row + kk[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        else:
            w = weight_tile(w_ptr, cols, kk, w_mask, n, k, FMT).to(x.dtype)
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
                 FMT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr,
                 ZERO_CENTRED: tl.constexpr, KEEP_NORMED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """CUDA-core products: a program loads its BLOCK_N whole weight rows at once (every load in
    flight together, no loop), then for each of the T rows of x multiplies and sums over K in fp32.
    FMT: "" for a weight in x's dtype, else a compact format whose rows are dequantized in fp32
    (`weight_tile`) and rounded to x's dtype, as the reference rounds them.
    NORM: each program RMS-normalizes x's whole row first, with kernels/norm.py's rounding steps
    (plain: `weight * round(x * rstd)`, zero-centred: `x * rstd * (1 + weight)`, each rounded to
    x's dtype); KEEP_NORMED: program 0 also stores the normed row. Under PDL the weight loads are
    issued before the grid wait: they overlap the previous kernel's tail. Results are rounded to
    x's dtype, then stored in out's."""
    ty = x_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < k
    w_mask = col_ok[:, None] & k_ok[None, :]
    if FMT == "":
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + kk[None, :], mask=w_mask, other=0.0)
    else:
        w = weight_tile(w_ptr, cols, kk, w_mask, n, k, FMT).to(ty)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)
    if NORM:
        norm_w = tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    pdl.wait(PDL)
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


# -- launchers -------------------------------------------------------------------------------------

Weight = torch.Tensor | CompactWeight


def _operand(w: Weight) -> tuple[str, torch.Tensor, int]:
    """(the kernels' FMT, the tensor w_ptr points at, its row stride): a compact weight's bytes (the
    format addresses them itself), or the dense matrix."""
    if isinstance(w, CompactWeight):
        return w.fmt, w.data, 0
    return "", w, w.stride(0)


def _launch_gemv(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, residual: torch.Tensor | None,
                 norm: Norm | None, keep_normed: bool, out: torch.Tensor, cfg: LinearConfig) -> torch.Tensor:
    """The gemv kernel into out [T, N]; returns x's normed rows (a new tensor with `norm` and
    `keep_normed`, else x)."""
    t, k = x.shape
    n = out.shape[1]
    fmt, w_arg, stride_w = _operand(w)
    fused = norm is not None
    normed = torch.empty_like(x) if fused and keep_normed else x
    programs = triton.cdiv(n, cfg.block_n)
    _gemv_kernel[(programs,)](
        x, w_arg, x if bias is None else bias, x if residual is None else residual, out,
        norm[0] if fused else x, normed, t, n, k, norm[1] if fused else 0.0,
        x.stride(0), stride_w, 0 if bias is None else bias.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), normed.stride(0),
        FMT=fmt, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, NORM=fused,
        ZERO_CENTRED=fused and norm[2], KEEP_NORMED=fused and keep_normed, BLOCK_N=cfg.block_n,
        BLOCK_K=triton.next_power_of_2(k), num_warps=cfg.num_warps, num_stages=1, **pdl.launch(x.device, programs),
    )
    return normed


def _launch_dot(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, residual: torch.Tensor | None,
                out: torch.Tensor, cfg: LinearConfig) -> None:
    """The "dot" kernel into out [T, N] (rows may be strided: a column slice of a wider output)."""
    t, k = x.shape
    n = out.shape[1]
    fmt, w_arg, stride_w = _operand(w)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(t, cfg.block_m))
    _linear_kernel[grid](
        x, w_arg, x if bias is None else bias, x if residual is None else residual, out, t, n, k,
        x.stride(0), stride_w, 0 if bias is None else bias.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0),
        FMT=fmt, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(x.device, grid[0] * grid[1]),
    )


def _project(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, residual: torch.Tensor | None,
             out: torch.Tensor, cfg: LinearConfig | None) -> None:
    """out [T, N] = residual + (x @ w^T + bias) by the kernel `cfg` (or `linear_config`) picks; where
    that is torch's (a dense weight), its result copied in."""
    t, k = x.shape
    if t == 0:
        return
    cfg = cfg or linear_config(t, w.shape[0], k, x.dtype, _format(w))
    if cfg is None:
        out.copy_(_torch_linear(x, w, bias, residual))
    elif cfg.kind == "gemv" and k <= GEMV_MAX_K:
        _launch_gemv(x, w, bias, residual, None, False, out, cfg)
    else:
        _launch_dot(x, w, bias, residual, out, cfg)


def _format(w: Weight) -> str | None:
    return w.fmt if isinstance(w, CompactWeight) else None


def _check_weight(x: torch.Tensor, w: Weight) -> None:
    k = x.shape[1]
    if isinstance(w, CompactWeight):
        if w.shape[1] != k:
            raise ValueError(f"weight must be [N, K={k}], got a {w.fmt} matrix of shape {list(w.shape)}")
        if w.fmt not in COMPACT_TILES:
            raise ValueError(f"the Triton linear reads {', '.join(COMPACT_TILES)} weights, not {w.fmt} "
                             f"({list(w.shape)}); convert with --quantize layers=int8, int4 or fp8")
        if w.nbytes >= COMPACT_MAX_BYTES or not w.data.is_contiguous() or w.data.data_ptr() % 16:
            raise ValueError(f"a {w.fmt} weight's bytes must be contiguous, 16-byte aligned and under 2^31 "
                             f"(its scales are loaded as fp16 / fp32 at int32 offsets), got {w.nbytes} at "
                             f"address {w.data.data_ptr():#x} strides {w.data.stride()}")
        tensor = w.data
    else:
        if w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1:
            raise ValueError(f"weight must be [N, K={k}] with contiguous rows, got shape {tuple(w.shape)} "
                             f"strides {w.stride()}")
        if w.dtype != x.dtype:
            raise ValueError(f"weight is {w.dtype}, x is {x.dtype}: all operands must share x's dtype")
        tensor = w
    if tensor.device != x.device:
        raise ValueError(f"weight is on {tensor.device}, x on {x.device}")


def _check(x: torch.Tensor, parts: tuple[Weight, ...], bias: torch.Tensor | None, residual: torch.Tensor | None,
           norm: Norm | None) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not supported (bf16, fp16, fp32)")
    t, k = x.shape
    for w in parts:
        _check_weight(x, w)
    n = sum(w.shape[0] for w in parts)
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [N={n}], got shape {tuple(bias.shape)}")
    if residual is not None and (tuple(residual.shape) != (t, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [T={t}, N={n}] with a contiguous last dim, got shape "
                         f"{tuple(residual.shape)} strides {residual.stride()}")
    for name, tensor in (("bias", bias), ("residual", residual)):
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name} is {tensor.dtype}, x is {x.dtype}: all operands must share x's dtype")
    if norm is not None and (norm[0].shape != (k,) or norm[0].dtype != x.dtype or norm[0].device != x.device):
        raise ValueError(f"the norm weight must be [K={k}] {x.dtype} on {x.device}, got "
                         f"{tuple(norm[0].shape)} {norm[0].dtype} on {norm[0].device}")


def linear(x: torch.Tensor, weight: torch.Tensor | CompactWeight | RowStack, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: Norm | None = None, keep_normed: bool = False, *,
           out_dtype: torch.dtype | None = None,
           cfg: LinearConfig | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`residual + (rms_norm(x) @ weight^T + bias)` (Triton, or torch where `linear_config` says);
    contract of `reference.linear`.

    x: [T, K] (last dim contiguous); weight: [N, K] in x's dtype (rows contiguous), a
    `CompactWeight` (q8_0, q4_0, q4_1, fp8_b128; its bytes on x's device, 16-byte aligned), or a
    `RowStack` of those (one launch per part, into its columns); bias: [N] or None; residual:
    [T, N] (last dim contiguous) or None; norm: (weight [K] in x's dtype, eps, zero_centred) or
    None; one dtype for all dense operands. Returns a new [T, N] in x's dtype (its values rounded
    to x's dtype, stored as `out_dtype` when given), or (that, the normed x) with `keep_normed`.
    The gemv kernel does the norm in the same launch (one weight, T = 1); the other paths run
    kernels/norm.py's first. `cfg` overrides `linear_config` (benchmarks; for every part).
    """
    parts = weight.parts if isinstance(weight, RowStack) else (weight,)
    _check(x, parts, bias, residual, norm)
    t, k = x.shape
    n = sum(w.shape[0] for w in parts)
    if len(parts) == 1:
        cfg = cfg or linear_config(t, n, k, x.dtype, _format(weight))
        if cfg is None or (t == 0 and isinstance(weight, torch.Tensor)):  # torch's F.linear (cuBLAS)
            x = x if norm is None else norm_kernels.rms_norm(x, *norm)
            y = _torch_linear(x, weight, bias, residual)
            y = y if out_dtype is None else y.to(out_dtype)
            return (y, x) if keep_normed else y
        if t > 0 and cfg.kind == "gemv" and k <= GEMV_MAX_K:
            out = torch.empty((t, n), dtype=out_dtype or x.dtype, device=x.device)
            normed = _launch_gemv(x, weight, bias, residual, norm, keep_normed, out, cfg)
            return (out, normed) if keep_normed else out
    if norm is not None:
        x = norm_kernels.rms_norm(x, *norm)  # its own launch, then the projection of the normed rows
    out = torch.empty((t, n), dtype=out_dtype or x.dtype, device=x.device)
    lo = 0
    for w in parts:
        hi = lo + w.shape[0]
        _project(x, w, None if bias is None else bias[lo:hi], None if residual is None else residual[:, lo:hi],
                 out[:, lo:hi], cfg)
        lo = hi
    return (out, x) if keep_normed else out


def _torch_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None) -> torch.Tensor:
    """`reference.linear`'s arithmetic (F.linear rounded to x's dtype, then the residual added), with the
    GEMM at a bucketed row count (kernels/gemm.py)."""
    y = gemm.linear(x, w, bias)
    return y if residual is None else residual + y


def silu_mlp(x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
    """`reference.silu_mlp`, `down(silu(gate(x)) * up(x))`: dense weights through torch's F.linear at
    bucketed row counts (kernels/gemm.py); a compact one makes each projection `linear` above, so no
    dense copy of it is made. Rounding as the reference: each projection rounded to x's dtype, the SiLU
    and product in it."""
    if all(isinstance(w, torch.Tensor) for w in (gate, up, down)):
        return gemm.linear(F.silu(gemm.linear(x, gate)) * gemm.linear(x, up), down)
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


__all__ = ["SKINNY_MAX_ROWS", "LinearConfig", "linear", "linear_config", "silu_mlp"]
