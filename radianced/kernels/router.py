"""The MoE router: softmax, top-k and renormalization per token, and at batch-1 decode the whole
router (RMSNorm, matmul, route) in one launch.

`route` takes the logits: one program per token row loads its E logits
(E <= 1024), takes the softmax in fp32 and picks the k largest by repeated
arg-max (ties go to the lower expert id), in descending order. With
`renormalize` the k weights are divided by their own sum (the softmax
denominator cancels), else by the softmax's. At decode this replaces torch's six
launches (softmax, top-k, its sort, sum, divide, cast).

`router` is the layer's op: `linear.linear(x, W, norm=..., keep_normed=True)`
then `route`. Where that linear runs kernels/linear.py's "gemv" kernel (T = 1,
`linear_config`) it is one launch, `_router_kernel`: the gemv (called as a
device function; BLOCK_N weight rows a program, each program normalizing x,
program 0 keeping the normed row for the experts) stores its logits rounded to
x's dtype, counts itself in (kernels/arrival.py), and the last program to
arrive reads the E logits back from L2 and routes them with `route`'s own code
(`_route_row`): the two launches' ids, weights and normed row bit for bit,
without the second launch (on an H200 about 3.7 us of kernel and a 1 us gap a
MoE layer). Other T run the two launches. No host sync: graph-capturable once
the first launch (which allocates the arrival counters) has run eagerly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radianced.kernels import arrival, linear, pdl
from radianced.kernels.reference import Norm

MAX_EXPERTS = 1024  # one program holds a token's logits in registers


@triton.jit
def _route_row(logits_ptr, ids_ptr, weights_ptr, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, CACHE: tl.constexpr):
    """One token: the softmax of its E logits at logits_ptr (any float dtype) in fp32, the TOP_K
    largest by repeated arg-max (ties to the lower id), renormalized or not; stores TOP_K int64 ids
    at ids_ptr and their weights at weights_ptr (its dtype). CACHE: the logits' load cache modifier
    ("" or ".cg" for logits other programs of the launch stored)."""
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + e, mask=e < num_experts, other=float("-inf"), cache_modifier=CACHE).to(tl.float32)
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
    tl.store(ids_ptr + j, ids.to(tl.int64), mask=ok)
    tl.store(weights_ptr + j, w.to(weights_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, num_experts, stride_t,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr):
    """Program t routes token t: logits [T, E] (row stride stride_t) -> ids, weights [T, TOP_K]."""
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    _route_row(logits_ptr + t * stride_t, ids_ptr + t * TOP_K, weights_ptr + t * TOP_K, num_experts,
               TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE, "")


@triton.jit
def _router_kernel(x_ptr, w_ptr, logits_ptr, norm_w_ptr, normed_ptr, counter_ptr, ids_ptr, weights_ptr,
                   num_experts, k, eps, stride_w, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """One token's router: x [1, K] against the weight [E, K] by kernels/linear.py's gemv (BLOCK_N
    rows a program; NORM: the RMSNorm first, program 0 storing the normed row at normed_ptr) into
    logits [1, E] in x's dtype; the last program to arrive at counter_ptr routes them into ids,
    weights [1, TOP_K]."""
    linear._gemv_kernel(x_ptr, w_ptr, x_ptr, x_ptr, logits_ptr, norm_w_ptr, normed_ptr, 1, num_experts, k, eps,
                        0, stride_w, 0, 0, 0, 0, HAS_BIAS=False, HAS_RESIDUAL=False, NORM=NORM,
                        ZERO_CENTRED=ZERO_CENTRED, KEEP_NORMED=NORM, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_HIDDEN, PDL=PDL)
    if arrival.last_arrival(counter_ptr, tl.num_programs(0)):
        _route_row(logits_ptr, ids_ptr, weights_ptr, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE, ".cg")


# -- launchers -------------------------------------------------------------------------------------


def _route_args(experts: int, top_k: int, renormalize: bool) -> dict:
    """`_route_row`'s constexprs for E experts, refusing what one program cannot route."""
    if not 1 <= top_k <= experts or experts > MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} must be in [1, E={experts}] and E at most {MAX_EXPERTS}")
    return {"TOP_K": top_k, "BLOCK_E": triton.next_power_of_2(experts), "BLOCK_K": triton.next_power_of_2(top_k),
            "RENORMALIZE": renormalize}


def _outputs(t: int, top_k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (ids [T, k] int64, weights [T, k] in `dtype`)."""
    return (torch.empty((t, top_k), dtype=torch.int64, device=device),
            torch.empty((t, top_k), dtype=dtype, device=device))


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax, top-k and renormalization of router logits (Triton); contract of `reference.route`.

    logits: [T, E] (any float dtype, rows with a unit last stride), E <= MAX_EXPERTS,
    1 <= top_k <= E. Returns (ids [T, k] int64, weights [T, k] in `dtype`).
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, E] with contiguous rows, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    t, e = logits.shape
    meta = _route_args(e, top_k, renormalize)
    ids, weights = _outputs(t, top_k, dtype, logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, weights, e, logits.stride(0), **meta, num_warps=4 if e <= 256 else 8,
                            **pdl.launch(logits.device))
    return ids, weights


def router(x: torch.Tensor, weight: torch.Tensor, norm: Norm | None, top_k: int, renormalize: bool,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router of `norm(x)` (Triton); contract of `reference.router`: one launch where the
    linear is the gemv kernel (T = 1), else `linear.linear` then `route`.

    x: [T, K] (last dim contiguous); weight: [E, K] (rows contiguous), E <= MAX_EXPERTS;
    norm: (weight [K], eps, zero_centred) or None; all in x's dtype; 1 <= top_k <= E.
    Returns (ids [T, k] int64, weights [T, k] in `dtype`, the normed x [T, K], or x without a norm).
    """
    linear._check(x, weight, None, None, norm)
    meta = _route_args(weight.shape[0], top_k, renormalize)
    cfg = linear.linear_config(x.shape[0], weight.shape[0], x.shape[1], x.dtype)
    if cfg is None or cfg.kind != "gemv":
        logits, x = linear.linear(x, weight, norm=norm, keep_normed=True)
        return *route(logits, top_k, renormalize, dtype), x
    return _one_launch(x, weight, norm, dtype, cfg, meta)


def _one_launch(x: torch.Tensor, weight: torch.Tensor, norm: Norm | None, dtype: torch.dtype,
                cfg: linear.LinearConfig, meta: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_router_kernel` for x: [1, K] and weight: [E, K] with the gemv's `cfg` and `_route_args`'
    `meta`: (ids [1, k] int64, weights [1, k] in `dtype`, the normed x [1, K], or x without a norm)."""
    e, k = weight.shape
    logits = torch.empty((1, e), dtype=x.dtype, device=x.device)
    normed = x if norm is None else torch.empty_like(x)
    ids, weights = _outputs(1, meta["TOP_K"], dtype, x.device)
    _router_kernel[(triton.cdiv(e, cfg.block_n),)](
        x, weight, logits, x if norm is None else norm[0], normed, arrival.counters(x.device, 1), ids, weights,
        e, k, 0.0 if norm is None else norm[1], weight.stride(0), NORM=norm is not None,
        ZERO_CENTRED=norm is not None and norm[2], BLOCK_N=cfg.block_n, BLOCK_HIDDEN=triton.next_power_of_2(k),
        **meta, num_warps=cfg.num_warps, num_stages=1, **pdl.launch(x.device),
    )
    return ids, weights, normed


__all__ = ["MAX_EXPERTS", "route", "router"]
