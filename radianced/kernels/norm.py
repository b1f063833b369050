"""RMSNorm on CUDA: plain, zero-centred (Qwen3-Next) and gated (the DeltaNet output norm).

One kernel serves all three. A program normalizes BLOCK_R rows of D elements
(D padded to a power of two, rows sized so a program holds about 8K elements):
the mean square in fp32, then the weight, with the reference's rounding steps
kept, so bf16 results match `reference.rms_norm` / `reference.gated_rms_norm`
up to fp32 summation order:

- plain: `weight * round_x(x * rstd)` rounded to the output dtype (torch's
  promotion of x's and weight's dtypes, as `weight * x` gives);
- zero-centred: `x * rstd * (1 + weight)` in fp32, rounded once to x's dtype;
- gated: the plain result (rounded to the promoted dtype) times `silu(gate)`
  in fp32, rounded to x's dtype.

Rows may be strided (the qk-norm's heads are views of a projection), only the
last dim must be contiguous. The launch has no host sync (graph-capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radianced.kernels import pdl

MAX_ELEMS_PER_PROGRAM = 8192  # rows * padded D held by one program

# -- heuristics ------------------------------------------------------------------------------------


def _tiles(rows: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for `rows` rows of `d` elements."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(triton.next_power_of_2(max(rows, 1)), MAX_ELEMS_PER_PROGRAM // block_d))
    num_warps = 4 if block_r * block_d <= 4096 else 8
    return block_r, block_d, num_warps


# -- kernel ----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, w_ptr, gate_ptr, out_ptr, n_rows, eps,
                     stride_x, stride_g, stride_o,
                     D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     ZERO_CENTRED: tl.constexpr, GATED: tl.constexpr, ROUND_MID: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    xn = x * rstd[:, None]
    if ZERO_CENTRED:
        y = xn * (1.0 + w[None, :])
    else:
        y = xn.to(x_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    if GATED:
        if ROUND_MID:  # weight * x was computed in x's dtype: round before the gate
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        z = tl.load(gate_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
    tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# -- launcher --------------------------------------------------------------------------------------


def _rows(name: str, t: torch.Tensor, d: int) -> torch.Tensor:
    """t as [rows, d] with a contiguous last dim (a view when the strides allow, else a copy)."""
    if t.shape[-1] != d:
        raise ValueError(f"{name} has last dim {t.shape[-1]}, the weight has {d}")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, d)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, zero_centred: bool,
            gate: torch.Tensor | None) -> torch.Tensor:
    if weight.dim() != 1:
        raise ValueError(f"weight must be [D], got shape {tuple(weight.shape)}")
    if weight.device != x.device or (gate is not None and gate.device != x.device):
        raise ValueError(f"x, weight{', gate' if gate is not None else ''} must share a device "
                         f"(x on {x.device}, weight on {weight.device})")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
    d = weight.shape[0]
    x2 = _rows("x", x, d)
    g2 = x2 if gate is None else _rows("gate", gate, d)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n = x2.shape[0]
    if n == 0:
        return out
    block_r, block_d, warps = _tiles(n, d)
    round_mid = torch.promote_types(x.dtype, weight.dtype) == x.dtype
    grid = (triton.cdiv(n, block_r),)
    _rms_norm_kernel[grid](
        x2, weight.contiguous(), g2, out, n, eps, x2.stride(0), g2.stride(0), d,
        D=d, BLOCK_R=block_r, BLOCK_D=block_d, ZERO_CENTRED=zero_centred, GATED=gate is not None,
        ROUND_MID=round_mid, num_warps=warps, **pdl.launch(x.device, grid[0]))
    return out


# -- public ops ------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim (Triton). x: [..., D] (last dim contiguous), weight: [D].

    Same contract as `reference.rms_norm`: plain returns torch's promotion of
    x's and weight's dtypes, zero-centred (`x * (1 + weight)`) returns x's dtype.
    Returns a new tensor of x's shape.
    """
    out_dtype = x.dtype if zero_centred else torch.promote_types(x.dtype, weight.dtype)
    return _launch(x, weight, eps, out_dtype, zero_centred, None)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * norm(x) * silu(gate)` over the last dim (Triton); Qwen3-Next's DeltaNet output norm.

    x, gate: [..., D] of one shape (each last dim contiguous; other strides free);
    weight: [D]. Same contract as `reference.gated_rms_norm`; returns x's dtype.
    """
    return _launch(x, weight, eps, x.dtype, False, gate)


__all__ = ["gated_rms_norm", "rms_norm"]
