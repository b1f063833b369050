"""The quantized KV formats' math (kernels/kv_quant.py): exact round trips, the packed bit layouts,
the fp8 scale's rule, K's residual from its block's first token, and the CPU attention against the
reference over one quantized cache."""

from __future__ import annotations

import math

import pytest
import torch

from radianced.kernels import cpu, reference
from radianced.kernels.kv_formats import FP8_MAX, KV_FORMATS
from radianced.kernels.kv_quant import (
    dct_basis, dequantize, fp8_dequantize, fp8_quantize, fp8_scale, int_dequantize, int_quantize, pack, quantize,
    unpack,
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
    """Values on the grid (codes x an fp16 step + an fp16 min, each group reaching codes 0 and 2**bits - 1)
    come back bit for bit, with the same codes, steps and mins; odd dims: the last group is partial."""
    top = (1 << bits) - 1
    g = torch.Generator().manual_seed(bits * 100 + d)
    groups = -(-d // 32)
    codes = torch.randint(0, top + 1, (9, 2, d), generator=g)
    for i in range(groups):  # every group spans its codes' whole range
        codes[..., 32 * i], codes[..., min(32 * i + 1, d - 1)] = 0, top
    if d % 32 == 1:
        codes[..., -1] = 0  # a one-dim last group: its min is its value, its step 0
    step = (torch.rand((9, 2, groups), generator=g) * 0.2 + 0.01).to(torch.float16)
    low = (torch.randn((9, 2, groups), generator=g) * 3).to(torch.float16)
    per_dim = torch.arange(d) // 32
    x = codes.float() * step.float()[..., per_dim] + low.float()[..., per_dim]
    packed, scales = int_quantize(x, bits)
    assert scales.shape == (9, 2, groups, 2) and scales.dtype == torch.float16
    assert torch.equal(scales[..., 1], low) and torch.equal(scales[..., 0], step)
    assert torch.equal(unpack(packed, bits, d), codes)
    assert torch.equal(int_dequantize(packed, scales, bits, d), x)
    assert packed.shape[-1] == (3 * -(-d // 4) if bits == 6 else -(-d // 2))


@pytest.mark.parametrize("bits", [4, 6])
def test_int_error_is_at_most_half_a_step_and_requantizing_is_a_no_op(bits):
    """Off the grid: within half a step of the stored (step, min), plus the fp16 rounding of the min; a
    constant head (step 0) comes back as its fp16 value; a partial last group ignores the padding."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand((20, 3, 45), generator=g) * 5 + 7  # 45 dims: a group of 32 and one of 13, all in [7, 12)
    x[0, 0] = 1.5  # a constant head
    packed, scales = int_quantize(x, bits)
    y = int_dequantize(packed, scales, bits, 45)
    per_dim = torch.arange(45) // 32
    step, low = scales[..., 0].float()[..., per_dim], scales[..., 1].float()[..., per_dim]
    true_low = torch.stack([x[..., :32].amin(-1), x[..., 32:].amin(-1)], -1)[..., per_dim]
    assert bool(((y - x).abs() <= step / 2 + (low - true_low).abs() + 1e-6 * x.abs()).all())
    assert torch.equal(y[0, 0], torch.full((45,), 1.5)) and bool((scales[0, 0, :, 0] == 0).all())
    assert bool((scales[1:, :, 1, 1] >= 7).all())  # the 13-dim group's min is its own, not the padding's 0
    again, again_scales = int_quantize(y, bits)
    assert torch.equal(again, packed) and torch.equal(again_scales, scales)


def test_fp8_round_trip_is_exact_on_its_grid():
    """Every finite E4M3 value, 448 among them (so the scale is amax / 448 = 1/8, exact in fp16)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    x = (grid[grid.isfinite()] * 0.125).view(2, -1)  # two rows of 127, each reaching +-448 / 8
    codes, scales = fp8_quantize(x)
    assert scales.dtype == torch.float16 and scales.tolist() == [[0.125], [0.125]]
    assert torch.equal(fp8_dequantize(codes, scales), x)


def test_fp8_scale_is_amax_over_448_in_fp16_rounded_up_so_nothing_saturates():
    x = torch.tensor([[1.0, -3.0, 2.0], [0.0, 0.0, 0.0], [1e-9, 0.0, 0.0], [0.1, 0.2, 0.3001]])
    scale = fp8_scale(x)
    assert scale.dtype == torch.float16 and scale.shape == (4, 1)
    assert bool((scale.float().squeeze(-1) * FP8_MAX >= x.abs().amax(-1)).all())
    nearest = (x.abs().amax(-1, keepdim=True) / FP8_MAX).to(torch.float16)
    up = torch.nextafter(nearest, torch.tensor(float("inf"), dtype=torch.float16))
    assert torch.equal(scale, torch.where(nearest.float() * FP8_MAX < x.abs().amax(-1, keepdim=True), up, nearest))
    assert scale[1].item() == 0.0 and torch.equal(fp8_dequantize(*fp8_quantize(x[1:2])), x[1:2])  # all-zero head
    assert scale[2].item() > 0  # below fp16's smallest step: its smallest step, not 0
    y = fp8_dequantize(*fp8_quantize(x))
    assert bool(((y - x).abs() <= x.abs() / 16 + scale.float() * 2 ** -9).all())  # half an E4M3 step, or subnormal


@pytest.mark.parametrize("d", [5, 64])
def test_the_dct_basis_is_orthonormal_with_the_mean_as_row_0(d):
    c = dct_basis(d)
    assert c.shape == (d, d) and c.dtype == torch.float32
    assert torch.allclose(c @ c.T, torch.eye(d), atol=1e-6)
    assert torch.allclose(c[0], torch.full((d,), d ** -0.5))
    assert c[1, 0].item() == pytest.approx((2 / d) ** 0.5 * math.cos(math.pi / (2 * d)), rel=1e-6)


def _cache(kv_dtype: str, blocks_per_page: int, pages: int, hkv: int, d: int) -> KVCache:
    fmt = KV_FORMATS[kv_dtype]
    storage = torch.zeros((pages, blocks_per_page, fmt.block_bytes(2, BLOCK, hkv, d)), dtype=torch.uint8)
    return KVCache(storage, (0, 1), fmt=fmt, geometry=(BLOCK, hkv, d))


@pytest.mark.parametrize("kv_dtype", list(KV_FORMATS))
def test_a_plane_stores_what_the_formulas_say_and_k_is_the_residual_from_its_blocks_first_token(kv_dtype):
    """Odd block count (9 blocks, 3 a page, 5 dims): tokens 0..20 of one block chain written in two writes,
    the second starting mid-block: K's tokens of a block after its first are the residual from the first's
    stored value, read back from the cache when an earlier write stored it; V's are themselves, int4 V's
    in the DCT basis (rotated on write, back on read)."""
    cache = _cache(kv_dtype, 3, 3, 2, 5)
    k_plane, v_plane = cache.layer(1)
    assert k_plane.fmt.delta and not v_plane.fmt.delta and v_plane.fmt.rotated == (v_plane.fmt.name == "int4")
    g = torch.Generator().manual_seed(1)
    x = torch.randn((21, 2, 5), generator=g) + torch.tensor([20.0, -9.0, 0.0, 0.0, 3.0])  # K's constant channels
    slots = torch.tensor([4 * BLOCK + i for i in range(16)] + [6 * BLOCK + i for i in range(5)])  # blocks 4, 6
    writes = (slice(0, 18), slice(18, 21))
    for w in writes:
        reference.write_kv(k_plane, v_plane, x[w], x[w], slots[w])
    for plane in (k_plane, v_plane):
        got = plane.blocks(torch.tensor([4, 6])).flatten(0, 1)[:21]
        first = dequantize(plane.fmt, *quantize(plane.fmt, x), 5)  # every token as itself
        if plane.fmt.delta:
            base = first[[0] * 16 + [16] * 5]  # each token's block's first token, as stored
            want = base + dequantize(plane.fmt, *quantize(plane.fmt, x - base), 5)
            want[[0, 16]] = first[[0, 16]]
        elif plane.fmt.rotated:  # rotated as each write did (same shapes, same bits)
            c = dct_basis(5)
            want = torch.cat([dequantize(plane.fmt, *quantize(plane.fmt, x[w] @ c.T), 5) for w in writes]) @ c
        else:
            want = first
        assert torch.equal(got, want)
    later = [i for i in range(21) if i not in (0, 16)]  # what the residual buys a block's later tokens
    k_err = (k_plane.blocks(torch.tensor([4, 6])).flatten(0, 1)[later] - x[later]).abs().mean()
    assert k_err < (dequantize(k_plane.fmt, *quantize(k_plane.fmt, x[later]), 5) - x[later]).abs().mean() / 2
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
