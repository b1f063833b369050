"""The host backend's quantized KV planes on the CPU (kernels/cpu_attention.py; `--kv-cache-dtype fp8 | fp8_v4 |
k6_v4`): the decode attention reading them in place (`PlanePair.decode`) against `reference.paged_attention` over the
same planes (which dequantizes them with `KVPlane.blocks`), within fp32 rounding (4e-6 of max |ref|, as the plain
kernel, a rotated V's too: brought back once instead of per token), on odd shapes (head dims that are no multiple
of 8 or of the int groups' 32, GQA and MHA, one key or many blocks, a block shared by two sequences), with the cache
laid out as the engine does (kv/cache.py: this layer's planes inside uint8 blocks of two layers, block tables
shuffled across pages); every E4M3 code read as `fp8_dequantize` reads it; the layer op taking it at decode only;
any thread count giving the same bits; and their write (`PlanePair.store`) giving `KVPlane.store`'s bytes (a rotated
V's up to a code or an fp16 step one off where its rotation's last bit decides); all of it also in a build without
F16C (the conversions by hand). What does not apply (prefill, other dtypes, head dims past D_MAX) is declined."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from radianced.kernels import cpu, cpu_attention, cpu_blocks, reference
from radianced.kernels.kv_formats import KV_FORMATS
from radianced.kernels.kv_quant import fp8_dequantize, unpack
from radianced.kv.cache import KVCache
from tests.kernels.compare import rel_err

BLOCK, PER_PAGE, PAGES = 16, 3, 8
KV_DTYPES = list(KV_FORMATS)
# A rotated V plane's values may sit on a rounding boundary that the C rotation (a sum in order) and the reference's
# (a torch matmul) round to either side of: a code one off, or a group's fp16 step or min one off. At most this share.
V_FLIPS = 1e-2

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the host backend's C library is not built")


def decode_planes(q, k_plane, v_plane, block_tables, seq_lens, scale):
    """`PlanePair.decode` over the planes, the step's reads checked here (kernels/cpu.py keeps both); None where
    the kernel does not apply."""
    pair = cpu_attention.PlanePair.of(k_plane, v_plane)
    if pair is None:
        return None
    return pair.decode(q, cpu_attention.PlaneReads(block_tables, seq_lens, len(q), pair.shape[2]), scale)


def store_planes(k_plane, v_plane, slots, k, v) -> bool:
    """`PlanePair.store` over the planes, the slots checked here; False where it does not apply."""
    pair = cpu_attention.PlanePair.of(k_plane, v_plane)
    return pair is not None and pair.store(cpu_attention.PlaneSlots(slots), k, v)


def _step(ctx_lens, hq, hkv, d, kv_dtype="fp8", shared=0, seed=0):
    """(q [B, Hq, D], K plane, V plane, block_tables [B, nb] int32, seq_lens): each sequence's context written
    through `KVPlane.store` in one call per plane (every sequence's tokens, as a prefill writes them); the first
    `shared` blocks of every table are sequence 0's (a prefix hit)."""
    g = torch.Generator().manual_seed(seed)
    fmt = KV_FORMATS[kv_dtype]
    storage = torch.zeros((PAGES, PER_PAGE, fmt.block_bytes(2, BLOCK, hkv, d)), dtype=torch.uint8)
    k_plane, v_plane = KVCache(storage, (0, 1), fmt=fmt, geometry=(BLOCK, hkv, d)).layer(1)
    free = torch.randperm(PAGES * PER_PAGE, generator=g).tolist()
    prefix = [free.pop() for _ in range(shared)]
    tables = [prefix + [free.pop() for _ in range(-(-c // BLOCK) - shared)] for c in ctx_lens]
    block_tables = torch.zeros((len(ctx_lens), max(map(len, tables))), dtype=torch.int32)
    slots = []
    for b, (t, c) in enumerate(zip(tables, ctx_lens)):
        block_tables[b, :len(t)] = torch.tensor(t)
        if b == 0 or not shared:
            slots += [t[i // BLOCK] * BLOCK + i % BLOCK for i in range(c)]
        else:  # past the shared blocks, which sequence 0 wrote
            slots += [t[i // BLOCK] * BLOCK + i % BLOCK for i in range(shared * BLOCK, c)]
    slots = torch.tensor(slots, dtype=torch.int64)
    scale = torch.rand((len(slots), hkv, 1), generator=g) * 3  # heads of different sizes
    k_plane.store(slots, torch.randn((len(slots), hkv, d), generator=g) * scale + 2.0)  # offsets: the delta at work
    v_plane.store(slots, torch.randn((len(slots), hkv, d), generator=g) * scale)
    q = torch.randn((len(ctx_lens), hq, d), generator=g)
    return q, k_plane, v_plane, block_tables, list(ctx_lens)


CASES = {  # name: (ctx_lens, Hq, Hkv, D, shared blocks)
    "one_key": ([1], 4, 2, 8, 0),
    "smollm2_heads": ([1, 17, 45, 33], 9, 3, 64, 0),
    "odd_head_dim": ([20, 3], 6, 2, 20, 0),
    "mha_many_blocks": ([77], 3, 3, 40, 0),
    "head_dim_256": ([40, 9], 2, 1, 256, 0),
    "a_shared_prefix": ([40, 35], 8, 2, 32, 2),
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_the_decode_reads_the_codes_as_the_reference_dequantizes_them(case, kv_dtype):
    ctx, hq, hkv, d, shared = CASES[case]
    q, kp, vp, tables, lens = _step(ctx, hq, hkv, d, shared=shared, kv_dtype=kv_dtype)
    want = reference.paged_attention(q, kp, vp, tables, list(range(len(lens) + 1)), lens, d ** -0.5)
    got = decode_planes(q, kp, vp, tables, lens, d ** -0.5)
    assert got is not None and got.shape == want.shape
    assert rel_err(got, want) < 4e-6


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_any_thread_count_gives_the_same_bits(kv_dtype):
    q, kp, vp, tables, lens = _step([50, 7, 33], 9, 3, 64, kv_dtype=kv_dtype)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(decode_planes(q, kp, vp, tables, lens, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_layer_op_takes_it_at_decode_and_not_for_a_prefill(monkeypatch, kv_dtype):
    q, kp, vp, tables, lens = _step([30, 12], 4, 2, 16, kv_dtype=kv_dtype)
    calls = []
    real = cpu_attention.PlanePair.decode
    monkeypatch.setattr(cpu_attention.PlanePair, "decode", lambda *a: calls.append(1) or real(*a))
    want = reference.paged_attention(q, kp, vp, tables, [0, 1, 2], lens, 0.25)
    got = cpu.paged_attention(q, kp, vp, tables, [0, 1, 2], lens, 0.25)
    assert rel_err(got, want) < 4e-6 and calls == [1]
    chunk = torch.randn(5, 4, 16)  # the last 4 and 1 tokens of the two contexts as a prefill chunk
    want = reference.paged_attention(chunk, kp, vp, tables, [0, 4, 5], lens, 0.25)
    assert rel_err(cpu.paged_attention(chunk, kp, vp, tables, [0, 4, 5], lens, 0.25), want) < 1e-5 and calls == [1]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_other_dtypes_and_head_dims_past_d_max_are_declined(kv_dtype):
    q, kp, vp, tables, lens = _step([20], 4, 2, 32, kv_dtype=kv_dtype)
    assert decode_planes(q.double(), kp, vp, tables, lens, 0.2) is None
    assert decode_planes(q, kp, vp, tables, lens, 0.2) is not None
    q, kp, vp, tables, lens = _step([20], 2, 1, cpu_attention.D_MAX + 8, kv_dtype=kv_dtype)
    assert cpu_attention.PlanePair.of(kp, vp) is None


def test_a_table_that_reads_outside_the_cache_is_refused():
    q, kp, vp, tables, lens = _step([20], 4, 2, 32)
    tables[0, 1] = PAGES * PER_PAGE  # one block past the last
    with pytest.raises(ValueError, match="outside the cache"):
        decode_planes(q, kp, vp, tables, lens, 0.2)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_planes(q, kp, vp, tables, [33], 0.2)
    with pytest.raises(ValueError, match="block_tables must have 2 rows"):  # a second query, no second table row
        decode_planes(torch.cat((q, q)), kp, vp, tables, [20, 20], 0.2)


@pytest.mark.parametrize("d", [256, 255])  # every code in the 8-wide loop; the last 7 in the scalar one
def test_every_e4m3_code_reads_as_fp8_dequantize_makes_it_nan_and_subnormals_included(d):
    """One key, so the output is its V row: V's codes 0..d-1 (E4M3's subnormals 0x01-0x07, its NaNs 0x7F and
    0xFF) at a scale of 2^-3 and at fp16's smallest, a subnormal one (2^-24)."""
    q, kp, vp, tables, lens = _step([1], 2, 1, d)
    block = int(tables[0, 0])
    at = (block // PER_PAGE, block % PER_PAGE, 0, 0)
    for scale in (0.125, 2.0 ** -24):
        vp.codes[at] = torch.arange(d, dtype=torch.uint8)
        vp.scales[at] = scale
        got = decode_planes(q, kp, vp, tables, lens, 0.1)
        want = fp8_dequantize(vp.codes[at], vp.scales[at])
        assert torch.isnan(want).sum() == (2 if d == 256 else 1)
        for row in got[0]:  # both query heads read the one value row
            torch.testing.assert_close(row, want, rtol=0, atol=0, equal_nan=True)


def test_a_sequence_without_a_new_token_takes_the_general_path(monkeypatch):
    q, kp, vp, tables, lens = _step([30, 12, 20], 4, 2, 16)
    calls = []
    monkeypatch.setattr(cpu_attention.PlanePair, "decode", lambda *a: calls.append(1))
    starts = [0, 1, 1, 2]  # the second sequence reads nothing this step
    want = reference.paged_attention(q[:2], kp, vp, tables, starts, lens, 0.25)
    assert rel_err(cpu.paged_attention(q[:2], kp, vp, tables, starts, lens, 0.25), want) < 1e-5 and not calls


def _same_planes(got, want) -> None:
    """got's planes (K, V) hold want's bytes; a rotated V's up to V_FLIPS of its codes one off and of its fp16
    steps and mins one fp16 step off."""
    for g, w in zip(got, want):
        if not w.fmt.rotated:
            assert torch.equal(g.codes, w.codes)
            assert torch.equal(g.scales.view(torch.int16), w.scales.view(torch.int16))
            continue
        for a, b in ((unpack(g.codes, 4, w.head_dim), unpack(w.codes, 4, w.head_dim)),
                     (g.scales.view(torch.int16).int(), w.scales.view(torch.int16).int())):
            off = (a - b).abs()
            assert off.max() <= 1 and (off > 0).float().mean() <= V_FLIPS, (int(off.max()), float((off > 0).sum()))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hkv, d", [(3, 64), (2, 20), (1, 256)])
def test_the_c_store_writes_kvplane_stores_bytes(hkv, d, kv_dtype):
    """Tokens at offset 0 and after it in one call (K's delta reads a token 0 written in the same call), others
    after tokens 0 written earlier, an all-zero head, values far apart in size (fp8: near fp16's and E4M3's
    edges): the same bytes."""
    g = torch.Generator().manual_seed(d)
    fmt = KV_FORMATS[kv_dtype]
    planes = []
    for _ in range(2):
        storage = torch.zeros((PAGES, PER_PAGE, fmt.block_bytes(2, BLOCK, hkv, d)), dtype=torch.uint8)
        planes.append(KVCache(storage, (0, 1), fmt=fmt, geometry=(BLOCK, hkv, d)).layer(1))
    blocks = torch.randperm(PAGES * PER_PAGE, generator=g)[:4]
    first = torch.cat([b * BLOCK + torch.arange(6) for b in blocks[:2].tolist()])  # blocks 0-1: tokens 0..5
    later = torch.cat([blocks[0:1] * BLOCK + 6, blocks[2:] * BLOCK, blocks[2:] * BLOCK + 9])  # more, and new blocks
    for slots in (first, later):
        x = torch.randn((len(slots), hkv, d), generator=g) * torch.logspace(-6, 4, len(slots))[:, None, None]
        x[0, 0] = 0.0  # a zero scale
        x[-1, -1, 1:] = 1e-30  # fp32 values far under E4M3's smallest step, an fp16 step's
        if kv_dtype == "fp8":
            x[-1, -1, 0] = 65504.0 * 448  # fp16's largest finite scale
            x[-2, 0, :2] = torch.tensor([-1e8, 3.0])  # a scale past fp16's: inf, every code a (signed) zero
        for (kc, vc), c_path in zip(planes, (False, True)):
            if c_path:
                assert store_planes(kc, vc, slots, x, x)
            else:
                kc.store(slots, x)
                vc.store(slots, x)
    _same_planes(planes[1], planes[0])


def test_the_c_store_declines_other_dtypes_and_refuses_bad_slots():
    x = torch.zeros(1, 2, 32)
    q, kp, vp, tables, lens = _step([20], 4, 2, 32)
    assert not store_planes(kp, vp, torch.tensor([0]), x.double(), x.double())
    with pytest.raises(ValueError, match="distinct"):
        store_planes(kp, vp, torch.tensor([3, 3]), torch.cat((x, x)), torch.cat((x, x)))
    with pytest.raises(ValueError, match="slots must be in"):
        store_planes(kp, vp, torch.tensor([PAGES * PER_PAGE * BLOCK]), x, x)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_c_store_leaves_out_the_rows_without_a_slot(kv_dtype):
    """A step's padding rows (slot -1) are not written; the others as `KVPlane.store` writes them."""
    g = torch.Generator().manual_seed(5)
    slots = torch.tensor([-1, 7 * BLOCK, -1, 7 * BLOCK + 1, 2 * BLOCK])
    k, v = torch.randn((5, 2, 32), generator=g), torch.randn((5, 2, 32), generator=g)
    _, want_k, want_v, _, _ = _step([20], 4, 2, 32, kv_dtype=kv_dtype)
    _, kp, vp, _, _ = _step([20], 4, 2, 32, kv_dtype=kv_dtype)
    keep = slots >= 0
    want_k.store(slots[keep], k[keep])
    want_v.store(slots[keep], v[keep])
    assert store_planes(kp, vp, slots, k, v)
    _same_planes((kp, vp), (want_k, want_v))


def test_a_build_without_f16c_converts_by_hand_to_the_same_values_and_bytes(tmp_path, monkeypatch):
    """The fp16 and E4M3 conversions made by hand where F16C is not compiled in (-mno-f16c): every code read, a
    store's bytes and the attention as with F16C."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / "no_f16c.so"
    done = subprocess.run([cc, *cpu_blocks.FLAGS, "-mno-f16c", "-o", str(out), *map(str, cpu_blocks.SOURCES)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    monkeypatch.setattr(cpu_blocks, "_lib", lambda lib=cpu_blocks.declare(ctypes.CDLL(str(out))): lib)
    test_every_e4m3_code_reads_as_fp8_dequantize_makes_it_nan_and_subnormals_included(256)
    for kv_dtype in KV_DTYPES:
        test_the_c_store_writes_kvplane_stores_bytes(3, 64, kv_dtype)
        test_the_decode_reads_the_codes_as_the_reference_dequantizes_them("smollm2_heads", kv_dtype)
