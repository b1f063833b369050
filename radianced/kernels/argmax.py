"""The greedy pick: each row's index of its largest value (the first one on ties), in one launch.

logits: [B, V] (fp32, bf16 or fp16; unit last stride). Returns [B] int64, as
`torch.argmax(logits, dim=-1)`. The grid is (P, B): each of a row's P programs
reduces BLOCK values to (its max, the first index holding it) and stores the
pair; the last of the row's programs to finish (kernels/arrival.py) reduces the P
pairs, lowest program first, so a tie keeps the lowest index, as torch's does.
torch's one reduction kernel takes ~8 us for a 151,936-wide row (Qwen3's
vocabulary) on an H200, most of it a few blocks streaming the row; here ~75
programs share it. NaN counts as +inf (torch ranks NaN above everything: the two
differ only for a row holding both NaN and +inf). No host sync (graph-capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radianced.kernels import arrival, pdl

BLOCK = 2048  # values per program


@triton.jit
def _argmax_kernel(x_ptr, part_v_ptr, part_i_ptr, out_ptr, counter_ptr, width, stride,
                   PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    p = tl.program_id(0)
    row = tl.program_id(1)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < width, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, offs, width), 0)  # every program has a real lane: P = cdiv(V, BLOCK)
    tl.store(part_v_ptr + row * PARTS + p, best)
    tl.store(part_i_ptr + row * PARTS + p, first)
    if arrival.last_arrival(counter_ptr + row, PARTS):
        q = tl.arange(0, PARTS_PAD)
        pv = tl.load(part_v_ptr + row * PARTS + q, mask=q < PARTS, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(part_i_ptr + row * PARTS + q, mask=q < PARTS, other=width, cache_modifier=".cg")
        top = tl.max(pv, 0)
        tl.store(out_ptr + row, tl.min(tl.where(pv == top, pi, width), 0).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, the first on ties (Triton); contract of `reference.argmax`.

    logits: [B, V], V >= 1, fp32 / bf16 / fp16 with a unit last stride. Returns [B] int64.
    """
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [B, V] with V >= 1 and a unit last stride, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits dtype {logits.dtype} is not supported (fp32, bf16, fp16)")
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    parts = triton.cdiv(v, BLOCK)
    part_v = torch.empty((b, parts), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((b, parts), dtype=torch.int32, device=logits.device)
    _argmax_kernel[(parts, b)](logits, part_v, part_i, out, arrival.counters(logits.device, b), v, logits.stride(0),
                               PARTS=parts, PARTS_PAD=triton.next_power_of_2(parts), BLOCK=BLOCK, num_warps=4,
                               **pdl.launch(logits.device, parts * b))
    return out


__all__ = ["BLOCK", "argmax"]
