"""The quantized KV formats' math (kernels/kv_quant.py): exact round trips, the packed bit layouts,
the fp8 block scale's rule, and the CPU attention against the reference over one quantized cache."""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import cpu, reference
from radianced.kernels.kv_formats import FP8_HEADROOM, FP8_MAX, KV_FORMATS
from radianced.kernels.kv_quant import (
    fp8_block_scale, fp8_dequantize, fp8_quantize, int_dequantize, int_quantize, pack, unpack,
)
from radianced.kv.cache import KVCache
from tests.kernels.compare import rel_err

BLOCK = 16


def test_int4_packs_two_to_a_byte_even_dim_low():
    assert pack(torch.tensor([1, 2, 3]), 4).tolist() == [0x21, 0x03]  # odd D: the last high nibble pads


def test_int6_packs_four_to_three_bytes_little_endian():
    # 1 | 2 << 6 | 3 << 12 | 4 << 18 = 0x103081; then 63 alone (padded with zeros)
    assert pack(torch.tensor([1, 2, 3, 4, 63]), 6).tolist() == [0x81, 0x30, 0x10, 0x3F, 0x00, 0x00]


@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("d", [1, 5, 7, 33, 64])
def test_pack_unpack_every_code_at_odd_dims(bits, d):
    g = torch.Generator().manual_seed(d)
    q = torch.randint(0, 1 << bits, (11, 3, d), generator=g)
    assert torch.equal(unpack(pack(q, bits), bits, d), q)


@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("d", [5, 40, 64, 70])
def test_int_round_trip_is_exact_on_its_grid(bits, d):
    """Values on the grid (codes x an fp16 scale, each group reaching +-qmax) come back bit for bit, with
    the same codes and scales."""
    qmax = (1 << (bits - 1)) - 1
    g = torch.Generator().manual_seed(bits * 100 + d)
    groups = -(-d // 32)
    codes = torch.randint(-qmax, qmax + 1, (9, 2, groups * 32), generator=g)
    codes[..., ::32] = qmax  # every group's amax is qmax x its scale
    scales = (torch.rand((9, 2, groups), generator=g) * 3 + 0.01).to(torch.float16)
    x = (codes.view(9, 2, groups, 32).float() * scales.float()[..., None]).flatten(-2)[..., :d]
    packed, got_scales = int_quantize(x, bits)
    assert torch.equal(got_scales, scales)
    assert torch.equal(int_dequantize(packed, got_scales, bits, d), x)
    assert packed.shape[-1] == (3 * -(-d // 4) if bits == 6 else -(-d // 2))


@pytest.mark.parametrize("bits", [4, 6])
def test_int_error_is_at_most_half_a_step_and_requantizing_is_a_no_op(bits):
    g = torch.Generator().manual_seed(7)
    x = torch.randn((20, 3, 45), generator=g) * 5
    x[0, 0] = 0  # an all-zero head: scale 0, values 0
    packed, scales = int_quantize(x, bits)
    y = int_dequantize(packed, scales, bits, 45)
    step = scales.float().repeat_interleave(32, -1)[..., :45]
    assert bool(((y - x).abs() <= step / 2 + 1e-6 * x.abs()).all())
    assert torch.equal(y[0, 0], torch.zeros(45))
    again, again_scales = int_quantize(y, bits)
    assert torch.equal(again, packed) and torch.equal(again_scales, scales)


def test_fp8_round_trip_is_exact_on_its_grid_and_saturates_past_448():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    scale = torch.tensor(0.125)  # a power of two: x / scale is exact
    x = grid * scale
    assert torch.equal(fp8_dequantize(fp8_quantize(x, scale), scale), x)
    big = torch.tensor([1000.0, -1000.0]) * scale
    assert fp8_dequantize(fp8_quantize(big, scale), scale).tolist() == [FP8_MAX * 0.125, -FP8_MAX * 0.125]


def test_fp8_block_scale_maps_the_first_tokens_amax_inside_the_range_with_headroom():
    first = torch.tensor([[1.0, -8.0, 2.0], [0.0, 0.0, 0.0]])  # [Hkv, D]; head 1 all zero
    assert torch.equal(fp8_block_scale(first), torch.tensor([8.0 * (FP8_HEADROOM / FP8_MAX), 1.0]))  # fp32


def _cache(kv_dtype: str, blocks_per_page: int, pages: int, hkv: int, d: int) -> KVCache:
    fmt = KV_FORMATS[kv_dtype]
    storage = torch.zeros((pages, blocks_per_page, fmt.block_bytes(2, BLOCK, hkv, d)), dtype=torch.uint8)
    return KVCache(storage, (0, 1), fmt=fmt, geometry=(BLOCK, hkv, d))


@pytest.mark.parametrize("kv_dtype", list(KV_FORMATS))
def test_a_plane_stores_what_the_formulas_say_and_an_fp8_block_keeps_its_first_tokens_scale(kv_dtype):
    """Odd block count (7 blocks, 3 a page, 5 dims): tokens 0..20 of one block chain written in two writes;
    the second write's tokens of block 1 take the scale block 1 got from its token 0 in the first."""
    cache = _cache(kv_dtype, 3, 3, 2, 5)
    k_plane, v_plane = cache.layer(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn((21, 2, 5), generator=g)
    x[17] *= 100  # far past block 1's first token: saturates in fp8
    slots = torch.tensor([4 * BLOCK + i for i in range(16)] + [6 * BLOCK + i for i in range(5)])  # blocks 4, 6
    reference.write_kv(k_plane, v_plane, x[:18], x[:18], slots[:18])
    reference.write_kv(k_plane, v_plane, x[18:], x[18:], slots[18:])
    for plane in (k_plane, v_plane):
        got = plane.blocks(torch.tensor([4, 6])).flatten(0, 1)[:21]
        if plane.fmt.block_scaled:
            scales = torch.stack([fp8_block_scale(x[0]), fp8_block_scale(x[16])])  # [2 blocks, Hkv]
            per_token = scales[(slots // BLOCK - 4) // 2]  # block 4 -> 0, block 6 -> 1
            want = fp8_dequantize(fp8_quantize(x, per_token), per_token)
        else:
            want = int_dequantize(*int_quantize(x, plane.fmt.bits), plane.fmt.bits, 5)
        assert torch.equal(got, want)
    other = KVCache(cache.storage.clone(), (0, 1), fmt=cache.fmt, geometry=(BLOCK, 2, 5))
    assert torch.equal(other.layer(0)[0].blocks(torch.arange(9)), torch.zeros(9, BLOCK, 2, 5))  # layer 0 untouched


CASES = {  # name: (q_lens, ctx_lens, Hq, Hkv, D, shared prefix blocks)
    "decode_batch": ([1, 1, 1, 1, 1], [5, 16, 17, 48, 33], 6, 2, 24, 0),
    "prefill_chunk_after_context": ([19], [50], 8, 2, 80, 0),
    "mixed_prefill_and_decode": ([1, 23, 1, 5], [40, 23, 3, 70], 6, 3, 40, 0),
    "prefix_hit": ([9, 14, 1], [41, 46, 33], 4, 2, 64, 2),  # every sequence's first 2 blocks are one sequence's
}


def _layout(kv_dtype, q_lens, ctx_lens, hq, hkv, d, shared):
    """A quantized cache holding each sequence's context before its new tokens, and the step's q, k, v,
    positions, slots; the first `shared` blocks of every table are the same blocks (a prefix hit)."""
    g = torch.Generator().manual_seed(len(ctx_lens))
    cache = _cache(kv_dtype, 3, 12, hkv, d)
    free = torch.randperm(36, generator=g).tolist()
    prefix = [free.pop() for _ in range(shared)]
    tables = [prefix + [free.pop() for _ in range(-(-c // BLOCK) - shared)] for c in ctx_lens]
    block_tables = torch.zeros((len(ctx_lens), max(map(len, tables))), dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, :len(t)] = torch.tensor(t)
    old = [(b, p) for b, (c, n) in enumerate(zip(ctx_lens, q_lens)) for p in range(c - n)
           if p >= shared * BLOCK or b == 0]  # a shared block written once
    new = [(b, p) for b, (c, n) in enumerate(zip(ctx_lens, q_lens)) for p in range(c - n, c)]

    def slots(pairs):
        return torch.tensor([int(block_tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in pairs])

    k_plane, v_plane = cache.layer(0)
    reference.write_kv(k_plane, v_plane, torch.randn((len(old), hkv, d), generator=g) * 3,
                       torch.randn((len(old), hkv, d), generator=g), slots(old))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    t = starts[-1]
    q, k, v = (torch.randn((t, h, d), generator=g) for h in (hq, hkv, hkv))
    positions = torch.tensor([p for _, p in new])
    return cache, q, k, v, positions, slots(new), block_tables, starts, list(ctx_lens)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_dtype", list(KV_FORMATS))
def test_cpu_attention_over_a_quantized_cache_is_the_reference_and_writes_the_same_bytes(case, kv_dtype):
    """The layer op on both sets: the blocks they write are equal byte for byte (the same quantization),
    the outputs within fp32 rounding; and both equal attention over the dequantized cache."""
    q_lens, ctx_lens, hq, hkv, d, shared = CASES[case]
    cache, q, k, v, positions, slots, tables, starts, lens = _layout(kv_dtype, q_lens, ctx_lens, hq, hkv, d, shared)
    inv_freq = reference.rotary_inv_freq(d, 10000.0, "cpu")
    runs = []
    for op in (reference.rotary_paged_attention, cpu.rotary_paged_attention):
        c = KVCache(cache.storage.clone(), (0, 1), fmt=cache.fmt, geometry=(BLOCK, hkv, d))
        out = op(q, k, v, positions, inv_freq, *c.layer(0), slots, tables, starts, lens, d ** -0.5,
                 decode=case == "decode_batch")
        runs.append((out, c))
    (want, cw), (got, cg) = runs
    assert torch.equal(cg.storage, cw.storage)
    assert rel_err(got, want) < 1e-5
    k_plane, v_plane = cw.layer(0)
    every = torch.arange(36)
    plain_k, plain_v = (p.blocks(every).view(12, 3, BLOCK, hkv, d) for p in (k_plane, v_plane))
    q_rot, _ = reference.rotary_qk(q, k, positions, inv_freq)
    dense = reference.paged_attention(q_rot, plain_k, plain_v, tables, starts, lens, d ** -0.5)
    assert rel_err(want, dense) < 1e-6
