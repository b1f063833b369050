"""Paged attention over radianced's block layout (decode and chunked prefill), and an attention
layer's whole core at decode: qk-norm, RoPE and the KV write in the attention launch.

Caches are [P, N, S, Hkv, D] views of the paged KV storage (kernels/paged.py: the
layout, the slot addressing, the checks).

One kernel serves decode and chunked prefill over a varlen batch. Its grid is
(query tiles, Hkv, splits):

- a query tile is BLOCK_Q query tokens of one sequence times the G = Hq / Hkv
  query heads that share a KV head (GQA packed into the tile's rows, the group
  padded to a power of two), so every K/V tile is loaded once per group;
- the number of query tiles is bounded on the host by T // BLOCK_Q + B, and
  each program finds its sequence by a binary search over `query_start` on the
  device (no host sync, so the launch can be captured in a CUDA graph);
- splits divide each sequence's keys (flash-decoding) when a decode batch has
  too few (sequence, KV head) pairs to fill the GPU; a second kernel merges the
  partial results by their log-sum-exp.

`rotary_paged_attention` is the layer's op, from the q/k/v projection on. At a
decode-shaped step (every sequence has one new token, which the host knows from
its query_start tuple: the decode graphs' steps) it is one launch of that kernel
(+ the merge), not `rotary_write_kv`'s and then the kernel's: tile b is sequence
b (no search); each program normalizes and rotates its q rows in registers
(kernels/rope.py `rotate_rows`, the same roundings as `rotary_write_kv`), and the
one program whose keys hold the new token (its split, its KV head) first stores
that token's rotated k and its v at its slot, then waits for its threads' stores
(a CTA barrier) before its own K/V loads. No other program reads that slot, so
nothing waits across programs; a slot < 0 (a padding row) is written nowhere.
The result is the same bits as
`rope.rotary_write_kv` then `paged_attention`, which is what it runs for any
other step (prefill, chunks, mixed batches).

A quantized cache (`--kv-cache-dtype fp8 | fp8_v4 | k6_v4`) is read and written
by the same launches: its codes stand where the values stand, and kernels/kv_int.py
(fp8's own in kernels/kv_fp8.py) quantizes on the store, folds fp8's per-token
scales into the logits and into P, and dequantizes int rows in the loop. An int4
V is stored in the DCT basis: the loop accumulates P @ V in that basis and each
program rotates its output back once (o @ C) before it stores it. The non-decode
steps' write is rope.rotary_write_kv's launch, kv_int's for fp8_v4 and k6_v4.

Softmax runs in fp32 with exp2 (the scale is folded with log2 e); products
accumulate in fp32; fp32 inputs use IEEE products (no tf32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radianced.kernels import kv_int, pdl, reference, rope
from radianced.kernels.kv_quant import KVPlane
from radianced.kernels.kv_int import KernelCache, kernel_cache
from radianced.kernels.paged import check_cache, slot_offset

LOG2E = 1.4426950408889634
# Bounds on the split-KV (flash-decoding) heuristic. A split's keys are a whole number of BLOCK_N
# tiles, and at decode each tile is a chain of dependent loads (block table, then K and V): the
# latency is the tiles per split, plus the merge's share. H200, batch 1 (tools/bench_kernels.py),
# us per layer at 1,024 / 1,100 keys: 16 splits 6.7 / 8.4 (a context just past 1,024 rounds to two
# tiles a split), 32 splits 7.4 / 7.4, 64 splits 7.8 / 8.1 (a wider merge), 8 splits 8.3 / 10.0.
MAX_SPLITS = 32
MIN_SPLITS = 8  # at decode on CUDA, up to MAX_PROGRAMS_PER_SM (attention_config's docstring)
MAX_PROGRAMS_PER_SM = 8  # sizing.ATTENTION_PROGRAMS_PER_SM: the receipt's bound on the split partials
MIN_KEYS_PER_SPLIT = 64
# The step's counts are plain integers to the compiler: Triton would otherwise build a variant per
# value class (== 1, divisible by 16) met on the request path (kernels/compiles.py).
COUNTS = ["num_seqs", "num_tokens"]


# -- heuristics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # rows of a query tile: block_q tokens x group_pad heads
    block_q: int
    block_n: int  # keys per inner step
    num_splits: int
    num_warps: int
    num_stages: int


def attention_config(num_tokens: int, num_seqs: int, q_heads: int, kv_heads: int, head_dim: int,
                     device: torch.device, max_seq_len: int | None = None,
                     num_splits: int | None = None, k_bits: int = 0, v_bits: int = 0) -> AttentionConfig:
    """Tile sizes from the step's shape alone (T, B, heads), so one decode bucket gets one config.

    A decode-like step (T <= B) packs the GQA group into a 16-row tile and splits the keys until
    about two programs run per SM, and into at least MIN_SPLITS parts while at most
    MAX_PROGRAMS_PER_SM run per SM; prefill uses 64-row tiles and no split. The floor is measured:
    at b32 over a 16K context (Qwen3-30B-A3B's heads), two splits (two programs an SM) took
    0.389-0.390 ms in two sweeps on the H200, 4, 8 and 16 splits 0.270, 0.271, 0.277; with the floor
    the default took 0.267 (bench/results/2026-12-03-h200-{9ec6e66,c7322d6,8a2f6bf}-sweep-attention
    .json); b8 had 8 splits already. `max_seq_len` (when the host knows it) caps the split count so each
    split keeps at least MIN_KEYS_PER_SPLIT keys. `k_bits`, `v_bits`: the cache's format (KernelCache's:
    auto 0, 0; fp8 8, 8; fp8_v4 8, 4; k6_v4 6, 4). An int6 K (`k_bits` 6) at decode takes 8 warps: at 4
    its unpacking spills registers in the key loop (tools/sass_loop.py, Qwen3-30B-A3B's heads: 243 local
    loads and 241 stores a key tile; none at 8, with as many instructions in all). fp8 at head dim <= 128
    takes 128-key prefill tiles and 3 stages at decode: measured at 128 (Qwen3-30B-A3B's heads) in
    bench/results/2026-12-03-h200-9ec6e66-sweep-attention.json, 4K prefill 1.28 -> 0.875 ms (auto 0.736),
    16K decode b32 0.478 -> 0.431 ms at 3 stages and at 4, b8 0.133 -> 0.146 at 3 and 0.121 at 4 (3 and 4
    build the same PTX here: b8's spread is noise). At 256, fp8's 64-key prefill tiles were slower (1.70 ->
    1.96 ms) and its decode is unmeasured; fp8_v4 and k6_v4 keep auto's tiles until measured.
    """
    group_pad = triton.next_power_of_2(q_heads // kv_heads)
    decode = num_tokens <= num_seqs
    fp8_tiles = k_bits == 8 and v_bits == 8 and head_dim <= 128  # fp8's own, where measured
    block_m = max(16 if decode else (64 if head_dim <= 128 else 32), group_pad)
    block_q = block_m // group_pad
    block_n = 128 if fp8_tiles and not decode else (64 if head_dim <= 128 else 32)
    if num_splits is None:
        num_splits = 1
        if decode and device.type == "cuda":
            programs = max(1, num_seqs * kv_heads)
            sms = pdl.sm_count(device)
            floor = min(MIN_SPLITS, MAX_PROGRAMS_PER_SM * sms // programs)
            num_splits = max(1, min(MAX_SPLITS, max(floor, 2 * sms // programs)))
            if max_seq_len is not None:
                num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, MIN_KEYS_PER_SPLIT)))
    num_warps = 4 if block_m * head_dim <= 64 * 128 and not (decode and k_bits == 6) else 8
    num_stages = 3 if fp8_tiles and decode else 2
    return AttentionConfig(block_m, block_q, block_n, num_splits, num_warps, num_stages)


# -- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _find_seq(query_start_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence b whose query tiles hold `tile`: largest b with query_start[b] // BLOCK_Q + b <= tile."""
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _store_token(k_new, v_src, slot, k_dst, v_dst, ks_ptr, vs_ptr, basis_ptr, kvh, blocks_per_page, d, d_ok,
                 stride_ks, stride_ksp, stride_ksn, stride_kss, stride_ksh,
                 stride_vsp, stride_vsn, stride_vss, stride_vsh, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr):
    """The decode prologue's store into a quantized cache: k_new fp32 [1, BLOCK_D] rounded to `dtype` (as
    `rotary_write_kv` rounds it) and stored as its residual from its block's first token (written by
    an earlier launch, read back: a decode step writes one token of a block), the v at v_src as itself
    (int4: in the DCT basis, kernels/kv_int.py); k_dst, v_dst: the codes of this token and KV head."""
    one = tl.arange(0, 1)
    ks_dst = ks_ptr + slot_offset(slot, blocks_per_page, stride_ksp, stride_ksn, stride_kss, BLOCK_SIZE) \
        + kvh * stride_ksh
    k_new = k_new.to(dtype).to(tl.float32)
    off = slot % BLOCK_SIZE
    if off > 0:
        k_new = k_new - kv_int.load_rows(k_dst - off * stride_ks + one, ks_dst - off * stride_kss + one, one < 1, d,
                                         d_ok, HEAD_DIM, K_BITS)
    kv_int.store_rows(k_new, k_dst + one, ks_dst + one, one < 1, d, d_ok, HEAD_DIM, K_BITS)
    vs_dst = vs_ptr + slot_offset(slot, blocks_per_page, stride_vsp, stride_vsn, stride_vss, BLOCK_SIZE) \
        + kvh * stride_vsh
    if V_BITS == 4:
        v_new = kv_int.dct_rows(v_src + one, one < 1, basis_ptr, HEAD_DIM, d.shape[0])
    else:
        v_new = tl.load(v_src + one[:, None] + d[None, :], mask=d_ok[None, :], other=0.0).to(tl.float32)
    kv_int.store_rows(v_new, v_dst + one, vs_dst + one, one < 1, d, d_ok, HEAD_DIM, V_BITS)


@triton.jit(do_not_specialize=COUNTS)
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    block_tables_ptr, query_start_ptr, seq_lens_ptr,
    scale_log2, num_seqs, num_tokens, blocks_per_page: tl.constexpr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kn, stride_ks, stride_kh,
    stride_vp, stride_vn, stride_vs, stride_vh,
    stride_bt,
    k_new_ptr, v_new_ptr, slot_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, eps,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    ks_ptr, vs_ptr, stride_ksp, stride_ksn, stride_kss, stride_ksh, stride_vsp, stride_vsn, stride_vss, stride_vsh,
    basis_ptr, Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, DECODE: tl.constexpr,
    ROT: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr, LIBDEVICE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, PDL: tl.constexpr,
):
    """DECODE: one query row per sequence, tile b is sequence b's; q is the unrotated projection
    (k_new, v_new: the new token's k and v), rotated here, and the program whose keys hold the
    new token (the last, seq_len - 1) first stores its k and v at slot_mapping[b] (< 0: no write).
    Otherwise q is rotated and every key is in the cache; the k_new .. stride_vnh arguments and
    ROT .. LIBDEVICE are unused. K_BITS, V_BITS > 0 (8 fp8, 6 int6, 4 int4): k_ptr, v_ptr hold codes,
    ks_ptr, vs_ptr their fp16 scales (kernels/kv_fp8.py, kernels/kv_int.py: the new token's K stored
    as its residual from its block's first token, which an earlier launch wrote; fp8 scales folded
    into the logits and P, int rows dequantized); V_BITS 4: V in the DCT basis (basis_ptr: C), the
    output rotated back once (o @ C). blocks_per_page is a constexpr (one value a cache, so one
    variant a daemon): a key's page and block in it are then a multiply and shift, not a division
    (tools/sass_loop.py: the decode loop's instructions a key tile, auto 946 -> 620, fp8 1,685 -> 1,081
    with the int32 ids below)."""
    pdl.wait(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE:
        b = tile
        q_lo = tile
        q_len = 1
        q_first = 0
    else:
        b = _find_seq(query_start_ptr, num_seqs, tile, BLOCK_Q)
        q_lo = tl.load(query_start_ptr + b)
        q_len = tl.load(query_start_ptr + b + 1) - q_lo
        q_first = (tile - (q_lo // BLOCK_Q + b)) * BLOCK_Q  # first query of this tile, within the sequence
        if q_first >= q_len:
            return
    ctx = tl.load(seq_lens_ptr + b)

    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // GROUP_PAD  # query index within the sequence
    head = kvh * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx - q_len + tok  # causal: row sees keys 0 .. q_pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_lo + tok).to(tl.int64)
    q_src = q_ptr + q_rows * stride_qt + head * stride_qh  # [BLOCK_M]: each row's head
    if DECODE:
        pos = tl.load(pos_ptr + b)
        q = rope.rotate_rows(q_src, row_ok, pos, inv_freq_ptr, qw_ptr, eps, HEAD_DIM, ROT, BLOCK_D, NORM,
                             ZERO_CENTRED, LIBDEVICE).to(out_ptr.dtype.element_ty)  # as rotary_write_kv rounds it
    else:
        q = tl.load(q_src[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    kv_end = ctx - q_len + tl.minimum(q_first + BLOCK_Q, q_len)  # keys any row of the tile may see
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        k_lo = split * per_split
        k_hi = tl.minimum(kv_end, k_lo + per_split)
    else:
        k_lo = 0
        k_hi = kv_end

    if DECODE:
        # The new token's key is read by this program alone (its split, its KV head): it stores it
        # first, then waits for every thread's stores before the loads below.
        if (k_lo <= ctx - 1) & (ctx - 1 < k_hi):
            slot = tl.load(slot_ptr + b).to(tl.int64)
            if slot >= 0:
                b64 = b.to(tl.int64)
                k_new = rope.rotate_rows(k_new_ptr + b64 * stride_knt + (kvh + tl.arange(0, 1)) * stride_knh,
                                         tl.arange(0, 1) < 1, pos, inv_freq_ptr, kw_ptr, eps, HEAD_DIM, ROT, BLOCK_D,
                                         NORM, ZERO_CENTRED, LIBDEVICE)  # [1, BLOCK_D]
                k_dst = k_ptr + slot_offset(slot, blocks_per_page, stride_kp, stride_kn, stride_ks, BLOCK_SIZE) \
                    + kvh * stride_kh
                v_src = v_new_ptr + b64 * stride_vnt + kvh * stride_vnh
                v_dst = v_ptr + slot_offset(slot, blocks_per_page, stride_vp, stride_vn, stride_vs, BLOCK_SIZE) \
                    + kvh * stride_vh
                if K_BITS > 0:
                    _store_token(k_new, v_src, slot, k_dst, v_dst, ks_ptr, vs_ptr, basis_ptr, kvh, blocks_per_page,
                                 d, d_ok, stride_ks, stride_ksp, stride_ksn, stride_kss, stride_ksh,
                                 stride_vsp, stride_vsn, stride_vss, stride_vsh, out_ptr.dtype.element_ty, HEAD_DIM,
                                 BLOCK_SIZE, K_BITS, V_BITS)
                else:
                    tl.store(k_dst + d[None, :], k_new.to(k_ptr.dtype.element_ty), mask=d_ok[None, :])
                    tl.store(v_dst + d, tl.load(v_src + d, mask=d_ok, other=0.0).to(v_ptr.dtype.element_ty),
                             mask=d_ok)
                tl.debug_barrier()

    if K_BITS > 0:
        q = kv_int.dot_operand(q)  # fp16 dots on the codes where the activations are bf16
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked row gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(k_lo, k_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_ok = keys < k_hi
        block = tl.load(block_tables_ptr + b * stride_bt + keys // BLOCK_SIZE, mask=k_ok, other=0)
        page = (block // blocks_per_page).to(tl.int64)  # on the int32 ids: 64-bit integer arithmetic is long
        in_page = block % blocks_per_page
        slot = keys % BLOCK_SIZE
        k_off = page * stride_kp + in_page * stride_kn + slot * stride_ks + kvh * stride_kh
        v_off = page * stride_vp + in_page * stride_vn + slot * stride_vs + kvh * stride_vh
        if K_BITS > 0:  # codes and their scales (kernels/kv_int.py)
            ks_src = ks_ptr + page * stride_ksp + in_page * stride_ksn + slot * stride_kss + kvh * stride_ksh
            vs_src = vs_ptr + page * stride_vsp + in_page * stride_vsn + slot * stride_vss + kvh * stride_vsh
            s = kv_int.key_logits(q, k_ptr + k_off, ks_src, k_ok, slot, d, d_ok, HEAD_DIM, K_BITS, DOT_PRECISION,
                                  BLOCK_SIZE) * scale_log2
        else:
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = k_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_BITS > 0:
            p_v, v = kv_int.value_operands(p, v_ptr + v_off, vs_src, k_ok, d, d_ok, HEAD_DIM, V_BITS, q.dtype)
        else:
            p_v = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + q_rows * stride_ot + head * stride_oh  # [BLOCK_M]
    else:
        # partials: o [S, T, Hq, D] fp32 normalized within the split, lse [S, T, Hq] (log2 domain)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), -1.0e30)
        part = (split * num_tokens + q_rows) * Q_HEADS + head  # [BLOCK_M]
        dst = part_o_ptr + part * HEAD_DIM
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
    if V_BITS == 4:  # the merge's sum over splits is linear: each split's part is rotated back
        kv_int.store_unrotated(o, basis_ptr, dst, row_ok, HEAD_DIM, DOT_PRECISION)
    else:
        tl.store(dst[:, None] + d[None, :], o.to(dst.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=COUNTS)
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_tokens, stride_ot, stride_oh,
                         Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = (s.to(tl.int64) * num_tokens + t) * Q_HEADS + h  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # padded splits: exp2(-inf) = 0
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


# -- launchers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Prologue:
    """The decode launch's own qk-norm, RoPE and KV write: the new tokens' unrotated k and v
    [B, Hkv, D] (last dim contiguous), their KV slots and positions [B], the rotary frequencies,
    and the norm weights (None: no qk-norm)."""
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    inv_freq: torch.Tensor
    weights: tuple[torch.Tensor, torch.Tensor] | None
    eps: float
    zero_centred: bool


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is the default and means nothing for bf16


def _launch_paged_attention(q, cache: KernelCache, block_tables, query_start, seq_lens, scale, out,
                            cfg: AttentionConfig, prologue: _Prologue | None = None) -> None:
    """prologue: a decode step (one query row per sequence, q unrotated), grid (B, Hkv, splits)."""
    views = cache.views
    k_cache, v_cache = views.k, views.v
    t, hq, d = q.shape
    hkv, block_size = k_cache.shape[3], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    splits = cfg.num_splits
    if splits > 1:
        part_o = torch.empty((splits, t, hq, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, t, hq), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    if prologue is None:
        grid = (t // cfg.block_q + num_seqs, hkv, splits)
        fused = (q,) * 7 + (0.0,) + (0,) * 4  # unused
        constexprs = dict(DECODE=False, ROT=0, NORM=False, ZERO_CENTRED=False, LIBDEVICE=False)
    else:
        p = prologue
        grid = (num_seqs, hkv, splits)
        qw, kw = p.weights if p.weights is not None else (p.inv_freq, p.inv_freq)  # unused without NORM
        fused = (p.k, p.v, p.slot_mapping.contiguous(), p.positions.contiguous(), p.inv_freq.contiguous(),
                 qw.contiguous(), kw.contiguous(), p.eps, p.k.stride(0), p.k.stride(1), p.v.stride(0), p.v.stride(1))
        constexprs = dict(DECODE=True, **rope.rotary_constexprs(p.inv_freq, p.weights, p.zero_centred))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse,
        block_tables, query_start, seq_lens,
        scale * LOG2E, num_seqs, t, k_cache.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:4], *v_cache.stride()[:4],
        block_tables.stride(0), *fused, *views.scale_args(), cache.basis if cache.rotated else q,
        Q_HEADS=hq, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        NUM_SPLITS=splits, DOT_PRECISION=_dot_precision(out.dtype), K_BITS=cache.k_bits,
        V_BITS=cache.v_bits, **constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(q.device, grid[0] * grid[1] * grid[2]))
    if splits > 1:
        _merge_splits_kernel[(t, hq)](part_o, part_lse, out, t, out.stride(0), out.stride(1),
                                      Q_HEADS=hq, HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=splits,
                                      BLOCK_S=triton.next_power_of_2(splits),
                                      num_warps=4 if block_d >= 128 else 2, **pdl.launch(q.device, t * hq))


# -- public ops ------------------------------------------------------------------------------------


def _as_device_ints(x: Sequence[int] | torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
        return x.contiguous()
    # One small host -> device copy per call until ForwardBatch carries these as device tensors.
    return torch.tensor(list(x), dtype=torch.int32, device=device)


def _check_attention(q: torch.Tensor, dtype: torch.dtype, cache: KernelCache, block_tables: torch.Tensor) -> None:
    """Raise ValueError unless q: [T, Hq, D] (`dtype` once rotated) fits the caches and block_tables."""
    k_cache, v_cache = cache.views.k, cache.views.v
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    check_cache("k_cache", k_cache, q)
    check_cache("v_cache", v_cache, q)
    hq, d = q.shape[1:]
    hkv = cache.shape[3]
    if k_cache.shape[:4] != v_cache.shape[:4] or cache.shape[4] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match, "
                         f"with head dim {d} (q)")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if cache.k_bits == 0 and (k_cache.dtype != dtype or v_cache.dtype != dtype):
        raise ValueError(f"cache dtype {k_cache.dtype}/{v_cache.dtype} differs from q's {dtype}")
    if block_tables.device != q.device or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_blocks] on {q.device}")


def _lengths(query_start: Sequence[int] | torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
             block_tables: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """query_start [B+1] and seq_lens [B] on the device, and the longest context when the host knows it."""
    max_seq_len = None if isinstance(seq_lens, torch.Tensor) else max(seq_lens, default=0)
    qs = _as_device_ints(query_start, device, "query_start")
    sl = _as_device_ints(seq_lens, device, "seq_lens")
    num_seqs = sl.shape[0]
    if qs.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError(f"query_start has {qs.shape[0]} entries and block_tables {block_tables.shape[0]} rows "
                         f"for {num_seqs} sequences (need B+1 and at least B)")
    return qs, sl, max_seq_len


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane,
                    block_tables: torch.Tensor,
                    query_start: Sequence[int] | torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
                    scale: float, *, num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context (Triton).

    Same contract as `reference.paged_attention`:
    q: [T, Hq, D] (bf16, fp16 or fp32; head dim contiguous); k_cache, v_cache:
    [P, N, S, Hkv, D] views in q's dtype, or a quantized cache's `KVPlane`s (kernels/kv_int.py), already
    holding every context token;
    block_tables: [B, max_blocks] int32/int64 on q's device; query_start: [B+1]
    and seq_lens: [B], host sequences or integer tensors on q's device (tensors
    avoid the small host -> device copy this makes otherwise, and let the call be
    captured in a CUDA graph). Sequence b owns q rows query_start[b]:query_start[b+1],
    the last tokens of its seq_lens[b] context tokens; a sequence may own no rows.
    Hq must be a multiple of Hkv (GQA). Returns a new [T, Hq, D] tensor in q's dtype.
    `num_splits` overrides the split-KV heuristic (tests, benchmarks).
    """
    cache = kernel_cache(k_cache, v_cache)
    _check_attention(q, q.dtype, cache, block_tables)
    if q.stride(2) != 1:
        q = q.contiguous()
    qs, sl, max_seq_len = _lengths(query_start, seq_lens, block_tables, q.device)
    t, hq, d = q.shape
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0 or sl.shape[0] == 0:
        return out
    cfg = attention_config(t, sl.shape[0], hq, cache.shape[3], d, q.device, max_seq_len, num_splits,
                           cache.k_bits, cache.v_bits)
    _launch_paged_attention(q, cache, block_tables, qs, sl, scale, out, cfg)
    return out


def rotary_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           inv_freq: torch.Tensor, k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                           query_start: Sequence[int] | torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
                           scale: float, *, q_weight: torch.Tensor | None = None,
                           k_weight: torch.Tensor | None = None, eps: float = 1e-6, zero_centred: bool = False,
                           decode: bool = False, num_splits: int | None = None) -> torch.Tensor:
    """An attention layer from its q/k/v projection to its heads' output (Triton): qk-norm, RoPE,
    k and v into the cache, paged attention.

    Same contract as `reference.rotary_paged_attention`, and the same bits as its two steps
    run as `rope.rotary_write_kv` (`kv_int.rotary_write_kv` for fp8_v4, k6_v4) then `paged_attention`:
    q: [T, Hq, D], k, v: [T, Hkv, D]
    (views of the projection, last dim contiguous), positions, inv_freq, q_weight, k_weight,
    eps, zero_centred as in `rope.rotary_write_kv`, the caches and slot_mapping [T] as there;
    block_tables, query_start, seq_lens, scale and num_splits as in `paged_attention`. Mutates
    the caches at slot_mapping. Returns a new [T, Hq, D] tensor in the caches' dtype (a quantized
    cache: the dtype q is rotated to).

    `decode`: every sequence has exactly one query row (query_start is 0, 1, ..., B), as the
    host knows from its own tuple (checked when query_start is a host sequence; a tensor is
    taken at its word, with no sync). Then one attention launch (+ the split merge) does it all:
    each program rotates its q rows, and the one whose keys hold sequence b's new token stores
    its k and v before it reads them. So slot_mapping[b] must be where b's block table puts its
    last context token (seq_lens[b] - 1), or < 0: a padding row, written nowhere, whose
    attention reads the cache as it is. Without `decode`, the two launches.
    """
    weights = rope.norm_weights("rotary_paged_attention", q_weight, k_weight)
    cache = kernel_cache(k_cache, v_cache)
    if not decode:
        write = kv_int.rotary_write_kv if cache.rotated else rope.rotary_write_kv  # rope's: auto and fp8
        q = write(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps, zero_centred)
        return paged_attention(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale,
                               num_splits=num_splits)
    cache.check_write(k, v, slot_mapping)
    q, k, dtype = rope.check_rotary(q, k, positions, inv_freq, weights, zero_centred)
    _check_attention(q, dtype, cache, block_tables)
    if not isinstance(query_start, torch.Tensor):
        reference.check_decode(query_start)
    qs, sl, max_seq_len = _lengths(query_start, seq_lens, block_tables, q.device)
    t, hq, d = q.shape
    if t != sl.shape[0]:
        raise ValueError(f"decode=True needs one query row per sequence: q has {t} rows for {sl.shape[0]} "
                         f"sequences")
    out = torch.empty((t, hq, d), dtype=dtype, device=q.device)
    if t == 0:
        return out
    v = v if v.stride(2) == 1 else v.contiguous()
    cfg = attention_config(t, t, hq, cache.shape[3], d, q.device, max_seq_len, num_splits, cache.k_bits,
                           cache.v_bits)
    prologue = _Prologue(k, v, slot_mapping, positions, inv_freq, weights, eps, zero_centred)
    _launch_paged_attention(q, cache, block_tables, qs, sl, scale, out, cfg, prologue)
    return out


__all__ = ["AttentionConfig", "attention_config", "paged_attention", "rotary_paged_attention"]
