"""Fused routed-expert MLP through the expert table (the pointer-table MoE).

Each (token, k) routing choice is an *assignment*; A = T * k of them per step.
The step runs without a host sync:

1. group: the A assignments sorted by expert (stable) and a tile map: tile
   i -> (expert, first sorted row, end row). Up to GROUP_FUSED_MAX assignments
   (decode batches) one program does it all by counting (`_moe_group_kernel`);
   above, `torch.sort` of the ids and one program (`_moe_align_kernel`) that
   turns the sorted ids into the tile map. The number of tiles is bounded on the
   host by A // BLOCK_M + min(E, A), so the grid is fixed by the shapes
   (graph-capturable); tiles past the real count exit at once.
2. gate/up: per (tile, column block of I), `silu(x @ gate^T) * (x @ up^T)` for
   the tile's tokens, stored in sorted order [A, I].
3. down: per (tile, column block of H), `h @ down^T`, scaled by the routing
   weight and added into the token's output row: fp32 atomics by default, or,
   `deterministic=True`, stored per assignment and summed over k in order.

At T == 1 (decode at batch 1) step 1 is skipped: the k experts are distinct, so
tile i is simply assignment i, and the ordered sum replaces the atomics,
whichever was asked for; the down launch does that sum itself (the last of a
column block's k programs to finish, kernels/arrival.py): 2 launches in all.
GGUF experts at few assignments an expert (`moe_config`'s few-rows path) skip
step 1 too: one assignment a tile, through `weight_tiles.gguf_rows_products`.

`route_moe` takes the router's logits instead of its ids and weights: `route`
then `moe`, except at T == 1 with E <= ROUTE_FUSED_MAX_EXPERTS, where there is
no route launch: every gate/up program ranks the E logits itself and takes the
expert of rank `tile` (router.py `expert_of_rank`), and program (tile, 0) stores
that id and its weight, the ids and weights `route` would have returned, bit
for bit, for the down launch to read and the caller to record.

Weights are read through a per-expert base address, the only way the kernels
reach them: `slab + table[e] * row_stride` for table[e] >= 0 and
`host + (-1 - table[e]) * row_stride` for table[e] < 0 (`moe`: the table of
`tiers/slab.py`, VRAM slots and the pinned host pool), or the raw address
`expert_ptr[e]` (`moe_ptr`: DESIGN.md's pointer table). A row is gate [I, H] |
up [I, H] | down [H, I] in the activation dtype, or, with a `weight_format`, one
compact extent as the `.rad` stores it (kernels/formats.py: the same three
pieces, each with its scales inside), read as bytes and dequantized in registers
(kernels/weight_tiles.py `weight_tile`, the format a constexpr: one kernel family, a specialization per
format). Each weight tile is dequantized in fp32 as `dequant.py` does, then
rounded to the activations' dtype for the dot, as the reference rounds a
dequantized weight; the bytes read per expert are the compact extent's. The
few-rows path (GGUF experts, `moe_config`) does not round: fp32 FMAs
(`weight_tiles.gguf_rows_products`), one assignment a tile, so an expert routed
R times in a step is read R times; it is chosen only while few experts repeat
(FMA_ROWS_PER_EXPERT, and far fewer where experts may be read over the link).

Otherwise BLOCK_M is next_pow2(T) up to 64. An expert serves at most T tokens
(one per token), so for T <= 64 each expert is one tile and every weight byte is
read exactly once per step; over PCIe this is DESIGN.md's "weights cross the link
once per step". Above 64 tokens (prefill) an expert's weights are read once per
64-token tile, from VRAM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radianced.kernels import arrival, pdl, router, stage
from radianced.kernels.formats import COMPACT_TILES, FORMATS, expert_formats
from radianced.kernels.weight_tiles import GGUF_TILES, PLAIN_TILES, gguf_rows_products, weight_tile

# Experts up to which `route_moe` ranks them inside the gate/up programs at T == 1. Ranking is E^2
# comparisons in every program, before its weight loads: at 4 warps 128 a thread for E = 128
# (Qwen3-MoE), 512 for E = 256, 2048 for E = 512 (Qwen3-Next), likely more than the route launch
# it would save; larger routers keep that launch. A guess from the counts, not measured.
ROUTE_FUSED_MAX_EXPERTS = 256
# Expert formats `weight_tile` dequantizes (kernels/formats.py); a byte slab may also hold plain layers.
KERNEL_FORMATS = COMPACT_TILES + PLAIN_TILES
# Assignments (T * k) up to which one counting-sort program groups them; above, torch.sort.
GROUP_FUSED_MAX = 1024
# (assignments per chunk, tiles per chunk, warps) of the grouping programs. On the H200 the counting
# sort took 25-28 us at T = 32 (k = 8) for chunks of 32 to 128 and 4 or 8 warps (tools/bench_kernels.py).
GROUP_LAUNCH = (64, 64, 4)
# GGUF experts take the few-rows path (`gguf_rows_products`: no tensor cores, one assignment a tile) while a step
# routes at most this many assignments an expert on average (T * k <= it * E); above, the tensor-core tiles. On
# the H200 (tools/sweep_moe_compact.py, Qwen3-Next's 512 experts, top-10, T = 1 to 17: about 1 assignment an
# expert, every expert in VRAM) the path took 0.47x the tensor-core tiles' time at T = 1 and 0.30x at T = 17
# (q4_0; q8_0 0.25x, 0.22x), and one row a tile beat two and four at every T. It reads an expert once for each
# of its rows (from VRAM, mostly L2) where a tensor-core tile reads it once but pays ~3.3x the instructions a
# value: even near 3 (an estimate from those counts; no T with more rows an expert was measured).
FMA_ROWS_PER_EXPERT = 3.0
# The same where the table may name host rows (a host pool, or raw addresses): there a repeated expert crosses the
# link again, the bytes the tiers exist to save. At T * k <= E / 4 a step repeats few (~7% of the assignments at
# Qwen3-Next's b8, 12% at Qwen3-30B-A3B's b4, for uniform routing), and T = 1 none.
FMA_ROWS_PER_EXPERT_LINK = 0.25

# -- heuristics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # assignments per tile (rows)
    block_n_up: int  # columns of I per gate/up program
    block_k_up: int  # reduction step over H
    block_n_down: int  # columns of H per down program
    block_k_down: int  # reduction step over I
    num_warps: int
    num_stages: int
    fma: bool = False  # GGUF pieces through `gguf_rows_products`: one assignment a tile, nothing sorted


def moe_config(num_tokens: int, dtype: torch.dtype, gate_up: str = "", down: str = "", top_k: int | None = None,
               num_experts: int | None = None, link: bool = False) -> MoEConfig:
    """Small T (decode) is a weight stream: narrow column blocks give enough programs to fill the
    GPU with loads in flight; large T (prefill) uses square-ish tiles for the tensor cores.

    gate_up, down: the pieces' formats (`ExtentLayout`); top_k, num_experts: the routing's, which choose
    the few-rows path for GGUF pieces (FMA_ROWS_PER_EXPERT, or FMA_ROWS_PER_EXPERT_LINK with `link`: the
    table may name host rows; without them, never). Otherwise, at decode a GGUF piece (GGUF_TILES) takes
    32 columns x 256 values of K a step instead of 64 x 128: the same 8,192 values a tile (the
    registers of its dequantized fp32 values, 64 a thread at 4 warps, as the bf16 tile's), but half
    the K steps, each loading 2x the blocks (a 256-wide step is 8 q4 blocks a row: 144-160 bytes,
    where 128 values of bf16 are 256) and twice the programs along N (Qwen3-30B-A3B at T = 1: 192
    gate/up programs for the H200's 132 SMs, not 96). Shared memory (estimated; 227 KB on an H100 /
    H200): the pipeliner keeps num_stages - 1 buffers of each load it prefetches (which the fp8_b128
    failure at 258 KB fits: [64, 128] fp32 scale gathers, values and x, 84 KB a stage x 3, and
    scratch), and weight_tiles.py loads every GGUF byte in 4-byte words (q8_0's 34-byte blocks as 17
    words, q4_0's 18 as 9, q4_1's 20 as 5). The worst, q8_0 at 32 rows with bf16 x: x 16 KB and
    gate's and up's words 34 KB a stage, x 3 = 150 KB, plus 32 KB to convert the two dequantized
    tiles for the dot: ~182 KB; fp32 x (32 KB a stage, 64 KB of fp32 tiles) keeps 3 stages: ~196
    KB. fp8_b128 keeps 128-wide steps (one scale a row a step). Measured on the H200 with the block-wise
    tensor-core tiles (tests/gpu/test_moe_compact_gpu.py, bench/README session 13; the config and the tiles
    changed together): T = 1 q8_0 1.08x, q4_0 0.92x, q4_1 0.92x of bf16's speed, T = 32 0.20x, 0.35x, 0.61x
    (Qwen3-30B-A3B's widths; at Qwen3-Next's, session 23, q4_0 at T = 1 took 2.8x bf16's time)."""
    per_expert = FMA_ROWS_PER_EXPERT_LINK if link else FMA_ROWS_PER_EXPERT
    if gate_up in GGUF_TILES and down in GGUF_TILES and top_k is not None and num_experts is not None \
            and (num_tokens == 1 or num_tokens * top_k <= per_expert * num_experts):
        # 16 columns x 256 values a program, one row a tile, 4 warps: the H200's fastest of the sweep's variants
        # for q4_0 and q8_0 at every T but one (q4_0 at T = 17: 128-value steps 2% faster); 32 columns took
        # 1.03-1.16x its time, 64 columns 1.15-1.9x
        return MoEConfig(1, 16, 256, 16, 256, num_warps=4, num_stages=1, fma=True)
    block_m = min(64, max(16, triton.next_power_of_2(max(num_tokens, 1))))
    wide = dtype == torch.float32  # fp32 tiles take twice the shared memory
    if block_m <= 32:
        up = (32, 256) if gate_up in GGUF_TILES else (64, 128)
        dn = (32, 256) if down in GGUF_TILES else (64, 128)
        return MoEConfig(block_m, *up, *dn, num_warps=4, num_stages=3 if wide else 4)
    return MoEConfig(block_m, 64, 64, 64, 64, num_warps=4, num_stages=2 if wide else 3)


def max_tiles(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(count_e / BLOCK_M) over any routing of A assignments."""
    return num_assignments // block_m + min(num_experts, num_assignments)


@dataclass(frozen=True)
class ExtentLayout:
    """Where an expert row holds its three matrices, and in which format (the kernels' FMT).

    gate_up, down: the FMT of gate and up, and of down: "" for a slab in the activations' dtype,
        else a `.rad` format name (`formats.expert_formats` of the extent's format).
    up_offset, down_offset: where up and down start in the row, in the slab's elements (bytes of
        a byte slab).
    size: the row's elements the extent takes (3 * I * H, or the compact extent's bytes).
    """

    gate_up: str
    down: str
    up_offset: int
    down_offset: int
    size: int


def extent_layout(weight_format: str | None, inter: int, hidden: int) -> ExtentLayout:
    """The layout of an extent of `weight_format` (None: gate | up | down in the activations' dtype);
    ValueError naming a format the kernels do not read or a shape it does not fit."""
    if weight_format is None:
        n = inter * hidden
        return ExtentLayout("", "", n, 2 * n, 3 * n)
    gate_up, down = expert_formats(weight_format)
    for f in dict.fromkeys((gate_up, down)):
        if f not in KERNEL_FORMATS:
            raise ValueError(f"expert format {weight_format!r}: the Triton MoE reads {', '.join(KERNEL_FORMATS)}, "
                             f"not {f} (convert with --quantize experts=int8, int4 or fp8)")
    piece = FORMATS[gate_up].nbytes((inter, hidden))
    return ExtentLayout(gate_up, down, piece, 2 * piece, 2 * piece + FORMATS[down].nbytes((hidden, inter)))


# -- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _lower_bound(sorted_ptr, n, target, steps):
    """For each lane, the first index i in [0, n) with sorted[i] >= target (n if none)."""
    lo = tl.zeros(target.shape, tl.int32)
    hi = tl.zeros(target.shape, tl.int32) + n
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        val = tl.load(sorted_ptr + mid, mask=active, other=0)
        right = active & (val < target)
        left = active & (val >= target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(left, mid, hi)
    return lo


@triton.jit
def _write_tile_info(tile_info_ptr, start, end, num_experts, num_tiles,
                     BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per-expert sorted row ranges [start, end) ([BLOCK_E] each) -> tile_info [num_tiles, 3]."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    tiles = tl.where(e_ok, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    for t0 in range(0, num_tiles, BLOCK_T):
        i = t0 + tl.arange(0, BLOCK_T)
        # tile i belongs to the first expert whose tiles end after it
        owner = tl.sum((e_ok[None, :] & (tile_end[None, :] <= i[:, None])).to(tl.int32), 1)  # [BLOCK_T]
        pick = e[None, :] == owner[:, None]
        first_tile = tl.sum(tl.where(pick, tile_start[None, :], 0), 1)
        row_lo = tl.sum(tl.where(pick, start[None, :], 0), 1) + (i - first_tile) * BLOCK_M
        row_hi = tl.sum(tl.where(pick, end[None, :], 0), 1)
        valid = owner < num_experts
        i_ok = i < num_tiles
        tl.store(tile_info_ptr + i * 3, tl.where(valid, owner, -1), mask=i_ok)
        tl.store(tile_info_ptr + i * 3 + 1, tl.where(valid, row_lo, 0), mask=i_ok)
        tl.store(tile_info_ptr + i * 3 + 2, tl.where(valid, tl.minimum(row_hi, row_lo + BLOCK_M), 0), mask=i_ok)


@triton.jit(do_not_specialize=["num_assignments", "num_tiles"])
def _moe_group_kernel(ids_ptr, order_ptr, tile_info_ptr, num_assignments, num_experts, num_tiles,
                      BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                      PDL: tl.constexpr):
    """One program, a stable counting sort: ids [A] -> order [A] (sorted row -> assignment), tile_info.

    Two passes over the ids in chunks of BLOCK_A (count, then place); no dependent
    loads, so a decode batch's grouping costs a few microseconds.
    """
    pdl.wait(PDL)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for a0 in range(0, num_assignments, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        ids = tl.load(ids_ptr + a, mask=a < num_assignments, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)
    start = tl.cumsum(counts, 0) - counts
    next_row = start  # [BLOCK_E] the next free sorted row of each expert
    for a0 in range(0, num_assignments, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        a_ok = a < num_assignments
        ids = tl.load(ids_ptr + a, mask=a_ok, other=-1)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)  # [BLOCK_A, BLOCK_E]
        earlier = tl.cumsum(hit, 0) - hit  # same-expert assignments earlier in this chunk
        row = tl.sum(hit * (next_row[None, :] + earlier), 1)  # [BLOCK_A]
        tl.store(order_ptr + row, a.to(tl.int64), mask=a_ok)
        next_row += tl.sum(hit, 0)
    _write_tile_info(tile_info_ptr, start, start + counts, num_experts, num_tiles, BLOCK_E, BLOCK_T, BLOCK_M)


@triton.jit(do_not_specialize=["num_assignments", "num_tiles", "search_steps"])
def _moe_align_kernel(sorted_ids_ptr, tile_info_ptr, num_assignments, num_experts, num_tiles, search_steps,
                      BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """One program: sorted expert ids [A] -> tile_info [num_tiles, 3] = (expert or -1, row lo, row hi)."""
    pdl.wait(PDL)
    e = tl.arange(0, BLOCK_E)
    start = _lower_bound(sorted_ids_ptr, num_assignments, e.to(tl.int64), search_steps)  # [BLOCK_E]
    end = _lower_bound(sorted_ids_ptr, num_assignments, (e + 1).to(tl.int64), search_steps)
    _write_tile_info(tile_info_ptr, start, end, num_experts, num_tiles, BLOCK_E, BLOCK_T, BLOCK_M)


@triton.jit
def _expert_base(w_ptr, table_ptr, expert, stride_row, host_ptr, stride_host_row,
                 TABLE_IS_PTR: tl.constexpr, HAS_HOST: tl.constexpr):
    """Pointer to expert `expert`'s row: a raw address from the table, or the slab row it names
    (entry >= 0), or, HAS_HOST, host pool row -1 - entry (entry < 0: read over the link)."""
    entry = tl.load(table_ptr + expert)
    if TABLE_IS_PTR:
        # the caller promises 16-byte aligned rows; the hint lets loads vectorize and pipeline
        return tl.multiple_of(entry.to(tl.pointer_type(w_ptr.dtype.element_ty)), 16)
    if HAS_HOST:
        return tl.where(entry >= 0, w_ptr + entry * stride_row, host_ptr + (-1 - entry) * stride_host_row)
    return w_ptr + entry * stride_row


@triton.jit
def _assignment_rows(tile, BLOCK_M: tl.constexpr):
    """(rows [BLOCK_M], their mask, their assignments) of tile i = assignment i: one row."""
    rows = tile + tl.arange(0, BLOCK_M)
    return rows, rows < tile + 1, rows.to(tl.int64)


@triton.jit
def _tile_rows(tile_info_ptr, order_ptr, tile, BLOCK_M: tl.constexpr, PER_ASSIGNMENT: tl.constexpr):
    """(expert or -1, sorted rows [BLOCK_M], their mask, their assignments t * k + j) of one tile.

    PER_ASSIGNMENT (T == 1, where no expert repeats, or the few-rows path): tile i is assignment i
    and tile_info_ptr points at the flat expert ids [A]; nothing was sorted.
    """
    if PER_ASSIGNMENT:
        expert = tl.load(tile_info_ptr + tile).to(tl.int32)
        rows, row_ok, assignment = _assignment_rows(tile, BLOCK_M)
    else:
        expert = tl.load(tile_info_ptr + tile * 3)
        row_lo = tl.load(tile_info_ptr + tile * 3 + 1)
        row_hi = tl.load(tile_info_ptr + tile * 3 + 2)
        rows = row_lo + tl.arange(0, BLOCK_M)
        row_ok = rows < row_hi
        assignment = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    return expert, rows, row_ok, assignment


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, table_ptr, order_ptr, tile_info_ptr, h_ptr, host_ptr, logits_ptr, topk_weights_ptr,
    hidden, inter, top_k, num_experts, stride_x, stride_row, stride_host_row, up_offset,
    TABLE_IS_PTR: tl.constexpr, HAS_HOST: tl.constexpr, PER_ASSIGNMENT: tl.constexpr, FMT: tl.constexpr,
    ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FMA: tl.constexpr, PDL: tl.constexpr,
):
    """h[row, n] = silu(x[tok] . gate[n]) * (x[tok] . up[n]) for the tile's sorted rows; h: [A, I].
    gate [I, H] starts the expert's row, up [I, H] `up_offset` further (elements of w_ptr), both in FMT
    (`weight_tile`), rounded to x's dtype for the dot as the reference rounds a dequantized weight (FMA:
    `gguf_rows_products`, not rounded). ROUTE (T == 1): tile i's expert is the one of rank i among the
    logits [E] (`route`'s order), and program (i, 0) stores it to tile_info_ptr[i] (the ids [k] the down
    launch reads) and its weight to topk_weights_ptr[i]."""
    pdl.wait(PDL)
    tile = tl.program_id(0)
    if ROUTE:
        expert = router.expert_of_rank(logits_ptr, tile_info_ptr, topk_weights_ptr, tile, num_experts, top_k,
                                       tl.program_id(1) == 0, RENORMALIZE, BLOCK_E, BLOCK_C)
        rows, row_ok, assignment = _assignment_rows(tile, BLOCK_M)
    else:
        expert, rows, row_ok, assignment = _tile_rows(tile_info_ptr, order_ptr, tile, BLOCK_M, PER_ASSIGNMENT)
    if expert < 0:
        return
    tok = assignment // top_k
    base = _expert_base(w_ptr, table_ptr, expert, stride_row, host_ptr, stride_host_row,
                        TABLE_IS_PTR, HAS_HOST)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    if FMA:  # few rows of a GGUF expert: no tensor cores, the products summed after the loop
        x_rows = x_ptr + tok.to(tl.int64) * stride_x
        part_gate = gguf_rows_products(base, n, 0, x_rows, row_ok, inter, hidden, FMT, BLOCK_K // 32)
        part_up = gguf_rows_products(base + up_offset, n, 0, x_rows, row_ok, inter, hidden, FMT, BLOCK_K // 32)
        for k0 in range(BLOCK_K, hidden, BLOCK_K):
            part_gate += gguf_rows_products(base, n, k0, x_rows, row_ok, inter, hidden, FMT, BLOCK_K // 32)
            part_up += gguf_rows_products(base + up_offset, n, k0, x_rows, row_ok, inter, hidden, FMT, BLOCK_K // 32)
        acc_gate = tl.sum(tl.sum(part_gate, 3), 2)
        acc_up = tl.sum(tl.sum(part_up, 3), 2)
    else:
        x_row = x_ptr + tok[:, None].to(tl.int64) * stride_x
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            x = tl.load(x_row + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w_mask = n_ok[:, None] & k_ok[None, :]
            wg = weight_tile(base, n, k, w_mask, inter, hidden, FMT).to(x.dtype)  # [BLOCK_N, BLOCK_K]
            wu = weight_tile(base + up_offset, n, k, w_mask, inter, hidden, FMT).to(x.dtype)
            acc_gate = tl.dot(x, tl.trans(wg), acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=DOT_PRECISION)
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, table_ptr, order_ptr, tile_info_ptr, topk_weights_ptr, out_ptr, host_ptr,
    residual_ptr, sum_ptr, counter_ptr, hidden, inter, top_k,
    stride_row, stride_host_row, stride_res, down_offset,
    TABLE_IS_PTR: tl.constexpr, HAS_HOST: tl.constexpr, PER_ASSIGNMENT: tl.constexpr, FMT: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    SUM_LAST: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FMA: tl.constexpr, PDL: tl.constexpr,
):
    """y = weight * (h[row] . down[n]) (down [H, I] `down_offset` into the expert's row, in FMT; FMA: the
    few-rows path, `gguf_rows_products`);
    atomically added to out[tok] (fp32 [T, H]), or, DETERMINISTIC, stored to out[assignment]
    (fp32 [A, H]) for an ordered sum over k afterwards. SUM_LAST (T == 1, PER_ASSIGNMENT and
    DETERMINISTIC): the last of the k programs of a column block to finish does that sum for the
    block (`_sum_rows`, the residual added) into sum_ptr ([1, H], x's dtype)."""
    pdl.wait(PDL)
    expert, rows, row_ok, assignment = _tile_rows(tile_info_ptr, order_ptr, tl.program_id(0), BLOCK_M,
                                                  PER_ASSIGNMENT)
    if expert < 0:
        return
    base = _expert_base(w_ptr, table_ptr, expert, stride_row, host_ptr, stride_host_row,
                        TABLE_IS_PTR, HAS_HOST)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    if FMA:  # few rows of a GGUF expert: no tensor cores, the products summed after the loop
        h_rows = h_ptr + rows.to(tl.int64) * inter
        part = gguf_rows_products(base + down_offset, n, 0, h_rows, row_ok, hidden, inter, FMT, BLOCK_K // 32)
        for k0 in range(BLOCK_K, inter, BLOCK_K):
            part += gguf_rows_products(base + down_offset, n, k0, h_rows, row_ok, hidden, inter, FMT, BLOCK_K // 32)
        acc = tl.sum(tl.sum(part, 3), 2)
    else:
        h_row = h_ptr + rows[:, None].to(tl.int64) * inter
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            h = tl.load(h_row + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = weight_tile(base + down_offset, n, k, n_ok[:, None] & k_ok[None, :], hidden, inter, FMT).to(h.dtype)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
    weight = tl.load(topk_weights_ptr + assignment, mask=row_ok, other=0.0).to(tl.float32)
    y = acc * weight[:, None]
    mask = row_ok[:, None] & n_ok[None, :]
    if DETERMINISTIC:
        tl.store(out_ptr + assignment[:, None] * hidden + n[None, :], y, mask=mask)
        if SUM_LAST:
            if arrival.last_arrival(counter_ptr + tl.program_id(1), top_k):
                _sum_rows(out_ptr, residual_ptr, sum_ptr, 0, n, n_ok, hidden, top_k, stride_res, HAS_RESIDUAL)
    else:
        tok = assignment // top_k
        tl.atomic_add(out_ptr + tok[:, None] * hidden + n[None, :], y, mask=mask, sem="relaxed")


@triton.jit
def _moe_sum_kernel(y_ptr, residual_ptr, out_ptr, hidden, top_k, stride_res,
                    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum_j y[t * k + j] for j = 0 .. k-1, in that order (fp32 accumulate), rounded to
    out's dtype; with a residual, out[t] = round(residual[t] + that rounded sum), as `x + moe(x)`
    rounds in torch."""
    pdl.wait(PDL)
    n = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _sum_rows(y_ptr, residual_ptr, out_ptr, tl.program_id(0).to(tl.int64), n, n < hidden, hidden, top_k, stride_res,
              HAS_RESIDUAL)


@triton.jit
def _sum_rows(y_ptr, residual_ptr, out_ptr, t, n, n_ok, hidden, top_k, stride_res, HAS_RESIDUAL: tl.constexpr):
    """out[t, n] = round(sum_j y[t * k + j, n]) (j in order, fp32), plus residual[t, n] rounded again.
    y is read from L2 (`.cg`): other programs of the launch may have just written it."""
    acc = tl.zeros(n.shape, tl.float32)
    for j in range(top_k):
        acc += tl.load(y_ptr + (t * top_k + j) * hidden + n, mask=n_ok, other=0.0, cache_modifier=".cg")
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_res + n, mask=n_ok, other=0.0)
        out = (r.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * hidden + n, out, mask=n_ok)


# -- launchers -------------------------------------------------------------------------------------


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    fused_max: int = GROUP_FUSED_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the T * k assignments by expert on the device (no host sync).

    topk_ids: [T, k], ids in [0, E). Returns order: [A] int64, the assignments
    (t * k + j) sorted by expert, stable; and tile_info: [max_tiles(A, E, block_m), 3]
    int32, one row per tile of at most block_m sorted rows of one expert:
    (expert, first row, end row), then rows (-1, 0, 0) past the last real tile.
    Up to `fused_max` assignments one counting-sort program does it; above, torch.sort.
    """
    block_a, block_t, warps = GROUP_LAUNCH
    a = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    tiles = max_tiles(a, num_experts, block_m)
    tile_info = torch.empty((tiles, 3), dtype=torch.int32, device=topk_ids.device)
    block_e = triton.next_power_of_2(num_experts)
    if a <= fused_max:
        order = torch.empty(a, dtype=torch.int64, device=topk_ids.device)
        _moe_group_kernel[(1,)](ids, order, tile_info, a, num_experts, tiles, BLOCK_A=block_a, BLOCK_E=block_e,
                                BLOCK_T=block_t, BLOCK_M=block_m, num_warps=warps, **pdl.launch(topk_ids.device, 1))
        return order, tile_info
    sorted_ids, order = torch.sort(ids, stable=True)
    _moe_align_kernel[(1,)](sorted_ids, tile_info, a, num_experts, tiles, max(1, a.bit_length()),
                            BLOCK_E=block_e, BLOCK_T=block_t, BLOCK_M=block_m, num_warps=warps,
                            **pdl.launch(topk_ids.device, 1))
    return order, tile_info


def _launch_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
                w_ref: torch.Tensor, stride_row: int, table_is_ptr: bool, inter: int, deterministic: bool,
                layout: ExtentLayout, cfg: MoEConfig | None = None, host: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                renormalize: bool = False) -> torch.Tensor:
    """The launches of `moe`. With `logits` ([1, E], T == 1) the gate/up programs route: they write
    topk_ids and topk_weights ([1, k], contiguous) instead of reading them (`route_moe`)."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = table.shape[0]
    a = t * top_k
    cfg = cfg or moe_config(t, x.dtype, layout.gate_up, layout.down, top_k, num_experts,
                            link=host is not None or table_is_ptr)
    if cfg.fma and cfg.block_m != 1:
        raise ValueError(f"the few-rows path takes one assignment a tile, not block_m {cfg.block_m}")
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    dev = x.device

    sum_last = t == 1  # decode at batch 1: k distinct experts, one tile each, the down launch sums them
    # one tile an assignment, nothing to sort: at T == 1, and on the few-rows path (one row a tile, and about
    # one an expert: grouping would only order the tiles, and its one-program sort cost 69 us a layer on the
    # H200 at Qwen3-Next's 512 experts and 170 assignments)
    per_assignment = sum_last or cfg.fma
    if per_assignment:
        tile_info = order = topk_ids.reshape(-1)
        tiles = a
        deterministic = deterministic or sum_last  # the ordered sum is the cheaper reduction at T == 1
    else:
        order, tile_info = group_by_expert(topk_ids, num_experts, cfg.block_m)
        tiles = tile_info.shape[0]
    weights = topk_weights.reshape(-1)
    route = logits is not None
    block_e = triton.next_power_of_2(num_experts) if route else 1
    h = torch.empty((a, inter), dtype=x.dtype, device=dev)  # sorted rows
    up_blocks = triton.cdiv(inter, cfg.block_n_up)
    _moe_gate_up_kernel[(tiles, up_blocks)](
        x, w_ref, table, order, tile_info, h, w_ref if host is None else host, logits if route else x, weights,
        hidden, inter, top_k, num_experts, x.stride(0), stride_row, 0 if host is None else host.stride(0),
        layout.up_offset, TABLE_IS_PTR=table_is_ptr, HAS_HOST=host is not None, PER_ASSIGNMENT=per_assignment,
        FMT=layout.gate_up, ROUTE=route, RENORMALIZE=renormalize, BLOCK_E=block_e,
        BLOCK_C=min(block_e, router.ROUTE_CHUNK // block_e),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k_up,
        DOT_PRECISION=precision, FMA=cfg.fma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch(dev, tiles * up_blocks))
    if deterministic:
        y = torch.empty((a, hidden), dtype=torch.float32, device=dev)  # every row written: one per assignment
    else:
        y = torch.zeros((t, hidden), dtype=torch.float32, device=dev)
    column_blocks = triton.cdiv(hidden, cfg.block_n_down)
    scattered = not deterministic and residual is None  # the fp32 rows the atomics leave are the result
    out = y if scattered else torch.empty_like(x)
    _moe_down_kernel[(tiles, column_blocks)](
        h, w_ref, table, order, tile_info, weights, y, w_ref if host is None else host,
        out if residual is None else residual, out, arrival.counters(dev, column_blocks) if sum_last else y,
        hidden, inter, top_k, stride_row, 0 if host is None else host.stride(0),
        0 if residual is None else residual.stride(0), layout.down_offset,
        TABLE_IS_PTR=table_is_ptr, HAS_HOST=host is not None, PER_ASSIGNMENT=per_assignment, FMT=layout.down,
        DETERMINISTIC=deterministic, SUM_LAST=sum_last, HAS_RESIDUAL=residual is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down,
        DOT_PRECISION=precision, FMA=cfg.fma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch(dev, tiles * column_blocks))
    if sum_last:
        return out
    if scattered:
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    # the ordered sum over k (deterministic), or over the one scattered row (k = 1), plus the residual
    block_h = min(1024, triton.next_power_of_2(hidden))
    sum_blocks = triton.cdiv(hidden, block_h)
    _moe_sum_kernel[(t, sum_blocks)](
        y, out if residual is None else residual, out, hidden, top_k if deterministic else 1,
        0 if residual is None else residual.stride(0), HAS_RESIDUAL=residual is not None, BLOCK_H=block_h,
        num_warps=4, **pdl.launch(dev, t * sum_blocks))
    return out


# -- public ops ------------------------------------------------------------------------------------


def _check_x(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not supported (bf16, fp16, fp32)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or residual.stride(1) != 1):
        raise ValueError(f"residual must be like x ({tuple(x.shape)} {x.dtype} on {x.device}, contiguous rows), "
                         f"got {tuple(residual.shape)} {residual.dtype} on {residual.device} "
                         f"strides {residual.stride()}")


def _check_table(x: torch.Tensor, table: torch.Tensor, table_name: str) -> None:
    if table.dim() != 1 or table.dtype != torch.int64:
        raise ValueError(f"{table_name} must be [E] int64, got shape {tuple(table.shape)} dtype {table.dtype}")
    if table.device != x.device:
        raise ValueError(f"{table_name} is on {table.device}, x on {x.device}")


def _check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={x.shape[0]}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")


def _check_row_size(layout: ExtentLayout) -> None:
    if layout.size >= 2 ** 31:
        raise ValueError(f"an expert row of {layout.size} elements is over the kernels' 2^31 offset limit")


def _check_slab(x: torch.Tensor, slab: torch.Tensor, host: torch.Tensor | None, inter: int,
                layout: ExtentLayout, weight_format: str | None) -> None:
    hidden = x.shape[1]
    if layout.gate_up == "":
        if slab.dim() != 2 or slab.shape[1] != 3 * inter * hidden or slab.stride(1) != 1:
            raise ValueError(f"slab must be [R, 3 * I * H] = [R, {3 * inter * hidden}] with contiguous rows, "
                             f"got {tuple(slab.shape)} strides {slab.stride()}")
        if slab.dtype != x.dtype or slab.device != x.device:
            raise ValueError(f"slab is {slab.dtype} on {slab.device}; x is {x.dtype} on {x.device}")
    else:  # a byte slab: one extent at the start of each row, rows 16-byte aligned for the scales' loads
        if slab.dim() != 2 or slab.dtype != torch.uint8 or slab.shape[1] < layout.size or slab.stride(1) != 1 \
                or slab.stride(0) % 16:
            raise ValueError(f"a slab of {weight_format} extents must be uint8 [R, >= {layout.size}] (an extent's "
                             f"bytes at I = {inter}, H = {hidden}) with contiguous rows 16 bytes apart, got "
                             f"{slab.dtype} {tuple(slab.shape)} strides {slab.stride()}")
        if slab.device != x.device:
            raise ValueError(f"slab is on {slab.device}; x on {x.device}")
    if host is not None:
        if host.dim() != 2 or host.shape[1] != slab.shape[1] or host.stride(1) != 1 or host.dtype != slab.dtype \
                or layout.gate_up != "" and host.stride(0) % 16:
            raise ValueError(f"host must be [R', {slab.shape[1]}] {slab.dtype} with contiguous rows like slab, "
                             f"got {tuple(host.shape)} {host.dtype} strides {host.stride()}")
        if x.device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
            raise ValueError("host is pageable CPU memory; the kernels read it over the link only when it is "
                             "pinned (allocate the host pool with pin_memory=True)")
    _check_row_size(layout)


def _empty_result(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The result for T = 0 tokens."""
    return torch.zeros_like(x) if residual is None else residual.clone()


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
        slab: torch.Tensor, inter: int, host: torch.Tensor | None = None, *,
        deterministic: bool = False, residual: torch.Tensor | None = None,
        weight_format: str | None = None, staging: torch.Tensor | None = None) -> torch.Tensor:
    """Routed SiLU experts read through the expert table (Triton); contract of `reference.moe`.

    x: [T, H] (bf16, fp16 or fp32); topk_ids: [T, k] int, every id in [0, E);
    topk_weights: [T, k]; table: [E] int64: entry >= 0 is a row of slab (a VRAM
    slot), entry < 0 is row -1 - entry of host (the host pool, read by the kernels
    over the link: pinned host memory, or any memory the device can address);
    slab, host: [R, 3 * I * H] in x's dtype, a row = gate [I, H] | up [I, H] |
    down [H, I] (rows contiguous). Returns [T, H] in x's dtype:
    sum_j topk_weights[t, j] * down(silu(gate(x[t])) * up(x[t])) of expert topk_ids[t, j].
    `deterministic` replaces the atomic scatter-add with a per-assignment buffer
    summed over k in order (bitwise reproducible; [T * k, H] fp32 of workspace).
    `residual` ([T, H] like x): returns `residual + result` (each rounded to x's
    dtype, as torch rounds `x + moe(x)`) in the same launch as the final sum.
    `weight_format` (`formats.expert_formats`: q8_0, q4_0, q4_1, fp8_b128, or two of
    them, gate/up + down) says slab and host are uint8 rows of compact extents, as the
    `.rad` stores them (rows may be wider than one extent; 16-byte aligned): the
    kernels dequantize each weight tile in registers (`weight_tile`).
    `staging` (uint8 [R, W] on x's device, `stage.stage_misses`): where the format's in-place
    reads are slow (`stage.wanted`: GGUF experts, decode batches) the routed host experts are
    copied there first, up to R of them, and read from it: the same result, bit for bit.
    No host sync; the table may change between calls.
    """
    _check_x(x, residual)
    _check_routing(x, topk_ids, topk_weights)
    _check_table(x, table, "table")
    layout = extent_layout(weight_format, inter, x.shape[1])
    _check_slab(x, slab, host, inter, layout, weight_format)
    if x.shape[0] == 0:
        return _empty_result(x, residual)
    if stage.wanted(topk_ids.numel(), host, staging, weight_format):
        table = stage.stage_misses(topk_ids, table, slab, host, staging)
        return _launch_moe(x, topk_ids, topk_weights.contiguous(), table, slab, 0, True, inter, deterministic,
                           layout, residual=residual)
    return _launch_moe(x, topk_ids, topk_weights.contiguous(), table, slab, slab.stride(0), False, inter,
                       deterministic, layout, host=host, residual=residual)


def route_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, table: torch.Tensor,
              slab: torch.Tensor, inter: int, host: torch.Tensor | None = None, *, deterministic: bool = False,
              residual: torch.Tensor | None = None, weight_format: str | None = None,
              staging: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`router.route` then `moe` (Triton); contract of `reference.route_moe`.

    logits: [T, E] router logits (rows with a unit last stride, on x's device), E
    the table's length, E <= router.MAX_EXPERTS, 1 <= top_k <= E. Other arguments
    as in `moe`. Returns (out [T, H] as `moe` returns it, ids [T, k] int64, weights
    [T, k] in x's dtype) with ids and weights those `route(logits, top_k,
    renormalize, x.dtype)` returns, bit for bit. At T == 1 with E <=
    ROUTE_FUSED_MAX_EXPERTS there is no route launch: the gate/up launch ranks the
    logits and writes ids and weights, which are ready only once the experts'
    launches have run (stream order; nothing here waits for them); a step that stages its
    misses (`staging`, as in `moe`) routes first. No host sync.
    """
    _check_x(x, residual)
    _check_table(x, table, "table")
    router.check_logits(logits, top_k)
    if logits.shape != (x.shape[0], table.shape[0]) or logits.device != x.device:
        raise ValueError(f"logits must be [T, E] = [{x.shape[0]}, {table.shape[0]}] (x's rows, the table's "
                         f"experts) on {x.device}, got {tuple(logits.shape)} on {logits.device}")
    if x.shape[0] != 1 or table.shape[0] > ROUTE_FUSED_MAX_EXPERTS \
            or stage.wanted(top_k, host, staging, weight_format):
        ids, weights = router.route(logits, top_k, renormalize, x.dtype)
        return moe(x, ids, weights, table, slab, inter, host, deterministic=deterministic, residual=residual,
                   weight_format=weight_format, staging=staging), ids, weights
    layout = extent_layout(weight_format, inter, x.shape[1])
    _check_slab(x, slab, host, inter, layout, weight_format)
    ids = torch.empty((1, top_k), dtype=torch.int64, device=x.device)
    weights = torch.empty((1, top_k), dtype=x.dtype, device=x.device)
    out = _launch_moe(x, ids, weights, table, slab, slab.stride(0), False, inter, deterministic, layout, host=host,
                      residual=residual, logits=logits, renormalize=renormalize)
    return out, ids, weights


def moe_ptr(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_ptr: torch.Tensor,
            inter: int, *, deterministic: bool = False, residual: torch.Tensor | None = None,
            weight_format: str | None = None) -> torch.Tensor:
    """`moe` with the table holding raw addresses (DESIGN.md idea 3: `expert_ptr[layer, expert]`).

    expert_ptr: [E] int64 on x's device; entry e is the device address of expert
    e's weights, a row gate [I, H] | up [I, H] | down [H, I] in x's dtype, 16-byte
    aligned: a VRAM slot or pinned host memory mapped into the device's address
    space (with unified addressing, a pinned tensor's `data_ptr()`). The kernels
    cannot check these addresses: a wrong one faults or reads garbage.
    With `weight_format` each address is a compact extent's first byte (16-byte aligned).
    Other arguments and the result as in `moe`.
    """
    _check_x(x, residual)
    _check_routing(x, topk_ids, topk_weights)
    _check_table(x, expert_ptr, "expert_ptr")
    layout = extent_layout(weight_format, inter, x.shape[1])
    _check_row_size(layout)
    if x.shape[0] == 0:
        return _empty_result(x, residual)
    w_ref = x if weight_format is None else x.view(torch.uint8)  # the element type the addresses point at
    return _launch_moe(x, topk_ids, topk_weights.contiguous(), expert_ptr, w_ref, 0, True, inter, deterministic,
                       layout, residual=residual)


__all__ = ["ROUTE_FUSED_MAX_EXPERTS", "KERNEL_FORMATS", "ExtentLayout", "MoEConfig", "extent_layout", "moe_config",
           "max_tiles", "group_by_expert", "moe", "moe_ptr", "route_moe"]
