"""The host backend's attention (kernels/cpu.py) against `kernels/reference.py`: the batched paged
attention (one gather, one masked softmax for all sequences) and the whole layer op (qk-norm,
RoPE, KV write, attention), on odd shapes: head dims 8..80, GQA and MHA, one block or many,
a batch of one, decode rows, prefill chunks and both mixed in one step, sequences with no new
token. Caches are strided views of an interleaved storage with shuffled block tables, as the
engine lays them out. fp32 must match within 1e-5 of max|ref| (the same products, summed in
another order). The decode kernel that reads the cache in place (kernels/cpu_attention.py) is
held to 4e-6 (below)."""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import cpu, cpu_attention, reference
from tests.kernels.compare import rel_err

BLOCK = 16
PER_PAGE = 3


def _layout(q_lens, ctx_lens, q_heads, kv_heads, head_dim, seed=0):
    """(q [T, Hq, D], k_cache, v_cache [P, N, S, Hkv, D] strided views, block_tables [B, nb] int32,
    query_start, seq_lens) with the context already in the cache."""
    g = torch.Generator().manual_seed(seed)
    needed = sum(-(-c // BLOCK) for c in ctx_lens) + 1
    pages = -(-needed // PER_PAGE) + 1
    storage = torch.randn((pages, PER_PAGE, 2, 2, BLOCK, kv_heads, head_dim), generator=g)
    free = torch.randperm(pages * PER_PAGE, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-c // BLOCK))] for c in ctx_lens]
    width = max((len(t) for t in tables), default=1) or 1
    block_tables = torch.zeros((len(ctx_lens), width), dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], q_heads, head_dim), generator=g)
    return q, storage[:, :, 1, 0], storage[:, :, 1, 1], block_tables, starts, list(ctx_lens)


CASES = {  # name: (q_lens, ctx_lens, Hq, Hkv, D)
    "decode_batch_of_one": ([1], [1], 4, 2, 8),
    "decode_one_long": ([1], [77], 9, 3, 64),
    "decode_batch": ([1, 1, 1, 1, 1], [5, 16, 17, 48, 33], 6, 2, 24),
    "prefill_one_block": ([7], [7], 4, 4, 16),
    "prefill_chunk_after_context": ([19], [50], 8, 2, 80),
    "mixed_prefill_and_decode": ([1, 23, 1, 5], [40, 23, 3, 70], 6, 3, 40),
    "sequence_without_new_tokens": ([3, 0, 2], [3, 20, 9], 4, 1, 12),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tensors", [False, True], ids=["host_tuples", "int_tensors"])
def test_paged_attention_matches_the_reference(case, tensors):
    q_lens, ctx_lens, hq, hkv, d = CASES[case]
    q, k_cache, v_cache, tables, starts, lens = _layout(q_lens, ctx_lens, hq, hkv, d)
    want = reference.paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)
    if tensors:
        starts, lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    got = cpu.paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)
    assert got.shape == want.shape and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("case", ["decode_batch", "mixed_prefill_and_decode", "sequence_without_new_tokens"])
def test_what_lies_past_a_context_never_reaches_the_output_even_nan(case):
    """KV pages share the arena with expert pages: the unwritten tail of a block, and the padding
    blocks of a shorter context, hold whatever was there (a compact expert's bytes read as floats
    include NaN and inf)."""
    q_lens, ctx_lens, hq, hkv, d = CASES[case]
    q, k_cache, v_cache, tables, starts, lens = _layout(q_lens, ctx_lens, hq, hkv, d)
    want = reference.paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)
    written = {(int(row[t // BLOCK]), t % BLOCK) for row, n in zip(tables, lens) for t in range(n)}
    for block in range(k_cache.shape[0] * PER_PAGE):
        for slot in range(BLOCK):
            if (block, slot) not in written:  # every token slot no context holds: NaN or inf
                for cache in (k_cache, v_cache):
                    cache[block // PER_PAGE, block % PER_PAGE, slot] = float("nan") if slot % 2 else float("inf")
    got = cpu.paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("case", ["decode_batch", "mixed_prefill_and_decode", "prefill_chunk_after_context"])
@pytest.mark.parametrize("qk_norm", [None, "plain", "zero_centred"])
@pytest.mark.parametrize("partial_rotary", [False, True])
def test_rotary_paged_attention_matches_the_reference_and_writes_the_same_cache(case, qk_norm, partial_rotary):
    """The layer op: the caches it writes equal the reference's bit for bit (same rotation, same
    products), its output within rounding; a slot < 0 (a padding row) writes nothing."""
    q_lens, ctx_lens, hq, hkv, d = CASES[case]
    q, k_cache, v_cache, tables, starts, lens = _layout(q_lens, ctx_lens, hq, hkv, d, seed=3)
    g = torch.Generator().manual_seed(5)
    t = q.shape[0]
    k, v = torch.randn((t, hkv, d), generator=g), torch.randn((t, hkv, d), generator=g)
    seq = [b for b, n in enumerate(q_lens) for _ in range(n)]
    positions = torch.tensor([lens[b] - q_lens[b] + i for b, n in enumerate(q_lens) for i in range(n)])
    slots = torch.tensor([int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in zip(seq, positions.tolist())])
    slots[0] = -1  # a padding row: its k, v go nowhere
    inv_freq = reference.rotary_inv_freq(d // 2 if partial_rotary else d, 10000.0, "cpu")
    norms = {} if qk_norm is None else dict(
        q_weight=torch.randn(d, generator=g), k_weight=torch.randn(d, generator=g), eps=1e-6,
        zero_centred=qk_norm == "zero_centred")
    runs = []
    for op in (reference.rotary_paged_attention, cpu.rotary_paged_attention):
        storage = k_cache._base.clone()  # a fresh copy of the interleaved layout, as the engine's
        kc, vc = storage[:, :, 1, 0], storage[:, :, 1, 1]
        out = op(q, k, v, positions, inv_freq, kc, vc, slots, tables, starts, lens, d ** -0.5,
                 decode=case == "decode_batch", **norms)
        runs.append((out, kc, vc))
    (want, kw, vw), (got, kg, vg) = runs
    assert torch.equal(kg, kw) and torch.equal(vg, vw)
    assert rel_err(got, want) < 1e-5


def test_a_cache_whose_pages_do_not_merge_into_one_block_axis_is_gathered_the_same():
    """A view that drops a page's last block (page stride != N blocks) is read the same."""
    q, k_cache, v_cache, tables, starts, lens = _layout([1, 4], [30, 9], 4, 2, 16)
    k_cache, v_cache = k_cache[:, : PER_PAGE - 1], v_cache[:, : PER_PAGE - 1]
    tables = tables % (k_cache.shape[0] * (PER_PAGE - 1))  # block ids of the narrower view (reads only)
    want = reference.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)
    assert rel_err(cpu.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25), want) < 1e-5


def test_decode_flag_refuses_a_prefill_step_like_the_reference():
    q, k_cache, v_cache, tables, starts, lens = _layout([2, 1], [2, 5], 2, 1, 8)
    t = q.shape[0]
    with pytest.raises(ValueError, match="one query row per sequence"):
        cpu.rotary_paged_attention(q, q[:, :1], q[:, :1], torch.zeros(t, dtype=torch.int64),
                                   reference.rotary_inv_freq(8, 1e4, "cpu"), k_cache, v_cache,
                                   torch.full((t,), -1), tables, starts, lens, 1.0, decode=True)


# The in-place decode kernel (kernels/cpu_attention.py) against the reference: within 4e-6 of max |ref|. Its
# scores, exponentials and weighted sums are the reference's fp32 products summed in another order (8 lane sums
# of a dot, a running maximum rescaled per chunk of keys, one division at the end) and its e^x is within 1 unit
# of fp32 rounding, so the two differ by rounding that grows with the context: on the cases below 0 with one key,
# up to 1.0e-7 within 64 keys and 9.9e-7 where a sequence reads 213 (torch's SDPA path on the same cases: 0, 1.0e-7,
# 7.1e-7). 4e-6 leaves 4x of that; one key left out of 213, or the scale off by 0.1%, moves the output by 6e-4
# or more.
LONG = 13 * BLOCK + 5  # a context crossing 14 blocks (several of the kernel's chunks of keys)
needs_c = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler: the C kernels are not built")


def _context(tables, lens, k_cache, v_cache):
    """(the step's `cpu_attention.Context` writing no row, the cache pair's `_Rows`)."""
    rows = cpu._rows_of(k_cache, v_cache)
    blocks = cpu._block_rows(tables.long(), rows.layout)
    return cpu_attention.Context(blocks, torch.tensor(lens), k_cache.shape[2], _no_rows(len(lens))), rows


def _no_rows(b: int) -> torch.Tensor:
    return torch.full((b,), -1, dtype=torch.int64)


def _attend(context, q, flat, v_rows, scale):
    """`context`'s attention alone: `rotary` by the identity (cos 1, sin 0: each q value x * 1 + y * 0 = x) where
    the context writes no row (`_no_rows`)."""
    b, _, d = q.shape
    nothing = torch.zeros(b, flat.shape[1] // d, d)
    return context.rotary(q, nothing, nothing, torch.ones(b, d), torch.zeros(b, d), flat, v_rows, scale)[0]


def _poison_unread(tables, lens, k_cache, v_cache):
    """Every slot no context holds: NaN or inf (what an arena's other pages may hold)."""
    written = {(int(row[t // BLOCK]), t % BLOCK) for row, n in zip(tables, lens) for t in range(n)}
    for block in range(k_cache.shape[0] * PER_PAGE):
        for slot in range(BLOCK):
            if (block, slot) not in written:
                for cache in (k_cache, v_cache):
                    cache[block // PER_PAGE, block % PER_PAGE, slot] = float("nan") if slot % 2 else float("inf")


@needs_c
@pytest.mark.parametrize("first", [1, LONG], ids=["context_1", "context_long"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ratio", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("b", range(1, 9))
def test_the_in_place_decode_kernel_matches_the_reference(b, ratio, d, first):
    """Unequal contexts (the first sequence's `first`, the others drawn from 1..LONG), each read in place from
    shuffled blocks; the slots no context holds are NaN or inf, so a key read past a context shows."""
    g = torch.Generator().manual_seed(b * 100 + ratio * 10 + d)
    lens = [first] + torch.randint(1, LONG + 1, (b - 1,), generator=g).tolist()
    hkv = 3
    q, k_cache, v_cache, tables, starts, lens = _layout([1] * b, lens, hkv * ratio, hkv, d, seed=b)
    _poison_unread(tables, lens, k_cache, v_cache)
    want = reference.paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)
    context, rows = _context(tables, lens, k_cache, v_cache)
    got = _attend(context, q, rows.flat, rows.layout[3], d ** -0.5)
    assert got.shape == want.shape and torch.isfinite(got).all() and rel_err(got, want) < 4e-6


@needs_c
@pytest.mark.parametrize("d", [12, 20])
def test_the_in_place_decode_kernel_reads_head_dims_that_are_no_multiple_of_8(d):
    """Such heads take the kernel's lane-by-lane loops (no 8-wide vectors)."""
    q, k_cache, v_cache, tables, starts, lens = _layout([1] * 3, [LONG, 1, 40], 6, 2, d, seed=d)
    _poison_unread(tables, lens, k_cache, v_cache)
    want = reference.paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)
    context, rows = _context(tables, lens, k_cache, v_cache)
    got = _attend(context, q, rows.flat, rows.layout[3], d ** -0.5)
    assert torch.isfinite(got).all() and rel_err(got, want) < 4e-6


@needs_c
def test_the_in_place_decode_kernel_gives_the_same_bits_on_any_thread_count_and_q_stride():
    """One thread computes a (sequence, KV head) pair whole: the thread count changes no sum; q may be a view
    whose rows are wider than Hq * D (the fused q/k/v projection's)."""
    q, k_cache, v_cache, tables, _, lens = _layout([1] * 5, [LONG, 1, 40, 17, 90], 9, 3, 64)
    context, rows = _context(tables, lens, k_cache, v_cache)
    wide = torch.cat((q, torch.randn(5, 6, 64)), dim=1)[:, :9]  # rows 15 * 64 apart
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(context, q, rows.flat, rows.layout[3], 0.125)
        torch.set_num_threads(2)
        assert torch.equal(_attend(context, q, rows.flat, rows.layout[3], 0.125), one)
        assert torch.equal(_attend(context, wide, rows.flat, rows.layout[3], 0.125), one)
    finally:
        torch.set_num_threads(threads)


@needs_c
def test_the_in_place_decode_kernel_refuses_what_would_read_outside_the_cache():
    q, k_cache, v_cache, tables, _, lens = _layout([1, 1], [20, 3], 4, 2, 16)
    rows = cpu._rows_of(k_cache, v_cache)
    blocks = cpu._block_rows(tables.long(), rows.layout)
    with pytest.raises(ValueError, match="lens must be"):
        cpu_attention.Context(blocks, torch.tensor([20, 2 * BLOCK + 1]), BLOCK, _no_rows(2))  # past 2 blocks
    context = cpu_attention.Context(blocks, torch.tensor(lens), BLOCK, _no_rows(2))
    with pytest.raises(ValueError, match="the keys read reach row"):
        _attend(context, q, rows.flat[: int(blocks.max())], rows.layout[3], 0.25)
    with pytest.raises(ValueError, match="do not fit"):
        _attend(context, q[:1], rows.flat, rows.layout[3], 0.25)


def _decode_layer_op(seed=3):
    """`cpu.rotary_paged_attention` at decode over unequal contexts against the reference's: (out, want) and
    the caches each wrote, compared bit for bit."""
    q_lens, ctx_lens, hq, hkv, d = CASES["decode_batch"]
    q, k_cache, v_cache, tables, starts, lens = _layout(q_lens, ctx_lens, hq, hkv, d, seed=seed)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn((len(q), hkv, d), generator=g), torch.randn((len(q), hkv, d), generator=g)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in enumerate(positions.tolist())])
    inv_freq = reference.rotary_inv_freq(d, 10000.0, "cpu")
    runs = []
    for op in (cpu.rotary_paged_attention, reference.rotary_paged_attention):
        storage = k_cache._base.clone()
        kc, vc = storage[:, :, 1, 0], storage[:, :, 1, 1]
        runs.append((op(q, k, v, positions, inv_freq, kc, vc, slots, tables, starts, lens, d ** -0.5, decode=True),
                     kc, vc))
    (got, kg, vg), (want, kw, vw) = runs
    assert torch.equal(kg, kw) and torch.equal(vg, vw)
    return got, want


@needs_c
def test_the_layer_op_reads_a_decode_step_through_the_in_place_kernel(monkeypatch):
    calls = []
    run = cpu_attention.Context.rotary
    monkeypatch.setattr(cpu_attention.Context, "rotary", lambda self, *a: calls.append(1) or run(self, *a))
    got, want = _decode_layer_op(seed=7)
    assert calls and rel_err(got, want) < 4e-6


# The fused call (`Context.rotary`: rotation, K/V write and attention in one C call) against the unfused torch path
# it replaces (`cpu._rotate_qk`, then `cpu._write`, then the kernel's attention alone over the rotated q): the
# rotated q and every cache row bit for bit (the rotation is the same products and sums, without fused
# multiply-adds), hence the same output bit for bit (the same kernel over the same bits); tolerance 0.
@needs_c
@pytest.mark.parametrize("partial", [False, True], ids=["rope_whole_head", "rope_half_head"])
@pytest.mark.parametrize("d", [64, 20])
@pytest.mark.parametrize("ratio", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("b", [1, 2, 8])
def test_the_fused_rotary_call_equals_the_unfused_torch_path_bit_for_bit(b, ratio, d, partial):
    """q, k and v are views of one fused q/k/v projection's rows (as the model hands them), contexts unequal; past
    b1 the first sequence's slot a padding row's (-1: it writes nothing, its q still rotated and attended)."""
    g = torch.Generator().manual_seed(b * 100 + ratio * 10 + d)
    hkv = 3
    hq = hkv * ratio
    lens = [LONG] + torch.randint(1, LONG + 1, (b - 1,), generator=g).tolist()
    _, k_cache, v_cache, tables, _, lens = _layout([1] * b, lens, hq, hkv, d, seed=b)
    qkv = torch.randn((b, (hq + 2 * hkv) * d), generator=g).view(b, hq + 2 * hkv, d)
    q, k, v = qkv.split_with_sizes((hq, hkv, hkv), dim=1)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for i, p in enumerate(positions.tolist())])
    if b > 1:
        slots[0] = -1
    cos, sin = cpu._rope_tables.__wrapped__(positions, reference.rotary_inv_freq(d // 2 if partial else d, 1e4, "cpu"),
                                            torch.float32)
    storage = k_cache._base
    runs = []
    for fused in (True, False):
        base = storage.clone()  # each run writes its own copy of the interleaved layout
        kc, vc = base[:, :, 1, 0], base[:, :, 1, 1]
        rows = cpu._rows_of(kc, vc)
        kept, write_at = cpu._write_plan.__wrapped__(slots, BLOCK, rows.layout)
        k_rows = write_at[:b] if kept is None else \
            torch.full((b,), -1, dtype=torch.int64).index_copy_(0, kept, write_at[:len(kept)])
        context = cpu_attention.Context(cpu._block_rows(tables.long(), rows.layout), torch.tensor(lens), BLOCK, k_rows)
        if fused:
            out, q_rot = context.rotary(q, k, v, cos, sin, rows.flat, rows.layout[3], d ** -0.5)
        else:
            q_rot, k_rot = cpu._rotate_qk(q, k, cos, sin)
            cpu._write(rows, kc, vc, k_rot, v, slots)
            reader = cpu_attention.Context(context.block_rows, context.lens, BLOCK, _no_rows(b))  # writes nothing
            out = _attend(reader, q_rot, rows.flat, rows.layout[3], d ** -0.5)
        runs.append((out, q_rot, base))
    (out, q_rot, base), (want, q_want, base_want) = runs
    assert not torch.equal(q_rot, q)  # rotated (positions >= 1 for all but a context of one key)
    assert torch.equal(q_rot, q_want) and torch.equal(base, base_want) and torch.equal(out, want)
    assert not torch.equal(base, storage)  # the new tokens were written


@needs_c
def test_the_fused_rotary_call_refuses_tables_or_rows_that_do_not_fit():
    q, k_cache, v_cache, tables, _, lens = _layout([1, 1], [20, 3], 4, 2, 16)
    rows = cpu._rows_of(k_cache, v_cache)
    blocks = cpu._block_rows(tables.long(), rows.layout)
    k = v = torch.randn(2, 2, 16)
    cos, sin = cpu._rope_tables.__wrapped__(torch.tensor([19, 2]), reference.rotary_inv_freq(16, 1e4, "cpu"),
                                            torch.float32)
    with pytest.raises(ValueError, match="write_rows must be"):
        cpu_attention.Context(blocks, torch.tensor(lens), BLOCK, torch.tensor([3]))
    context = cpu_attention.Context(blocks, torch.tensor(lens), BLOCK, torch.tensor([5, rows.flat.shape[0]]))
    with pytest.raises(ValueError, match="the keys read reach row"):  # a row written past the cache
        context.rotary(q, k, v, cos, sin, rows.flat, rows.layout[3], 0.25)
    context = cpu_attention.Context(blocks, torch.tensor(lens), BLOCK, torch.tensor([5, -1]))
    with pytest.raises(ValueError, match="must be"):
        context.rotary(q, k[:, :1], v, cos, sin, rows.flat, rows.layout[3], 0.25)
    with pytest.raises(ValueError, match="must be"):
        context.rotary(q, k, v, cos[..., :15], sin[..., :15], rows.flat, rows.layout[3], 0.25)


def test_without_the_c_kernels_a_decode_step_is_gathered_for_sdpa_as_before(monkeypatch):
    """No C compiler: the torch path (one gather of the context's rows, SDPA under the additive mask)."""
    def refused(*_):
        raise AssertionError("the C kernel was used though unavailable")

    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    monkeypatch.setattr(cpu_attention, "Context", refused)
    got, want = _decode_layer_op(seed=11)
    assert rel_err(got, want) < 1e-5
