"""Compact weights packed once for torch's int4 CPU matmul (the host backend's low-bit linear).

torch 2.13 has two weight-only low-bit matmuls on the CPU:
`aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])` (one scale per output row) and
`aten._weight_int4pack_mm_for_cpu(x, w_packed, group, scales_and_zeros [K/group, N, 2])`
(w = (q - 8) * scale + zero per group of K values; the weight packed by
`aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)`, N a multiple of 16).
Both take x, scales and zeros in one dtype and return that dtype; only bf16 is
vectorized here (AVX-512 with AMX): fp32 and fp16 inputs are scalar code, 5-100x slower.

Measured on this 2-core x86 box (AVX-512 + AMX), microseconds per call, weights streamed
from memory (30 copies, as a decode step reads 30 layers), x [M, K]:

    shape (N x K)     M  threads  fp32 F.linear  bf16 F.linear  int8pack bf16  int4pack bf16  int4pack fp32
    3072 x 576        1     1          621            577            309            131           3102
    3072 x 576        8     1         1599            646            704            411          23508
    3072 x 576        1     2          319            290              -             66              -
    3072 x 576        8     2          708            326              -            212              -
    576 x 1536        1     2          141            187              -             38              -
    49152 x 576       1     1         8932           8032           5070           1800          49178
    49152 x 576       8     2        15238           4129              -           3016              -
    3072 x 576       64     1         2616            823              -           2809              -
    3072 x 576      512     1        11454           1843              -          22261              -

So the pick is the int4 kernel with bf16 activations: 4-5x fp32 at M = 1 and 3-4x at M = 8.
It scales linearly in M (a gemv per row), so a long prefill runs it at about fp32's speed
(a 512-row chunk: 22 ms against fp32's 11 ms on this shape, 30 layers ~ 1.3 s per 512 tokens,
today's fp32 prefill speed); bf16 dense weights would prefill 6x faster but cost 2 bytes a weight.
The int8 kernel has one scale per row, which no GGUF format is: GGUF's Q8_0 has one per 32.

Formats packed (all groups of 32, so each GGUF block is one kernel group):
    q4_0   q -> q, scale d, zero 0                                 (d (q - 8))
    q4_1   q -> q, scale d, zero m + 8 d                           (d q + m)
    q8_0   K doubled: the kernel reads [high nibbles | low nibbles] of each int8 q against [x | x]:
           high h = q >> 4 (-8..7) as h + 8 with scale 16 d, zero 0; low l = q & 15 with scale d,
           zero 8 d; 16 d h + d l = d q. 8 bits a weight like Q8_0 itself, 2 ms for SmolLM2's
           49152 x 576 lm_head at M = 1 (2 threads) against 4.4 ms in fp32.
The K-quants and fp8_b128 are not packed (their scale products need more than bf16), and
stay dequantized per use.

Rounding, the kernel's contract (what tests/kernels/test_cpu_packed.py checks on odd shapes):
x is rounded to bf16, each group's scale and zero to bf16 (Q4_1's zero from m + 8 d in fp32),
the weight values are then exact in fp32, products accumulate in fp32 and the result is
rounded to bf16 once. Against the reference (fp32 dequantization, fp32 linear) that is a
relative error of a few 2^-9 per output: llama.cpp, for comparison, rounds x to 8 bits (Q8_1)
for its Q4_1 dot products.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from radianced.kernels.formats import is_compact

GROUP = 32  # values per kernel group: one GGUF block
PACKABLE = ("q4_0", "q4_1", "q8_0")
_ROWS = 16  # the packed layout's N granularity: N is padded with zero rows to a multiple


@dataclass(frozen=True)
class PackedInt4:
    """A matrix W [N, K] in torch's CPU int4 layout, for `aten._weight_int4pack_mm_for_cpu`.

    n: N, the rows the matmul returns (the packed weight has N rounded up to 16; the extra rows are zero).
    weight: the packed nibbles, uint8 [N16, K2 / 2] (`aten._convert_weight_to_int4pack_for_cpu`).
    scales_zeros: bf16 [K2 / 32, N16, 2], each group's scale and zero.
    doubled: whether K2 = 2 K (q8_0: x is read twice, against the high nibbles then the low ones);
        else K2 = K.
    first: W's first row in the packing: matrices of one input packed together (`together`) share one
        packing, each its own rows of it (first, n), so one kernel call computes all of them.
    """

    n: int
    weight: torch.Tensor
    scales_zeros: torch.Tensor
    doubled: bool
    first: int = 0

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 2 * self.scales_zeros.numel()


# Compact matrices the loader does not pack (model/loader.py says why): the embedding table is only gathered
# by rows, and a compact lm_head is made dense in the activations' dtype at load.
UNPACKED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def packed_nbytes(fmt: str, shape: tuple[int, int]) -> int:
    """The bytes `pack(fmt, shape, ...)` holds: N rounded up to 16 rows, K2 / 2 nibble bytes a row and a bf16
    scale and zero per 32 of K2 (K2 = 2 K for q8_0)."""
    n, k = shape
    rows, k2 = -(-n // _ROWS) * _ROWS, 2 * k if fmt == "q8_0" else k
    return rows * k2 // 2 + 2 * 2 * rows * (k2 // GROUP)


def held_nbytes(name: str, fmt: str, shape: tuple[int, ...], stored: int, act_bytes: int) -> int:
    """Bytes the host backend holds for a stored tensor once loaded (model/loader.py): a packable compact
    matrix in this module's layout, a compact lm_head dense in the activations' dtype, the rest as stored
    (the budget charges these on the CPU: sizing.ModelFacts.cpu_weights)."""
    if not is_compact(fmt):
        return stored
    if name == "lm_head.weight":
        return shape[0] * shape[1] * act_bytes
    return stored if name in UNPACKED or fmt not in PACKABLE else packed_nbytes(fmt, (shape[0], shape[1]))


def pack(fmt: str, shape: tuple[int, int], data: torch.Tensor) -> PackedInt4:
    """Pack a compact matrix's bytes (`CompactWeight.data`: [N, row_bytes] uint8) for the int4 kernel.
    ValueError for a format it does not take (`PACKABLE`)."""
    n, k = shape
    blocks = data.reshape(n, k // GROUP, -1)  # [N, K/32, block bytes]
    d = _f16(blocks[..., 0:2])  # [N, K/32] fp32
    if fmt == "q4_0":
        q, scale, zero = _nibbles(blocks[..., 2:]), d, torch.zeros_like(d)
    elif fmt == "q4_1":
        q, scale, zero = _nibbles(blocks[..., 4:]), d, _f16(blocks[..., 2:4]) + 8 * d
    elif fmt == "q8_0":
        v = blocks[..., 2:].reshape(n, k).view(torch.int8).to(torch.int32)
        q = torch.cat([(v >> 4) + 8, v & 15], dim=1)  # [N, 2K]: high nibbles (signed, offset by 8), then low
        scale, zero = torch.cat([16 * d, d], dim=1), torch.cat([torch.zeros_like(d), 8 * d], dim=1)
    else:
        raise ValueError(f"format {fmt} has no int4 packing; packable: {', '.join(PACKABLE)}")
    pad = -n % _ROWS
    if pad:
        q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])  # q = 8 with scale 0, zero 0: a zero row
        scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, zero))
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return PackedInt4(n, weight, scales_zeros, fmt == "q8_0")


def together(parts: list[PackedInt4], packed: PackedInt4) -> list[PackedInt4]:
    """`parts` (matrices of one K and format) as rows of `packed`, their rows stacked in one packing
    (`compact.pack_together` makes it): each part keeps its own product (`matmul`), and `matmul_shared`
    computes all of them in one kernel call."""
    firsts = itertools.accumulate((p.n for p in parts[:-1]), initial=0)
    return [replace(packed, n=p.n, first=f) for p, f in zip(parts, firsts)]


def matmul(x: torch.Tensor, w: PackedInt4) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, through the int4 kernel (rounding: the module docstring)."""
    return matmul_shared(x, [w])[0]


def matmul_shared(x: torch.Tensor, ws: list[PackedInt4]) -> list[torch.Tensor]:
    """`[matmul(x, w) for w in ws]` for matrices of one packing (`together`), in one kernel call: each row of
    the result is the same whichever rows are computed beside it."""
    lead, k, w = x.shape[:-1], x.shape[-1], ws[0]
    if x.shape[0] == 0 or len(lead) != 1:
        if x.numel() == 0:
            return [x.new_empty(*lead, p.n) for p in ws]
        return [y.reshape(*lead, y.shape[-1]) for y in matmul_shared(x.reshape(-1, k), ws)]
    # At decode each op here is a few microseconds of a ~1 ms layer: the casts are `.bfloat16()` and `.float()`
    # (`.to(dtype)` parses its overloads: 3-4 us more a call at [1, 576]), the parts views of the result, none
    # where it is one
    xb = x.bfloat16()
    if w.doubled:
        xb = torch.cat([xb, xb], dim=1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.weight, GROUP, w.scales_zeros)
    y = y.float() if x.dtype == torch.float32 else y.to(x.dtype)
    if w.first == 0 and sum(p.n for p in ws) == y.shape[1] and all(
            p.first == q.first + q.n for q, p in zip(ws, ws[1:])):  # the parts tile y: one op (none for one part)
        return [y] if len(ws) == 1 else list(y.split_with_sizes([p.n for p in ws], 1))
    return [y.narrow(1, p.first, p.n) for p in ws]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] fp32 (little-endian fp16 bytes)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, G, 16] uint8 -> [N, 32 G] int32: per block the 16 low nibbles, then the 16 high ones (ggml's order)."""
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2)  # [N, G, 2, 16]
    return q.reshape(qs.shape[0], -1).to(torch.int32)
