"""The skinny linear: `residual + (x @ W^T + bias)` for a few rows in one pass over W.

x: [T, K] (last dim contiguous, rows may be strided), weight: [N, K] (rows
contiguous), bias: [N] or None, residual: [T, N] or None (last dim contiguous),
all of one dtype (bf16, fp16 or fp32). Returns a new [T, N] in that dtype.

At decode a projection is a weight stream: Qwen3-30B-A3B's q/k/v (2048 -> 5120,
21 MB of bf16) makes a few rows of outputs from every weight byte, so its floor
is the weight's bytes over HBM bandwidth (5.0 us on an H200; cuBLAS took 7.6).
For T <= SKINNY_MAX_ROWS (16) one Triton kernel does it:

- the grid is over column tiles of BLOCK_N outputs (rows of W); a program holds
  all T rows of x as one 16-row tile (T padded with masked rows: tl.dot's
  smallest M) and loops over K in steps of BLOCK_K, so each weight byte is read
  exactly once per call;
- products by `tl.dot` (x [16, BLOCK_K] @ W^T [BLOCK_K, BLOCK_N]) into an fp32
  accumulator: tensor cores for bf16 / fp16, IEEE products (no tf32) for fp32
  inputs. tl.dot's operands go through Triton's shared-memory pipeline,
  `num_stages` tiles in flight per program, which is what keeps enough bytes
  requested to saturate HBM; the 15 padding rows at T = 1 cost tensor-core time
  the stream should never wait for. A CUDA-core product for T = 1 (broadcast
  multiply, sum over K) would be a second code path whose loads the compiler
  need not pipeline; there is none;
- the epilogue adds the bias to the fp32 accumulator and rounds once to the
  dtype (cuBLAS's bias epilogue does the same, and so does torch's CPU F.linear),
  then adds the residual in fp32 and rounds again: the reference's
  `residual + F.linear(x, W, b)`, two roundings.

Tiles (`linear_config`, a function of the shape so a benchmark can sweep it):
BLOCK_K spans 512 bytes of a weight row (256 bf16, 128 fp32), or all of a
shorter K. BLOCK_N is 32 when that still gives MIN_PROGRAMS programs (about one
per SM of an H200, 132), else 16: q/k/v (N = 5120) gets 160 programs, o_proj
(N = 2048) 128. Such grids keep 3 tiles in flight per program (4 stages):
128 x 3 x 8 KB is 3 MB requested at once, about HBM's bandwidth times its
latency. The router (N = 128, 0.5 MB) has 8 programs of 16 rows; rather than
split K (more programs, then a second launch to sum the partials in a fixed
order, which costs about what the whole 0.5 MB stream does), a small grid gets 6
stages, so its 8 programs have most of the 0.5 MB requested in the first round
trip. One launch, no workspace, deterministic. None of this was measured when
written: `tools/bench_kernels.py`'s `linear` section sweeps it.

Above SKINNY_MAX_ROWS (prefill) the projection is a real GEMM and cuBLAS is good
there: torch's F.linear, and the residual add, run instead (`reference.linear`).
The launch has no host sync (graph-capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radianced.kernels import reference

SKINNY_MAX_ROWS = 16  # rows up to which the kernel runs: one 16-row tile (tl.dot's smallest M)
MIN_PROGRAMS = 128  # about one per SM of an H200 (132)
ROW_BYTES_PER_STEP = 512  # bytes of each weight row a program loads per K step

# -- heuristics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearConfig:
    block_n: int  # outputs (weight rows) per program
    block_k: int  # reduction step ("gemv": ignored, a program holds whole rows)
    num_warps: int
    num_stages: int
    kind: str = "dot"  # "dot": tensor-core tiles over a K loop; "gemv": whole rows in registers


GEMV_MAX_K = 8192  # "gemv" holds block_n whole weight rows in registers: K up to this


def linear_config(n: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """Tiles for an [N, K] weight of `dtype`. The row count does not enter: every T up to
    SKINNY_MAX_ROWS is one 16-row tile, and the weight stream is the same for all of them."""
    block_n = 32 if triton.cdiv(n, 32) >= MIN_PROGRAMS else 16
    block_k = min(ROW_BYTES_PER_STEP // dtype.itemsize, max(16, triton.next_power_of_2(k)))
    num_stages = 4 if triton.cdiv(n, block_n) >= MIN_PROGRAMS else 6
    return LinearConfig(block_n, block_k, num_warps=4, num_stages=num_stages)


# -- kernel ----------------------------------------------------------------------------------------


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, num_rows, n, k,
                   stride_x, stride_w, stride_b, stride_r, stride_o,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
    y = acc.to(out_ptr.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:  # torch's `residual + y`: y rounded first, the sum rounded again
        r = tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * stride_o + cols[None, :], y, mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, num_rows, n, k,
                 stride_x, stride_w, stride_b, stride_r, stride_o,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """CUDA-core products: a program loads its BLOCK_N whole weight rows at once (every load in
    flight together, no loop), then for each of the T rows of x multiplies and sums over K in fp32."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < k
    w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)
    for t in range(num_rows):
        x = tl.load(x_ptr + t * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            acc += bias
        y = acc.to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + t * stride_r + cols, mask=col_ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * stride_o + cols, y, mask=col_ok)


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
           residual: torch.Tensor | None = None, *, cfg: LinearConfig | None = None) -> torch.Tensor:
    """`residual + (x @ weight^T + bias)` (Triton for T <= SKINNY_MAX_ROWS, else torch);
    contract of `reference.linear`.

    x: [T, K] (last dim contiguous); weight: [N, K] (rows contiguous); bias: [N] or
    None; residual: [T, N] (last dim contiguous) or None; one dtype for all.
    Returns a new [T, N] in x's dtype. `cfg` overrides `linear_config` (benchmarks).
    """
    _check(x, weight, bias, residual)
    t, k = x.shape
    if t > SKINNY_MAX_ROWS:
        return reference.linear(x, weight, bias, residual)
    n = weight.shape[0]
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    cfg = cfg or linear_config(n, k, x.dtype)
    if cfg.kind == "gemv" and k <= GEMV_MAX_K:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, weight, x if bias is None else bias, x if residual is None else residual, out, t, n, k,
            x.stride(0), weight.stride(0), 0 if bias is None else bias.stride(0),
            0 if residual is None else residual.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_N=cfg.block_n,
            BLOCK_K=triton.next_power_of_2(k), num_warps=cfg.num_warps, num_stages=1,
        )
        return out
    _linear_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, x if bias is None else bias, x if residual is None else residual, out, t, n, k,
        x.stride(0), weight.stride(0), 0 if bias is None else bias.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=SKINNY_MAX_ROWS,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


__all__ = ["SKINNY_MAX_ROWS", "LinearConfig", "linear", "linear_config"]
