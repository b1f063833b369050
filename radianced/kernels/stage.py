"""A step's host-pool misses copied to the card before the MoE reads them (GGUF experts).

The MoE kernels can read an expert where it lies in the pinned host pool (kernels/moe.py: a
negative table entry). bf16 and fp8 extents cross the link that way at 94% and ~93% of its rate
(the H200, session 21): their tiles load 16-byte runs. GGUF extents do not: q4_0's and q8_0's
18- and 34-byte blocks are loaded as 2- and 4-byte words, and the few-rows path (decode) reads an
expert once for every token routed to it. The H200's headline run measured int4 misses at 17-27
GB/s against the 55.3 probed (bench/README, session 29).

`stage_misses` puts two launches before the MoE's, both graph-capturable (no host sync):
1. plan (one program): the routed experts whose entry is a host row, ranked in id order; the
   first R (the staging buffer's rows) get a row each. It writes the step's pointer table: each
   expert's address, a slot, its staging row, or (past R) its host row, read in place as before;
   and each staged expert's host address.
2. copy (min(R, T * k) x chunks programs; those past the step's count return at once): staging row j
   <- the host row of the j-th staged expert, in 16-byte words.
The MoE then reads the pointer table (`moe_ptr`'s path): the same bytes, so the same result, bit
for bit. An expert routed to several tokens crosses the link once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radianced.kernels.formats import is_staged

# Assignments (T * k) up to which a step stages its misses: decode and verify batches (Qwen3-Next's b32 is 320).
# A prefill chunk routes nearly every expert, and its tiles read an expert once a 64 tokens.
MAX_ASSIGNMENTS = 512
_PLAN_PAIRS = 8192  # (expert, assignment) pairs a plan step compares: 64 a thread at 4 warps
_COPY_BYTES = 64 * 1024  # bytes a copy program moves
_COPY_WORDS = 2048  # int32 words a copy program loads at once (8 KiB: 16 a thread at 4 warps)


def wanted(topk_numel: int, host: torch.Tensor | None, staging: torch.Tensor | None,
           weight_format: str | None) -> bool:
    """Whether a MoE call stages its misses: with a host pool and a staging buffer, GGUF experts (both
    pieces) and a decode-sized routing (`topk_numel` assignments)."""
    if staging is None or host is None or weight_format is None:
        return False
    return is_staged(weight_format) and topk_numel <= MAX_ASSIGNMENTS


@triton.jit
def _plan_kernel(ids_ptr, table_ptr, slab_ptr, host_ptr, staging_ptr, out_ptr, src_ptr, count_ptr,
                 num_ids, num_experts, host_rows, slab_row_bytes, host_row_bytes, staging_row_bytes, rows,
                 BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    a = tl.arange(0, BLOCK_A)
    ids = tl.load(ids_ptr + a, mask=a < num_ids, other=-1)
    slab_at = slab_ptr.to(tl.int64)
    host_at = host_ptr.to(tl.int64)
    staging_at = staging_ptr.to(tl.int64)
    misses = 0
    for e0 in range(0, num_experts, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        ok = e < num_experts
        entry = tl.load(table_ptr + e, mask=ok, other=0)
        routed = tl.max((ids[None, :] == e[:, None]).to(tl.int32), axis=1) > 0
        host_row = -1 - entry
        miss = ok & routed & (entry < 0) & (host_row < host_rows)
        rank = misses + tl.cumsum(miss.to(tl.int32), axis=0) - 1
        staged = miss & (rank < rows)
        home = tl.where(entry >= 0, slab_at + entry * slab_row_bytes, host_at + host_row * host_row_bytes)
        tl.store(out_ptr + e, tl.where(staged, staging_at + rank.to(tl.int64) * staging_row_bytes, home), mask=ok)
        tl.store(src_ptr + rank, home, mask=staged)
        misses += tl.sum(miss.to(tl.int32), axis=0)
    tl.store(count_ptr, tl.minimum(misses, rows))


@triton.jit
def _copy_kernel(src_ptr, count_ptr, staging_ptr, staging_row_quads, row_quads,
                 CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    if j < tl.load(count_ptr):
        src = tl.multiple_of(tl.load(src_ptr + j).to(tl.pointer_type(tl.int32)), 16)
        dst = staging_ptr + j.to(tl.int64) * (staging_row_quads * 4)
        n = row_quads * 4  # the words copied, a multiple of 4: whole 16-byte words
        first = tl.program_id(1) * CHUNK_WORDS
        for w0 in range(first, first + CHUNK_WORDS, BLOCK):
            w = w0 + tl.arange(0, BLOCK)
            tl.store(dst + w, tl.load(src + w, mask=w < n), mask=w < n)


def stage_misses(topk_ids: torch.Tensor, table: torch.Tensor, slab: torch.Tensor, host: torch.Tensor,
                 staging: torch.Tensor) -> torch.Tensor:
    """The step's pointer table [E] int64 for `moe_ptr`, with this call's routed host experts copied
    to `staging` first (up to its rows; the rest point at their host rows, read in place).

    topk_ids: [T, k] int; table: [E] int64, entry >= 0 a row of slab, < 0 row -1 - entry of host
    (`moe`'s table); slab, host: uint8 rows of compact extents, 16-byte aligned; staging: uint8
    [R, W], W a multiple of 16 and at least host's width, rows 16-byte aligned: each staged
    expert's first W bytes are copied (host rows at least W bytes apart: an extent's row, read in
    whole 16-byte words). Entries past host's rows are left as they are (not staged). No host sync."""
    if staging.dtype != torch.uint8 or host.dtype != torch.uint8 or slab.dtype != torch.uint8:
        raise ValueError(f"slab, host and staging must be uint8 rows of extents, got {slab.dtype}, {host.dtype}, "
                         f"{staging.dtype}")
    width = staging.shape[1] if staging.dim() == 2 else 0
    if not width or width % 16 or width < host.shape[1] or host.stride(0) < width or staging.stride(1) != 1 \
            or host.stride(1) != 1 or staging.stride(0) % 16 or host.stride(0) % 16 or slab.stride(0) % 16 \
            or any(t.data_ptr() % 16 for t in (slab, host, staging)):
        raise ValueError(f"staging {tuple(staging.shape)} must be [R, W], W a multiple of 16 bytes at least host's "
                         f"{host.shape[1]} and at most its row stride {host.stride(0)}; slab, host and staging rows "
                         f"16-byte aligned (strides {slab.stride()}, {host.stride()}, {staging.stride()}; the "
                         f"kernels read every row of the step's pointer table in 16-byte words)")
    if staging.device != slab.device or table.device != slab.device or topk_ids.device != slab.device:
        raise ValueError(f"staging ({staging.device}), table ({table.device}) and ids ({topk_ids.device}) must be on "
                         f"the slab's device {slab.device}")
    ids = topk_ids.reshape(-1)
    rows = staging.shape[0]
    out = torch.empty_like(table)
    src = torch.empty((rows,), dtype=torch.int64, device=slab.device)
    count = torch.empty((1,), dtype=torch.int32, device=slab.device)
    block_a = triton.next_power_of_2(max(ids.numel(), 1))
    _plan_kernel[(1,)](ids, table, slab, host, staging, out, src, count, ids.numel(), table.shape[0], host.shape[0],
                       slab.stride(0), host.stride(0), staging.stride(0), rows,
                       BLOCK_A=block_a, BLOCK_E=max(16, min(128, _PLAN_PAIRS // block_a)), num_warps=4)
    # a call stages at most its distinct routed experts: no more copy programs than its assignments
    _copy_kernel[(min(rows, max(ids.numel(), 1)), triton.cdiv(width, _COPY_BYTES))](
        src, count, staging.view(torch.int32), staging.stride(0) // 16, width // 16,
        CHUNK_WORDS=_COPY_BYTES // 4, BLOCK=_COPY_WORDS, num_warps=4)
    return out


__all__ = ["MAX_ASSIGNMENTS", "stage_misses", "wanted"]
