"""The host backend's attention (kernels/cpu.py) against `kernels/reference.py`: the batched paged
attention (one gather, one masked softmax for all sequences) and the whole layer op (qk-norm,
RoPE, KV write, attention), on odd shapes: head dims 8..80, GQA and MHA, one block or many,
a batch of one, decode rows, prefill chunks and both mixed in one step, sequences with no new
token. Caches are strided views of an interleaved storage with shuffled block tables, as the
engine lays them out. fp32 must match within 1e-5 of max|ref| (the same products, summed in
another order)."""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import cpu, reference
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
