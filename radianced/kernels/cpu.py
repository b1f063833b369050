"""The host backend's ops: fp32 torch, batched over the step, no per-sequence Python loop.

`ops.select("cpu")` binds these; the reference ops (kernels/reference.py) stay the oracle
each one is tested against (tests/kernels/test_cpu_*.py) and stay selectable with
`ops.select("cpu", reference=True)`. Every op here has the contract of the reference op
of the same name; ops the profile gave no reason to rewrite are not in this file and stay
the reference (ops.py says which).

Where the time went (torch.profiler, SmolLM2-135M fp32, 1 torch thread, this 2-core
machine shared with other jobs, 32 decode steps at b1 after a 40-token prompt): 82 ms a
step, of which `aten::mm` 54 ms (the 538 MB of weights a token reads: 10 GB/s, the
one-thread read bandwidth) and the rest about 330 small ops a step, most of them in the
attention layer: the reference gathers each sequence's blocks, repeats the KV heads,
builds its mask and runs two einsums per sequence in a Python loop (`aten::copy_` 6.5 ms,
`aten::index` 1.9 ms a step). A 512-token prefill took 1.42 s. So the weights' bytes set
b1 and only more threads (or fewer bytes: the compact-weights issue) move it; what this
file removes is the per-op overhead around the matmuls, which grows with the batch.

After (same script, 1 thread, load average under 1): b1 65 ms a step against 78 ms on the
reference ops (`aten::mm` 48 ms of it, 73%); b8 195 ms a step (41.0 tok/s) against 245 ms
(32.6 tok/s); a 512-token prefill 1.35 s against 1.63 s. What is left beside the matmuls is
torch's per-op cost (about 1,800 ops a step, 30 layers). At b8 fp32 `mm` is 70% of the step
and MKL runs [8, 576] x [576, 1536] at about 31 GFLOP/s a core; bf16 weights on this CPU's
AMX ran it 2.3x faster, but bf16 is not token-exact against transformers fp32, so it waits
for the compact-weights issue's quality table.

Session 12, the compact SmolLM2 (Q4_1 layers on the int4 kernel, fp32 lm_head) on this repository's
2-core AMD EPYC (AVX2, no AVX-512: the int4 kernel is compute-bound here, 3-5 GB/s at M = 1), 1 torch
thread, other jobs sharing the cores (tools/cpu_step.py, medians of 30 steps, three interleaved rounds):
b1 80-87 ms a step before, of which int4 matmuls 21 ms, the lm_head 13-18 ms (MKL's gemv, 113 MB) and
the attention op 23 ms (690 us a layer: RoPE angles, slot and block index arithmetic, two gathers,
mask, masked_fill, SDPA, remade in all 30 layers); after, 65-72 ms, the attention op 10-12 ms. What
changed: a step's index work is made once for all its layers (`_per_step`), K and V are written and
read in one op each over the cache's rows (`_Rows`), q and k rotate together, and decode over equal
contexts runs SDPA unmasked; the MLP's gate and up share one packing (one int4 call: at 2 threads a
1536-row call uses the second core poorly, 135 us against 162 us for both in one 3072-row call; at
M = 8, 2 x 532 against 469 us); the lm_head runs on oneDNN (`WIDE`). Left in a b1 step: the int4
calls (about 20 ms at 1 thread), the lm_head (12 ms at 1 thread, 6.6 ms at 2), and ~15 ms of torch's
per-op cost (about 1,000 ops; F.rms_norm alone is 28 us a call on this CPU, 61 calls a step).

Session 13 (round 2, same machine, tools/cpu_step.py and a plain step timer, main and this tree
interleaved, medians of 30 steps): a b1 step issued 2,380 top-level torch ops (79 a layer), now 1,695
(56), b8 the same. At [1, 576] a small op costs 2-4 us and a Python scalar argument 4 us more (it is
wrapped in a tensor per call), `.to(dtype)` 3-4 us more than `.float()` / `.bfloat16()`, a slice 4 us, a
`Tensor.split` 6-10 us through its Python wrapper, and `_per_step`'s generator key 11 us a call. What
went: F.rms_norm (27 us) for seven small ops with 0-dim constants (19 us, the same bits); the cache
pair's rows made once a layer and based at K's first row (no index add per layer); K and V taken as
[B, Hkv, C, D] by one unbind; decode's q and output without transposes; RoPE's swap as one `roll`;
no-op casts; the int4 call's parts as one split. Medians of three rounds (load average 1.2-2): b1
1 thread 77.6 -> 67.6 ms, 2 threads 62.5 -> 50.9 ms; b8 1 thread 190.0 -> 168.4 ms, 2 threads
112.4 -> 111.1 ms. Left at b1, 1 thread, per layer: ~620 us of int4 calls and ~400 us of everything
else (~280 us of it inside torch ops, SDPA 30-40 us the largest). Two threads beat one on this
machine only while its other core is free: with another job on it each OpenMP region waits for a
time slice, and a b1 step took 200-300 ms against 60-70 ms on one thread.

Session 14: compact weights go through radianced's own block kernels (`cpu_blocks.py`: fp32, gguf's
weight values, the file's bytes read in place) instead of the int4 kernel in bf16, and the tied Q8_0
lm_head with them instead of a dense fp32 copy (113 MB a token -> 30 MB). SmolLM2 Q4_1, 1 thread,
tools/cpu_step.py, two interleaved rounds against the int4 tree: b1 39.4 -> 31.7 ms a step, b8 85.2 ->
66.3 ms. Left in a b1 step (1 thread): the MLP's three block calls 13.7 ms, the attention projections
~6.8 ms, the lm_head 3.6 ms (the kernels are compute-bound on dequantizing: 6.5-8.6 G weights/s a
core), the attention op 5.3 ms and ~2 ms of the rest; at b8 the attention op grows to 13.4 ms (a
masked SDPA over 8 contexts and its gathers, 445 us a layer).

Issue 23 (SmolLM2 Q4_1 on the two-row block kernels, 2 threads, GOMP_SPINCOUNT=20000): each weight keeps a
`cpu_blocks.Matrix` (`_blocks`: a block call's Python 15.4 -> 7.0 us) and a decode step over a plain cache
runs `_decode` on one `_DecodeStep` a step (one per-step lookup a layer instead of four, SDPA's additive mask
made once a step instead of per layer from a bool one, each cache pair's `_Rows` kept: `_rows_of`); the
values are unchanged bit for bit. The attention op alone over a step's 30 captured layers, main against
this (in-process, alternating): b1 3.69 -> 3.21 ms, b8 over equal contexts 6.41 -> 5.79 ms, over unequal
ones 9.05 -> 7.98 ms. tools/cpu_step.py, two interleaved rounds: b1 18.6-18.8 -> 16.4-16.5 ms a step, b8
34.5-35.0 -> 31.4-32.6 ms. Left at decode: SDPA (~15 us a layer at b1, ~50 at b8), the context's gather
(one index_select, ~5-20 us), the rotation's roll (~5-10 us) and ~10 small ops.

Issue 23, attention in place (same model and settings): a decode step over a plain fp32 cache reads K and V where
they lie through the C kernel of `cpu_attention.Context` (the step's block-table rows made once in `_DecodeStep`)
instead of gathering every context a layer for a padded, masked SDPA; without a C compiler the torch path is as
before. SmolLM2's heads (9 q, 3 KV, D 64), 2 threads, us a layer, kernel / gather + SDPA: b1 over 60 keys 12.7-13.2
/ 40.4-40.5, b8 over 60 each 34.0-34.7 / 97.0-98.1, over 45-70 32.5-40.2 / 112-123, over 400 each 169-254 / 441-795
(a loaded minute). tools/cpu_step.py, main and this tree interleaved, three rounds (contexts 43-73): b1 16.9-18.1
-> 15.2-15.9 ms a step (the attention op 3.8-4.1 -> 2.7-2.9 ms), b8 32.2-32.6 -> 29.7-33.5 ms (the op 6.7-6.8 ->
4.9-5.6; the step's spread is the matmuls'); `--steps 125` (contexts 43-168, as served), two rounds: b8 34.7-35.5
-> 33.0-33.8 ms (the op 8.5-8.7 -> 6.6-7.1). Left in the op at b8, ~175 us a layer: the K/V write's index_copy_
(18 us a call in the profiler), the rotation (roll, cat, mul, add: ~25 us), the kernel (~30 us), and the
rest the op's Python and its other small ops.

Issue 23, the rotation and K/V write in the C call (same model and settings): `Context.rotary` rotates q and k
(`_rotate`'s products and sums, bit for bit), writes k and v to the new token's rows and attends, one C call a
layer instead of roll/cat/mul/add, cat and index_copy_ before it. tools/cpu_step.py, main and this tree
interleaved, four rounds (the first two with main's steps slowed by another job: b8 44.2-47.1 ms): b8 29.6-30.0
-> 27.9-28.1 ms a step in the quiet two (the attention op 4.9 -> 3.5-3.6 ms, 6.9-7.2 -> 3.6-4.1 in the loaded
ones), b1 15.6 -> 13.8-14.1 ms (the op 2.8-2.9 -> 1.75-1.8; loaded, 16.6-24.3 -> 14.4-14.7). Left in the op at
b8, ~120 us a layer (3.5-3.6 ms over 30 layers), not yet broken down between the C call and the op's Python.

Session 28, on a 2-core Zen 4 EPYC (AVX-512, no AMX): the block products got AVX-512 tiles (cpu_blocks.c: b8 step
25.2 -> 20.9 ms); an MLP's gate and up run as one fused call with the silu in registers (`silu_mlp`,
`cpu_blocks.SwiGLU`: 344 -> 295 us a layer at M = 8); and a Llama layer of a decode step runs as one C call
(`dense_layer`, cpu_layer.py), because 3.4 ms of a 10.7 ms b1 step and 6 of 24 at b8 were outside the C kernels:
~25 calls a layer of dispatch, allocation and ctypes. tools/cpu_step.py, interleaved: b1 10.3-10.6 -> 8.2-8.7 ms,
b8 21.5-21.8 -> 18.8-19.0 ms.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from radianced.kernels import cpu_attention, cpu_blocks, cpu_layer, reference
from radianced.kernels.compact import CompactWeight, RowStack, dense
from radianced.kernels.kv_quant import KVPlane

# -- norms ------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """`reference.rms_norm` in fp32 in seven small ops. x: [..., D], weight: [D].

    In fp32 these are the reference's values bit for bit: `pow(2)` is `x * x` there, `mean` is `sum`
    then `div_` by D, and D and eps come as fp32 0-dim tensors (what a Python scalar becomes in the
    op, without its wrapping: 4 us an op here; `F.rms_norm` took 27 us a call at [1, 576], these
    19 us). Other dtypes round between the steps in the reference, so they take the reference."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return reference.rms_norm(x, weight, eps, zero_centred)
    d, e = _norm_constants(x.shape[-1], eps)
    r = torch.sum(x * x, -1, keepdim=True).div_(d).add_(e).rsqrt_()
    return (x * r).mul_(1.0 + weight if zero_centred else weight)


@functools.lru_cache(maxsize=64)
def _norm_constants(d: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, eps) as fp32 0-dim CPU tensors, made once (outside inference mode: usable in and out of it)."""
    with torch.inference_mode(False):
        return torch.tensor(float(d), dtype=torch.float32), torch.tensor(eps, dtype=torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: reference.Norm | None = None,
           keep_normed: bool = False, out_dtype: torch.dtype | None = None,
           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`reference.linear` (same arguments) with its norm fused (`rms_norm` above) and the residual
    added in place into the matmul's fresh result. The matmul is `_matmul`: the reference's values,
    summed in another order."""
    if norm is not None:
        x = rms_norm(x, *norm)
    y = _matmul(x, weight, bias)
    if residual is not None:
        y = y.add_(residual)  # residual + y: the same one rounding, no second [T, N] buffer
    if out_dtype is not None and y.dtype != out_dtype:
        y = y.to(out_dtype)
    return (y, x) if keep_normed else y


def silu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`reference.silu_mlp`, `down(silu(gate(x)) * up(x))`, with each matmul through `_matmul`; GGUF-format gate
    and up of one format through one fused call where the kernels have it (`cpu_blocks.SwiGLU`: silu within 2 units
    of fp32 rounding of torch's)."""
    pair = _swiglu(gate, up) if x.dtype == torch.float32 else None
    h = pair(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1) if pair is not None \
        else F.silu(_matmul(x, gate)).mul_(_matmul(x, up))
    return _matmul(h, down)


def moe(*args, **kwargs) -> torch.Tensor:
    """`reference.moe` (same arguments: one read per distinct routed expert over the pointer table) with
    each expert's MLP through `silu_mlp` here: a compact expert's blocks read in place."""
    return reference.moe(*args, **kwargs, mlp=silu_mlp)


def route_moe(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.route_moe` with `moe`'s experts."""
    return reference.route_moe(*args, **kwargs, mlp=silu_mlp)


def _matmul(x: torch.Tensor, weight: torch.Tensor | CompactWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in x's dtype, a fresh tensor: a GGUF-format weight through the
    block kernels (the weight's `cpu_blocks.Matrix`, kept by `_blocks`: fp32, the reference's weight values;
    2-4x fp32 F.linear at decode on this CPU), any other weight by F.linear, another compact one dequantized
    to x's dtype for the call as the reference does."""
    blocks = _blocks(weight) if isinstance(weight, CompactWeight) else None
    if blocks is not None:
        y = blocks(x.float())
        y = y if x.dtype == torch.float32 else y.to(x.dtype)
    elif isinstance(weight, RowStack) and any(isinstance(p, CompactWeight) for p in weight.parts):
        y = torch.cat([_matmul(x, p) for p in weight.parts], dim=-1)  # [q | k | v] of several formats
    else:
        weight = dense(weight, x.dtype)
        if weight.shape[0] >= WIDE and weight.dtype == x.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)
    return y if bias is None else y.add_(bias)


def _kept(table: dict, obj, make, *also):
    """`make()`, made once per live `obj` (by identity; and per the `also` objects it was made beside) and kept in
    `table`: a model hands the same weights and cache views to every step. An entry holds only weak references
    and goes when `obj` does, so an id is never matched to a later object."""
    entry = table.get(id(obj))
    if entry is not None and entry[0][0]() is obj and (not also or all(r() is o for r, o in zip(entry[0][1:], also))):
        return entry[1]  # (no generator on a weight's lookup: 151 of them a SmolLM2 decode step)
    key, value = id(obj), make()
    table[key] = ((weakref.ref(obj, lambda _, key=key: table.pop(key, None)), *map(weakref.ref, also)), value)
    return value


_MATRICES: dict = {}  # each GGUF-format weight's `cpu_blocks.Matrix` (its checks made once), by `_kept`


def _blocks(weight: CompactWeight) -> cpu_blocks.Matrix | None:
    """`weight`'s block-kernel matrix, or None where the kernels do not read its format (or are unavailable)."""
    if weight.fmt not in cpu_blocks.FORMATS or not cpu_blocks.available():
        return None
    return _kept(_MATRICES, weight,
                 lambda: cpu_blocks.Matrix(weight.data.reshape(weight.shape[0], -1), weight.fmt, weight.shape))


_SWIGLUS: dict = {}  # each (gate, up) pair's `cpu_blocks.SwiGLU` or None, by `_kept` on gate (and up beside it)


def _swiglu(gate, up) -> cpu_blocks.SwiGLU | None:
    """The fused product of an MLP's gate and up, or None where they are not both block-kernel matrices it takes."""
    if not isinstance(gate, CompactWeight) or not isinstance(up, CompactWeight):
        return None

    def make():
        g, u = _blocks(gate), _blocks(up)
        return None if g is None or u is None else cpu_blocks.SwiGLU.make(g, u)
    return _kept(_SWIGLUS, gate, make, up)


# An fp32 matrix this tall (an lm_head: SmolLM2's 49152 x 576) goes through oneDNN's matmul, not F.linear's
# MKL: on this 2-core AMD EPYC (AVX2) MKL's fp32 gemv reads it at one thread's speed whatever the threads
# (13.4 ms at M = 1 with 2 threads, 30 ms at M = 8) where oneDNN takes 6.6 ms and 14.7 ms. On the layers'
# shapes (N <= 1536) neither wins throughout, so they stay F.linear. Both sum in fp32, in other orders.
WIDE = 16384


# -- rotary -----------------------------------------------------------------


def rotary_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
              zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rotary_qk`: qk-norm (fused) when weights are given, then RoPE on q and k: in one
    rotation where they are neighbouring heads of one tensor (the fused q/k/v projection's output)."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps, zero_centred), rms_norm(k, k_weight, eps, zero_centred)
    return _rotate_qk(q, k, *_rope_tables(positions, inv_freq, q.dtype))


def _rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_qk`'s rotation by `_rope_tables`' cos and signed sin."""
    hq = q.shape[1]
    if k.dtype == q.dtype and k.stride() == q.stride() and k.shape[2] == q.shape[2] \
            and k.data_ptr() == q.data_ptr() + hq * q.stride(1) * q.element_size():
        qk = _rotate(q.as_strided((q.shape[0], hq + k.shape[1], q.shape[2]), q.stride()), cos, sin)
        return qk.split_with_sizes((hq, k.shape[1]), dim=1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x: [T, H, D] by `_rope_tables`' cos [T, 1, R] and signed sin [T, 1, R]
    (-sin | sin), the dims past R passing: x_rot cos + [x2 | x1] (-sin | sin) is the reference's
    x_rot cos + [-x2 | x1] sin value for value (negation is exact), in four ops ([x2 | x1] is a roll
    by R / 2 where R is the whole head)."""
    r = cos.shape[-1]
    half = r // 2
    if r == x.shape[-1]:
        out = x * cos
        return out.add_(torch.roll(x, half, -1).mul_(sin))
    out = x.clone()
    out[..., :r].mul_(cos).add_(torch.cat((x[..., half:r], x[..., :half]), dim=-1).mul_(sin))
    return out


# -- paged attention ----------------------------------------------------------
#
# A step's index work (RoPE angles, the KV slots' rows, the gather and mask of the context) is the
# same for all of its layers: each is made on the first layer's call and reused while the calls
# pass the same index tensors (the model passes one `ForwardBatch`'s to every layer; those are never
# written in place). `_per_step` keeps the last result of each, keyed on its arguments: tensors by
# identity (held, so an id is not reused while cached), the rest by value.


def _per_step(fn):
    last: list = [None]  # one (args, result) pair, read and replaced as one object (engines on other threads)

    def cached(*args):
        entry = last[0]
        if entry is not None and _same_args(entry[0], args):
            return entry[1]
        result = fn(*args)
        last[0] = (args, result)
        return result

    cached.__wrapped__ = fn
    return cached


def _same_args(held: tuple, args: tuple) -> bool:
    """Whether `args` are `held` as `_per_step` keys them (a loop, not a generator: 4 calls a layer)."""
    if len(held) != len(args):
        return False
    for a, b in zip(held, args):
        if a is not b and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b):
            return False
    return True


@_per_step
def _rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """(cos [T, 1, R], signed sin [T, 1, R]: -sin on the first half) in `dtype`, from the reference's angles."""
    cos, sin = reference.rotary_cos_sin(positions, inv_freq)
    half = cos.shape[-1] // 2
    return cos[:, None].to(dtype), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None].to(dtype)


class _Rows:
    """A plain cache pair (K and V views [P, N, S, Hkv, D] of one storage, as kv/cache.py lays them out)
    as rows of Hkv * D elements of that storage from K's first on (`flat`): token t of block b is row
    `block_row[b] + t`, V's row K's plus `v_rows`, in every layer (so a step's row indices are made once
    for all of them). None from `of` for any other layout (quantized planes, other strides)."""

    def __init__(self, flat: torch.Tensor, v_rows: int, n: int, block_rows: int, page_rows: int):
        self.flat = flat
        self.layout = (n, block_rows, page_rows, v_rows)  # what the index plans depend on

    @staticmethod
    def of(k_cache, v_cache) -> _Rows | None:
        if isinstance(k_cache, KVPlane) or k_cache.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride():
            return None
        storage = k_cache.untyped_storage()
        if storage.data_ptr() != v_cache.untyped_storage().data_ptr():
            return None
        _, n, s, h, d = k_cache.shape
        row = h * d
        sp, sn, ss, sh, sd = k_cache.stride()
        if (sd, sh, ss) != (1, d, row) or sp % row or sn % row or k_cache.storage_offset() % row \
                or (v_cache.storage_offset() - k_cache.storage_offset()) % row:
            return None
        first = k_cache.storage_offset()
        flat = k_cache.as_strided((storage.nbytes() // k_cache.element_size() // row - first // row, row), (row, 1))
        return _Rows(flat, (v_cache.storage_offset() - first) // row, n, sn // row, sp // row)


# Each plain cache pair's `_Rows`, by `_kept` on the K view (and the V view beside it): the engine's KVCache
# hands the same view objects to every step (kv/cache.py `layer`) and never changes their shape or strides in
# place, and `_Rows.of` took 5-8 us a layer of Python (storages, strides, a view).
_ROWS: dict = {}


def _rows_of(k_cache, v_cache) -> _Rows | None:
    """`_Rows.of(k_cache, v_cache)`, made once per pair of views."""
    if isinstance(k_cache, KVPlane):
        return None
    return _kept(_ROWS, k_cache, lambda: _Rows.of(k_cache, v_cache), v_cache)


# Each quantized plane pair's `cpu_attention.PlanePair` (or None: the kernels do not apply), by `_kept` on the K plane
# (and the V plane beside it): a KVCache hands the same planes to every step. The step's reads and slots are checked
# once a step (`_per_step`): in each layer, ~89 us a decode call and ~49 us a store call went to them before.
_PLANE_PAIRS: dict = {}
_plane_reads = _per_step(cpu_attention.PlaneReads)
_plane_slots = _per_step(cpu_attention.PlaneSlots)


def _plane_pair(k_cache, v_cache) -> cpu_attention.PlanePair | None:
    """The pair's `PlanePair.of`, made once per pair of planes; None for plain caches and planes it does not read."""
    if not isinstance(k_cache, KVPlane) or not isinstance(v_cache, KVPlane):
        return None
    return _kept(_PLANE_PAIRS, k_cache, lambda: cpu_attention.PlanePair.of(k_cache, v_cache), v_cache)


def _block_rows(blocks: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The flat row (`_Rows`) of each block's token 0."""
    n, block_rows, page_rows, _ = layout
    return blocks // n * page_rows + blocks % n * block_rows


@_per_step
def _write_plan(slot_mapping: torch.Tensor, s: int, layout: tuple):
    """(kept: the token rows with a slot, or None for all; their K and V rows [2 T'] in `_Rows.flat`)."""
    kept = None
    if bool((slot_mapping < 0).any()):  # a host read: free on the CPU
        kept = (slot_mapping >= 0).nonzero().flatten()
        slot_mapping = slot_mapping[kept]
    rows = _block_rows(slot_mapping // s, layout) + slot_mapping % s
    return kept, torch.cat((rows, rows + layout[3]))


def write_kv(k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`reference.write_kv` (k and v rounded to the cache's dtype where it differs, or quantized into a
    quantized cache's planes: `KVPlane.store`, batched already): a plain cache pair in one
    `index_copy_` over its rows (`_Rows`), its slots' rows made once a step."""
    _write(_rows_of(k_cache, v_cache), k_cache, v_cache, k, v, slot_mapping)


def _write(rows: _Rows | None, k_cache, v_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`write_kv` given the pair's `_Rows.of`."""
    if rows is None:
        planes = _plane_pair(k_cache, v_cache)
        if planes is not None and planes.store(_plane_slots(slot_mapping), k, v):  # in C, the slots once a step
            return
        if bool((slot_mapping < 0).any()):
            keep = slot_mapping >= 0
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        if isinstance(k_cache, KVPlane):
            k_cache.store(slot_mapping, k)
            v_cache.store(slot_mapping, v)
            return
        _, n, s = k_cache.shape[:3]
        block, off = slot_mapping // s, slot_mapping % s
        page, inside = block // n, block % n
        k_cache.index_put_((page, inside, off), k.to(k_cache.dtype))
        v_cache.index_put_((page, inside, off), v.to(v_cache.dtype))
        return
    kept, at = _write_plan(slot_mapping, k_cache.shape[2], rows.layout)
    kv = torch.cat((k, v))
    if kept is not None:
        kv = kv[torch.cat((kept, kept + k.shape[0]))]
    if kv.dtype != rows.flat.dtype:
        kv = kv.to(rows.flat.dtype)
    rows.flat.index_copy_(0, at, kv.view(kv.shape[0], -1))


class _ReadPlan:
    """How a step's sequences read their context, the same for every layer (`_read_plan`).

    b, q_max, ctx: sequences, longest query, longest context. tokens [B, C]: the context position
    each (sequence, key) reads: its own up to its length, past it the sequence's last token (a
    written one: finite values, masked) instead of whatever a block's unwritten tail holds.
    blocks [B, C], offsets [B, C]: that position's block and slot. mask: [B, 1, Qmax, C] bool, None
    where nothing is masked (decode rows over equal contexts). at: [T] each token's padded query row,
    None where the batch needs no padding.
    """

    def __init__(self, block_tables: torch.Tensor, query_start, seq_lens, s: int):
        starts = torch.as_tensor(query_start, dtype=torch.int64)
        lens = torch.as_tensor(seq_lens, dtype=torch.int64)
        q_lens = starts[1:] - starts[:-1]  # [B]
        self.b, self.t = len(lens), int(starts[-1])  # host reads: free on the CPU
        self.q_max, self.ctx = int(q_lens.max()) if self.b else 0, int(lens.max()) if self.b else 0
        key = torch.arange(self.ctx)
        self.tokens = torch.minimum(key, (lens - 1).clamp(min=0)[:, None])  # [B, C]
        self.blocks = block_tables.long().gather(1, self.tokens // s)
        self.offsets = self.tokens % s
        q_pos = lens[:, None] - q_lens[:, None] + torch.arange(self.q_max)  # [B, Qmax]: absolute positions
        self.mask = None
        if self.q_max > 1 or int(lens.min()) < self.ctx:
            self.mask = ((key <= q_pos[..., None]) & (key < lens[:, None, None]))[:, None]  # [B, 1, Qmax, C]
        self.at = None
        if self.t != self.b * self.q_max:  # token row r of sequence b sits at padded row b * Qmax + (r - start_b)
            seq = torch.repeat_interleave(torch.arange(self.b), q_lens, output_size=self.t)  # [T]
            self.at = seq * self.q_max + torch.arange(self.t) - starts[seq]
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    def mask_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`mask` as SDPA's additive mask in `dtype` (0 where a key is read, -inf where not), made once for all
        layers: given a bool mask SDPA makes this very tensor in every call (`where(mask, 0, -inf)`), which
        cost 6-9 us a layer at b8 (decode over unequal contexts, the served case)."""
        if self.mask is None:
            return None
        mask = self._masks.get(dtype)
        if mask is None:
            mask = self._masks[dtype] = torch.zeros(self.mask.shape, dtype=dtype).masked_fill_(~self.mask, float("-inf"))
        return mask


@_per_step
def _read_plan(block_tables: torch.Tensor, query_start, seq_lens, s: int) -> _ReadPlan:
    return _ReadPlan(block_tables, query_start, seq_lens, s)


@_per_step
def _read_rows(plan: _ReadPlan, layout: tuple) -> torch.Tensor:
    """[2 B C]: the K rows, then the V rows, of `plan`'s keys in `_Rows.flat`."""
    rows = (_block_rows(plan.blocks, layout) + plan.offsets).flatten()
    return torch.cat((rows, rows + layout[3]))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start, seq_lens, scale: float) -> torch.Tensor:
    """`reference.paged_attention` for all B sequences at once: one gather of their keys and values,
    one `scaled_dot_product_attention` over a batch padded to the longest query and context, masked
    only where some row must be (prefill, unequal contexts).

    q: [T, Hq, D]; query_start [B+1], seq_lens [B]: host sequences or integer tensors;
    block_tables: [B, max_blocks]. Returns [T, Hq, D]. Padding query rows (sequences with
    fewer new tokens than the longest) are computed and dropped; they see the whole context,
    so no row is fully masked. Rows past query_start[B] belong to no sequence: zeros.
    """
    return _attend(_rows_of(k_cache, v_cache), q, k_cache, v_cache, block_tables, query_start, seq_lens, scale)


def _attend(rows: _Rows | None, q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor, query_start,
            seq_lens, scale: float) -> torch.Tensor:
    """`paged_attention` given the pair's `_Rows.of`."""
    t, hq, d = q.shape
    if t == 0:
        return torch.empty_like(q)
    plan = _read_plan(block_tables, _hashable(query_start), _hashable(seq_lens), k_cache.shape[2])
    b, q_max, ctx = plan.b, plan.q_max, plan.ctx
    hkv = k_cache.shape[3]
    if plan.t < t:  # rows past the last sequence's are no sequence's (a mixed graph's padding): zeros
        return torch.cat((_attend(rows, q[:plan.t], k_cache, v_cache, block_tables, query_start, seq_lens, scale),
                          q.new_zeros(t - plan.t, hq, d)))
    planes = _plane_pair(k_cache, v_cache) if rows is None and q_max == 1 and plan.at is None else None
    if planes is not None:  # quantized planes read in place (a decode step: one query row every sequence)
        out = planes.decode(q, _plane_reads(block_tables, _hashable(seq_lens), b, k_cache.shape[2]), scale)
        if out is not None:
            return out
    if rows is not None:  # [B, Hkv, C, D] each, in one gather
        k, v = rows.flat.index_select(0, _read_rows(plan, rows.layout)).view(2, b, ctx, hkv, d).transpose(2, 3).unbind()
    else:
        k, v = (_gather(c, plan).transpose(1, 2) for c in (k_cache, v_cache))
    if k.dtype != q.dtype:  # a cache of another dtype is read in q's
        k, v = k.to(q.dtype), v.to(q.dtype)
    if plan.at is not None:
        q = q.new_zeros(b * q_max, hq, d).index_copy_(0, plan.at, q)
    one = q_max == 1  # decode: [B, Hq, D] is [B, Hq, 1, D] without moving a dim
    out = F.scaled_dot_product_attention(q.unsqueeze(2) if one else q.view(b, q_max, hq, d).transpose(1, 2), k, v,
                                         attn_mask=plan.mask_for(q.dtype), scale=scale, enable_gqa=hq != hkv)
    out = out.squeeze(2) if one else out.transpose(1, 2).reshape(b * q_max, hq, d)
    return out if plan.at is None else out.index_select(0, plan.at)  # [T, Hq, D]


def _hashable(x):
    """query_start / seq_lens as `_per_step` keys them: a tensor as it is, a host sequence as a tuple."""
    return x if isinstance(x, torch.Tensor) else tuple(x)


def _gather(cache: torch.Tensor | KVPlane, plan: _ReadPlan) -> torch.Tensor:
    """`plan`'s keys of a cache that is not plain rows: [B, C, Hkv, D] (a quantized plane's dequantized,
    fp32: its blocks in one batched gather, then the keys)."""
    _, n, s = cache.shape[:3]
    if isinstance(cache, KVPlane):
        whole = cache.blocks(plan.blocks[:, ::s]).flatten(1, 2)  # [B, nb * S, Hkv, D]: key c's block is c // S
        return whole.gather(1, plan.tokens[..., None, None].expand(-1, -1, *whole.shape[2:]))
    return cache[plan.blocks // n, plan.blocks % n, plan.offsets]


class _DecodeStep:
    """All that the layers of a decode step over a plain cache (`_Rows`) share, made on its first layer
    (`_decode_step`) from the same helpers as the general path: the rotation's tables, the K/V write's rows,
    and how the context is read: in fp32 with the C kernels built, by `cpu_attention.Context` (each block-table
    entry's row and each new token's K row, -1 where its slot is none, checked once a step); otherwise the
    context's rows for one gather and SDPA's mask (None over equal contexts). One per-step lookup a layer
    instead of four, and the decode check made once a step (query_start is one step's tensor, never written)."""

    __slots__ = ("cos", "sin", "kept", "write_at", "context", "read_rows", "mask", "b", "ctx", "scratch")

    def __init__(self, positions, inv_freq, dtype, slot_mapping, block_tables, query_start, seq_lens, s, layout):
        reference.check_decode(query_start.tolist() if isinstance(query_start, torch.Tensor) else query_start)
        self.cos, self.sin = _rope_tables.__wrapped__(positions, inv_freq, dtype)
        kept, write_at = _write_plan.__wrapped__(slot_mapping, s, layout)
        self.context = self.scratch = None  # scratch: the fused layers' (`dense_layer`), made on the first
        if dtype == torch.float32 and cpu_attention.available():
            lens = torch.as_tensor(seq_lens, dtype=torch.int64)
            k_rows = write_at[:len(write_at) // 2]
            if kept is not None:
                k_rows = torch.full((len(slot_mapping),), -1, dtype=torch.int64).index_copy_(0, kept, k_rows)
            self.context = cpu_attention.Context(_block_rows(block_tables[:len(lens)].long(), layout), lens, s, k_rows)
            return
        self.kept = None if kept is None else torch.cat((kept, kept + len(slot_mapping)))  # rows of cat((k, v))
        self.write_at = write_at
        plan = _ReadPlan(block_tables, query_start, seq_lens, s)
        self.read_rows = _read_rows.__wrapped__(plan, layout)
        self.mask, self.b, self.ctx = plan.mask_for(dtype), plan.b, plan.ctx


_decode_step = _per_step(_DecodeStep)


def _decode(rows: _Rows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: _DecodeStep,
            scale: float) -> torch.Tensor:
    """`rotary_paged_attention` at decode over a plain cache of q's dtype (qk-norm done): the step's
    `cpu_attention.Context` in one C call (rotation, K/V write, attention over K and V in place), or
    `_rotate_qk`, `_write` and `_attend`'s decode case (the same ops)."""
    if step.context is not None:  # [T, Hq, D]: one row per sequence
        return step.context.rotary(q, k, v, step.cos, step.sin, rows.flat, rows.layout[3], scale)[0]
    q, k = _rotate_qk(q, k, step.cos, step.sin)
    kv = torch.cat((k, v))
    if step.kept is not None:
        kv = kv[step.kept]
    rows.flat.index_copy_(0, step.write_at, kv.view(kv.shape[0], -1))
    hkv, d = k.shape[1], k.shape[2]
    k, v = rows.flat.index_select(0, step.read_rows).view(2, step.b, step.ctx, hkv, d).transpose(2, 3).unbind()
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=step.mask, scale=scale,
                                         enable_gqa=q.shape[1] != hkv)
    return out.squeeze(2)  # [T, Hq, D]: one row per sequence


def rotary_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start, seq_lens,
                           scale: float, *, q_weight: torch.Tensor | None = None,
                           k_weight: torch.Tensor | None = None, eps: float = 1e-6, zero_centred: bool = False,
                           decode: bool = False) -> torch.Tensor:
    """`reference.rotary_paged_attention` (same arguments, same checks) on the batched ops above; a decode
    step over a plain cache of q's dtype through `_decode`."""
    rows = _rows_of(k_cache, v_cache)
    if decode and rows is not None and len(q) and q.dtype == k.dtype == v.dtype == rows.flat.dtype:
        if q_weight is not None:
            q, k = rms_norm(q, q_weight, eps, zero_centred), rms_norm(k, k_weight, eps, zero_centred)
        step = _decode_step(positions, inv_freq, q.dtype, slot_mapping, block_tables, _hashable(query_start),
                            _hashable(seq_lens), k_cache.shape[2], rows.layout)
        return _decode(rows, q, k, v, step, scale)
    if decode:
        reference.check_decode(query_start.tolist() if isinstance(query_start, torch.Tensor) else query_start)
    q, k = rotary_qk(q, k, positions, inv_freq, q_weight, k_weight, eps, zero_centred)
    _write(rows, k_cache, v_cache, k, v, slot_mapping)
    return _attend(rows, q, k_cache, v_cache, block_tables, query_start, seq_lens, scale)


# -- a dense layer in one call ----------------------------------------------------

_LAYERS: dict = {}  # each Llama layer's `cpu_layer.DenseLayer` or None, by `_kept` on the layer


def dense_layer(layer, x: torch.Tensor, rope, batch, cache) -> torch.Tensor | None:
    """A Llama layer (model/llama.py `LlamaLayer`) of a decode step in one C call (cpu_layer.py: its products,
    attention and residual adds are the op-by-op path's, its RMSNorms within a few units of fp32 rounding of the
    reference's), or None where that does not apply and the model runs its ops: a prefill or mixed step, not
    fp32, a layer with a bias, qk-norm, an output gate, a zero-centred norm, a group of cards, weights the block
    kernels do not read, more rows than their products take (past `gemm_rows`), a cache that is neither plain fp32
    rows nor quantized planes the C attention reads (`cpu_attention.PlanePair`)."""
    if not batch.is_decode or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        return None
    fused = _kept(_LAYERS, layer, lambda: _dense_layer(layer))
    if fused is None or (fused.rows is not None and x.shape[0] > fused.rows):
        return None
    k_cache, v_cache = cache.layer(layer.attn.layer)
    rows = _rows_of(k_cache, v_cache)
    positions, inv_freq = rope
    if rows is None:
        planes = _plane_pair(k_cache, v_cache)
        if planes is None:
            return None
        step = _plane_step(positions, inv_freq, batch.slot_mapping, batch.block_tables,
                           _hashable(batch.query_start_t), _hashable(batch.seq_lens_t), k_cache.shape[2])
        step.scratch = fused.scratch((step.reads, step.slots), step.cos, step.sin, step.scratch)
        return fused.planes(x, step.scratch, planes)
    if rows.flat.dtype != torch.float32:
        return None
    step = _decode_step(positions, inv_freq, x.dtype, batch.slot_mapping, batch.block_tables,
                        _hashable(batch.query_start_t), _hashable(batch.seq_lens_t), k_cache.shape[2], rows.layout)
    if step.context is None:
        return None
    step.scratch = fused.scratch(step.context, step.cos, step.sin, step.scratch)
    return fused(x, step.scratch, rows.flat, rows.layout[3])


class _PlaneStep:
    """All that the fused layers of a decode step over quantized planes share (`_plane_step`): the rotation's tables,
    the step's reads and slots (`cpu_attention.PlaneReads`, `PlaneSlots`) and the layers' scratch, made on the
    first."""

    __slots__ = ("cos", "sin", "reads", "slots", "scratch")

    def __init__(self, positions, inv_freq, slot_mapping, block_tables, query_start, seq_lens, s):
        reference.check_decode(query_start.tolist() if isinstance(query_start, torch.Tensor) else query_start)
        self.cos, self.sin = _rope_tables.__wrapped__(positions, inv_freq, torch.float32)
        lens = torch.as_tensor(seq_lens, dtype=torch.int64)
        self.reads = cpu_attention.PlaneReads(block_tables, lens, len(lens), s)
        self.slots = cpu_attention.PlaneSlots(slot_mapping)
        self.scratch = None


_plane_step = _per_step(_PlaneStep)


def _dense_layer(layer) -> cpu_layer.DenseLayer | None:
    attn, mlp, norms = layer.attn, layer.mlp, (layer.input_norm, layer.post_norm)
    if attn.group.size != 1 or mlp.group.size != 1 or attn.bqkv is not None or attn.q_norm is not None \
            or attn.output_gate or any(n.zero_centred for n in norms) or norms[0].eps != norms[1].eps:
        return None
    weights = (attn.wqkv, attn.wo, mlp.gate, mlp.up, mlp.down)
    mats = tuple(_blocks(w) if isinstance(w, CompactWeight) else None for w in weights)
    return cpu_layer.DenseLayer.make((norms[0].weight, norms[1].weight), norms[0].eps, mats,
                                     (attn.heads, attn.kv_heads, attn.head_dim), attn.scale)
