"""The router after its matmul in one launch: softmax, top-k and renormalization per token.

One program per token row loads its E logits (E <= 1024), takes the softmax in
fp32 and picks the k largest by repeated arg-max (ties go to the lower expert
id), in descending order. With `renormalize` the k weights are divided by their
own sum (the softmax denominator cancels), else by the softmax's. At decode this
replaces torch's six launches (softmax, top-k, its sort, sum, divide, cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radianced.kernels import pdl

MAX_EXPERTS = 1024  # one program holds a token's logits in registers


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, num_experts, stride_t,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    p = tl.exp(x - m)  # padding lanes: exp(-inf) = 0
    j = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    top = tl.zeros([BLOCK_K], tl.float32)
    left = x
    for i in tl.static_range(TOP_K):
        best = tl.argmax(left, 0, tie_break_left=True)
        ids = tl.where(j == i, best, ids)
        top = tl.where(j == i, tl.sum(tl.where(e == best, p, 0.0), 0), top)
        left = tl.where(e == best, float("-inf"), left)
    if RENORMALIZE:
        w = top / tl.sum(top, 0)
    else:
        w = top / tl.sum(p, 0)
    ok = j < TOP_K
    tl.store(ids_ptr + t * TOP_K + j, ids.to(tl.int64), mask=ok)
    tl.store(weights_ptr + t * TOP_K + j, w.to(weights_ptr.dtype.element_ty), mask=ok)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax, top-k and renormalization of router logits (Triton); contract of `reference.route`.

    logits: [T, E] (any float dtype, rows with a unit last stride), E <= MAX_EXPERTS,
    1 <= top_k <= E. Returns (ids [T, k] int64, weights [T, k] in `dtype`).
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, E] with contiguous rows, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    t, e = logits.shape
    if not 1 <= top_k <= e or e > MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} must be in [1, E={e}] and E at most {MAX_EXPERTS}")
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=dtype, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, weights, e, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
                            RENORMALIZE=renormalize, num_warps=4 if e <= 256 else 8, **pdl.launch(logits.device, t))
    return ids, weights


__all__ = ["MAX_EXPERTS", "route"]
