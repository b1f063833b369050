"""The router after its matmul: softmax, top-k and renormalization of the logits, per token row.

One order for every kernel here: experts by logit, descending, ties to the lower
expert id, a NaN logit counted as -inf (never ahead of a number; the reference's
softmax is all NaN then) and -0 as +0; `_order_keys` turns a row into int32 keys
in that order. The k picked experts are ranks 0 .. k-1, in rank order. Weights:
p = exp(x - max x) in fp32, each picked p divided by the sum of the k picked
(`renormalize`: the softmax denominator cancels) or by the sum of all p. Both
sums are taken in 2^-52 fixed point (`_sum_p`), so they are the same bits in
whatever order a reduction adds them.

Two kernels pick by that order:

- `route`: one program per token row (E <= 1024 logits in registers), k rounds
  of arg-max. At decode it replaces torch's six launches (softmax, top-k, its
  sort, sum, divide, cast).
- `expert_of_rank`, called by the MoE's gate/up programs at T == 1
  (kernels/moe.py `route_moe`, no launch of its own): every expert's rank at
  once, rank(e) = #{e' : key[e'] > key[e] or (key[e'] == key[e] and e' < e)},
  E^2 comparisons, [E, C] at a time (C = ROUTE_CHUNK / E, at most E) with one
  reduction each, instead of a chain of k dependent arg-max rounds. The keys
  and ids make a strict order, so the ranks are a permutation of 0 .. E-1: the
  expert of any rank < k exists and is one, in range whatever the logits. Its
  id and weight are `route`'s, bit for bit (the same keys, the exact p of the
  pick, the same sums, one fp32 division).

`route` keeps its arg-max rounds: at prefill it runs one program per token, and
E^2 per token would cost more than k rounds over E (E = 512: about 0.2 ms a
layer at T = 4096 on the H200, an estimate from instruction counts, not
measured).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radianced.kernels import pdl

MAX_EXPERTS = 1024  # one program holds a token's logits in registers
# [experts, chunk] comparisons `expert_of_rank` holds at once (32 a thread at 4 warps).
ROUTE_CHUNK = 4096

_PICKED = tl.constexpr(-2 ** 31)  # `route`'s key of a picked expert: below every logit's, -inf's too
_FIXED = tl.constexpr(2.0 ** 52)  # p in [0, 1] as an integer count of 2^-52 (E <= 1024 of them fit in int64)


@triton.jit
def _logits_row(row_ptr, num_experts, BLOCK_E: tl.constexpr):
    """(expert ids [BLOCK_E], fp32 logits): NaN as -inf, -inf past the E experts."""
    e = tl.arange(0, BLOCK_E)
    x = tl.load(row_ptr + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    return e, tl.where(x == x, x, float("-inf"))


@triton.jit
def _order_keys(x):
    """int32 keys in the order of the (NaN-free) fp32 x, -0 and +0 alike: the sign-magnitude bits
    of a negative x flipped so that a larger magnitude is a smaller key."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _numerators(x):
    """The softmax's p = exp(x - max x) (0 on -inf lanes)."""
    return tl.exp(x - tl.max(x, 0))


@triton.jit
def _sum_p(p, chosen, RENORMALIZE: tl.constexpr):
    """The weights' denominator: the sum of the chosen p (RENORMALIZE) or of all p, each truncated
    to 2^-52 and added as integers (exact: the same bits in any order), rounded once to fp32."""
    if RENORMALIZE:
        p = tl.where(chosen, p, 0.0)
    return tl.sum((p * _FIXED).to(tl.int64), 0).to(tl.float32) / _FIXED


@triton.jit
def expert_of_rank(logits_ptr, ids_ptr, weights_ptr, rank, num_experts, top_k, store,
                   RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    """The expert `route` puts at `rank` (< top_k) of one row of logits (E, unit stride), an int32
    scalar. Where `store` (a scalar bool), also stores it to ids_ptr[rank] (int64) and its weight to
    weights_ptr[rank] (in that tensor's dtype): `route`'s values, bit for bit. BLOCK_E:
    next_pow2(E); BLOCK_C: the experts compared at once against all of them (a power of two)."""
    e, x = _logits_row(logits_ptr, num_experts, BLOCK_E)
    key = _order_keys(x)
    ranks = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_experts, BLOCK_C):
        c, xc = _logits_row(logits_ptr + c0, num_experts - c0, BLOCK_C)
        kc = _order_keys(xc)  # [BLOCK_C]; -inf past E: never ahead of an expert (a higher id)
        ahead = (kc[None, :] > key[:, None]) | ((kc[None, :] == key[:, None]) & (c0 + c[None, :] < e[:, None]))
        ranks += tl.sum(ahead.to(tl.int32), 1)
    mine = ranks == rank  # exactly one expert: the ranks of the E are a permutation of 0 .. E-1
    expert = tl.sum(tl.where(mine, e, 0), 0)
    if store:
        p = _numerators(x)
        weight = tl.sum(tl.where(mine, p, 0.0), 0) / _sum_p(p, ranks < top_k, RENORMALIZE)
        tl.store(ids_ptr + rank, expert.to(tl.int64))
        tl.store(weights_ptr + rank, weight.to(weights_ptr.dtype.element_ty))
    return expert


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, num_experts, stride_t,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    e, x = _logits_row(logits_ptr + t * stride_t, num_experts, BLOCK_E)
    p = _numerators(x)
    key = _order_keys(x)
    j = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    top = tl.zeros([BLOCK_K], tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(key, 0, tie_break_left=True)
        picked = e == best
        ids = tl.where(j == i, best, ids)
        top = tl.where(j == i, tl.sum(tl.where(picked, p, 0.0), 0), top)  # one term: its exact p
        key = tl.where(picked, _PICKED, key)
    w = top / _sum_p(p, key == _PICKED, RENORMALIZE)
    ok = j < TOP_K
    tl.store(ids_ptr + t * TOP_K + j, ids.to(tl.int64), mask=ok)
    tl.store(weights_ptr + t * TOP_K + j, w.to(weights_ptr.dtype.element_ty), mask=ok)


def check_logits(logits: torch.Tensor, top_k: int) -> None:
    """Raise ValueError unless `logits` ([T, E], unit last stride, E <= MAX_EXPERTS) can be routed
    to 1 <= top_k <= E experts."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, E] with contiguous rows, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    e = logits.shape[1]
    if not 1 <= top_k <= e or e > MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} must be in [1, E={e}] and E at most {MAX_EXPERTS}")


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax, top-k and renormalization of router logits (Triton); contract of `reference.route`.

    logits: [T, E] (any float dtype, rows with a unit last stride), E <= MAX_EXPERTS,
    1 <= top_k <= E. Returns (ids [T, k] int64, weights [T, k] in `dtype`). The order
    and its ties: the module docstring.
    """
    check_logits(logits, top_k)
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=dtype, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, weights, e, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
                            RENORMALIZE=renormalize, num_warps=4 if e <= 256 else 8, **pdl.launch(logits.device, t))
    return ids, weights


__all__ = ["MAX_EXPERTS", "ROUTE_CHUNK", "check_logits", "expert_of_rank", "route"]
