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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radianced.kernels import cpu_packed, reference
from radianced.kernels.compact import CompactWeight, RowStack, dense
from radianced.kernels.kv_quant import KVPlane

# -- norms ------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """`reference.rms_norm` in one fused torch kernel. x: [..., D], weight: [D].

    In fp32 `F.rms_norm` gives the reference's values bit for bit (normalize, then
    multiply by the weight, or by `1 + weight` zero-centred); other dtypes round
    between the two steps in the reference, so they take the reference."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return reference.rms_norm(x, weight, eps, zero_centred)
    return F.rms_norm(x, (x.shape[-1],), 1.0 + weight if zero_centred else weight, eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: reference.Norm | None = None,
           keep_normed: bool = False, out_dtype: torch.dtype | None = None,
           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`reference.linear` (same arguments) with its norm fused (`rms_norm` above) and the residual
    added in place into the matmul's fresh result. The matmul is `_matmul`: the reference's rounding
    for a dense weight, the int4 kernel's (bf16 in, bf16 out: cpu_packed.py) for a packed one."""
    if norm is not None:
        x = rms_norm(x, *norm)
    y = _matmul(x, weight, bias)
    if residual is not None:
        y = y.add_(residual)  # residual + y: the same one rounding, no second [T, N] buffer
    if out_dtype is not None:
        y = y.to(out_dtype)
    return (y, x) if keep_normed else y


def silu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`reference.silu_mlp`, `down(silu(gate(x)) * up(x))`, with each matmul through `_matmul`."""
    return _matmul(F.silu(_matmul(x, gate)) * _matmul(x, up), down)


def _matmul(x: torch.Tensor, weight: torch.Tensor | CompactWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in x's dtype, a fresh tensor: a compact weight packed at load through
    torch's int4 kernel (`cpu_packed.matmul`: 4-5x fp32 F.linear at decode on this CPU), any other
    weight by F.linear, a compact one dequantized to x's dtype for the call as the reference does."""
    if isinstance(weight, CompactWeight) and weight.packed is not None:
        y = cpu_packed.matmul(x, weight.packed)
    elif isinstance(weight, RowStack) and any(isinstance(p, CompactWeight) and p.packed for p in weight.parts):
        y = torch.cat([_matmul(x, p) for p in weight.parts], dim=-1)  # [q | k | v] of several formats
    else:
        return F.linear(x, dense(weight, x.dtype), bias)
    return y if bias is None else y.add_(bias)


# -- rotary -----------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x: [T, H, D] by cos, sin: [T, R] (both halves the same), the dims past R
    passing: the reference's values (the same products and sums) without its two concatenations."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out = torch.empty_like(x)
    torch.sub(x1 * c, x2 * s, out=out[..., :half])  # x1 c + (-x2) s: negation is exact
    torch.add(x2 * c, x1 * s, out=out[..., half:2 * half])
    out[..., 2 * half:] = x[..., 2 * half:]
    return out


def rotary_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
              zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rotary_qk`: qk-norm (fused) when weights are given, then RoPE on q and k."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps, zero_centred), rms_norm(k, k_weight, eps, zero_centred)
    cos, sin = reference.rotary_cos_sin(positions, inv_freq)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


# -- paged attention ----------------------------------------------------------


def write_kv(k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`reference.write_kv` (k and v rounded to the cache's dtype where it differs, or quantized into a
    quantized cache's planes: `KVPlane.store`, batched already); the mask of skipped slots (< 0) is
    built only when there is one."""
    if bool((slot_mapping < 0).any()):  # a host read: free on the CPU
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    if isinstance(k_cache, KVPlane):
        k_cache.store(slot_mapping, k)
        v_cache.store(slot_mapping, v)
        return
    _, n, s = k_cache.shape[:3]
    block, off = slot_mapping // s, slot_mapping % s
    page, inside = block // n, block % n
    k_cache.index_put_((page, inside, off), k.to(k_cache.dtype))  # a no-op where the dtypes match
    v_cache.index_put_((page, inside, off), v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start, seq_lens, scale: float) -> torch.Tensor:
    """`reference.paged_attention` for all B sequences at once: one gather of their blocks, one
    masked `scaled_dot_product_attention` over a batch padded to the longest query and context.

    q: [T, Hq, D]; query_start [B+1], seq_lens [B]: host sequences or integer tensors;
    block_tables: [B, max_blocks]. Returns [T, Hq, D]. Padding query rows (sequences with
    fewer new tokens than the longest) are computed and dropped; they see the whole context,
    so no row is fully masked.
    """
    starts = torch.as_tensor(query_start, dtype=torch.int64)
    lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    q_lens = starts[1:] - starts[:-1]  # [B]
    b, (_, _, s, hkv, d) = len(lens), k_cache.shape
    t, hq = q.shape[:2]
    if t == 0:
        return torch.empty_like(q)
    q_max, ctx = int(q_lens.max()), int(lens.max())  # host reads: free on the CPU
    blocks = block_tables[:, : (ctx + s - 1) // s].long()  # [B, nb]
    k = _gather_blocks(k_cache, blocks)[:, :ctx].to(q.dtype)  # [B, C, Hkv, D]; a cache of another dtype is read in q's
    v = _gather_blocks(v_cache, blocks)[:, :ctx].to(q.dtype)
    if int(lens.min()) < ctx:  # a shorter context's tail is whatever its pages held (an expert's bytes, read as
        past = (torch.arange(ctx) >= lens[:, None])[..., None, None]  # floats: NaN, inf): masking alone lets
        k, v = k.masked_fill(past, 0), v.masked_fill(past, 0)  # 0 * NaN through, so they are zeroed
    padded = t != b * q_max  # decode (one row each) and equal chunks need no padding
    if padded:  # token row r of sequence b sits at padded row b * Qmax + (r - start_b)
        seq = torch.repeat_interleave(torch.arange(b), q_lens, output_size=t)  # [T]
        at = seq * q_max + torch.arange(t) - starts[seq]
        q = q.new_zeros(b * q_max, hq, d).index_copy_(0, at, q)
    q_pos = lens[:, None] - q_lens[:, None] + torch.arange(q_max)  # [B, Qmax]: absolute positions
    key = torch.arange(ctx)
    mask = (key <= q_pos[..., None]) & (key < lens[:, None, None])  # [B, Qmax, C]
    out = F.scaled_dot_product_attention(q.view(b, q_max, hq, d).transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=hq != hkv).transpose(1, 2).reshape(b * q_max, hq, d)
    return out.index_select(0, at) if padded else out  # [T, Hq, D]


def _gather_blocks(cache: torch.Tensor | KVPlane, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks [B, nb] of a cache view [P, N, S, Hkv, D]: [B, nb * S, Hkv, D]. Pages and blocks
    merge into one axis of the strided view (a page is N blocks apart), so one `index_select`
    does it: 100 us against 270 us for the two-axis index at SmolLM2's decode shapes (b8). A
    quantized plane's blocks come dequantized (fp32) in one batched gather."""
    _, n, s = cache.shape[:3]
    if isinstance(cache, KVPlane):
        return cache.blocks(blocks).flatten(1, 2)
    if cache.stride(0) != n * cache.stride(1):
        return cache[blocks // n, blocks % n].flatten(1, 2)
    return cache.flatten(0, 1).index_select(0, blocks.flatten()).view(*blocks.shape, s, *cache.shape[3:]).flatten(1, 2)


def rotary_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start, seq_lens,
                           scale: float, *, q_weight: torch.Tensor | None = None,
                           k_weight: torch.Tensor | None = None, eps: float = 1e-6, zero_centred: bool = False,
                           decode: bool = False) -> torch.Tensor:
    """`reference.rotary_paged_attention` (same arguments, same checks) on the batched ops above."""
    if decode:
        reference.check_decode(query_start.tolist() if isinstance(query_start, torch.Tensor) else query_start)
    q, k = rotary_qk(q, k, positions, inv_freq, q_weight, k_weight, eps, zero_centred)
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return paged_attention(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale)
