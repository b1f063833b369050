"""cuBLAS GEMMs at a bounded set of row counts, each met before the daemon is ready.

Above 16 rows (and for wide outputs above one) a dense projection is torch's F.linear
(cuBLAS; kernels/linear.py says where). On the H200 (torch 2.11, CUDA 13), the first
call at a row count cuBLAS has not seen took 3-5 ms more than the next at Qwen3-30B-A3B's
q/k/v, o_proj and router shapes, with CUDA_MODULE_LOADING=EAGER as well as lazily: the
library's per-problem selection, not module loading (tools/first_call_probe.py,
bench/results/2026-12-02-h200-*-first-call.json). Over HTTP that made the first prompt of
each length about 7 ms slower than a second one of the same length (issue 18: first/twin
TTFT p99 3.47).

So on CUDA, x's rows are padded up to `padded_rows(T)`: 16 below 16 rows, and above, one of
8 steps an octave (at most 12.5% more rows, 6% on average, at prefill lengths where the
step's expert and attention work dominate). Rows are independent in a GEMM, so the first T
rows of the result are the unpadded product's (up to cuBLAS's choice of kernel, which
rounds as the shape picks it). `linear` notes each (weight shape, dtype, bias) it meets and
its most rows; `warm_up` calls every bucket up to that for each, once the start-up's steps
(engine/warmup.py) have met them all. Measured through it after `warm_up`: a new row count's
first call +0.01 ms at p50 (0.6-0.7 ms max), and over HTTP first/twin TTFT p50 1.29 -> 1.006.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

ROW_STEPS = 8  # row buckets an octave
MIN_ROWS = 16

_met: dict[tuple, tuple[int, weakref.ref, weakref.ref | None]] = {}  # (N, K, dtype, bias?, device) ->
# (the most rows met, the weight and bias met there: warm-up multiplies the model's own, not copies)


def padded_rows(t: int) -> int:
    """The row count cuBLAS is called with for `t` rows on CUDA (t >= 1)."""
    if t <= MIN_ROWS:
        return MIN_ROWS
    step = 1 << max(0, t.bit_length() - ROW_STEPS.bit_length())  # t in [2^j, 2^(j+1)): 2^j / ROW_STEPS
    return -(-t // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) (x: [T, K]), on CUDA with x's rows padded to `padded_rows(T)`; [T, N]."""
    t = x.shape[0]
    if not x.is_cuda or t == 0:
        return F.linear(x, weight, bias)
    rows = padded_rows(t)
    key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None, x.device)
    if rows > _met.get(key, (0,))[0]:
        _met[key] = (rows, weakref.ref(weight), None if bias is None else weakref.ref(bias))
    if rows == t:
        return F.linear(x, weight, bias)
    padded = x.new_empty((rows, x.shape[1]))
    padded[:t] = x
    return F.linear(padded, weight, bias)[:t]


def buckets(limit: int) -> list[int]:
    """Every `padded_rows` value up to `padded_rows(limit)`."""
    out, t = [], 1
    while t <= limit:
        out.append(padded_rows(t))
        t = out[-1] + 1
    return out


def warm_up() -> int:
    """Call cuBLAS once at every bucket up to the most rows met, for every shape `linear` has met (with the
    weights met there; a shape whose weights are gone is forgotten); the number of calls."""
    calls = 0
    for key, (most, weight_ref, bias_ref) in list(_met.items()):
        weight, bias = weight_ref(), None if bias_ref is None else bias_ref()
        if weight is None or (bias_ref is not None and bias is None):
            del _met[key]
            continue
        for rows in buckets(most):
            F.linear(torch.zeros((rows, weight.shape[1]), dtype=weight.dtype, device=weight.device), weight, bias)
            calls += 1
    if calls:
        torch.cuda.synchronize()
    return calls
