"""The Triton paged attention, alone and as the layer's fused decode op (qk-norm, RoPE and the
KV write in its launch), against `kernels/reference.py` and against the two launches it replaces.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set by tests/kernels/interpreter.py before triton is imported), so shapes stay small. Layouts are the
product's: caches are strided [P, N, S, Hkv, D] views of an interleaved
[P, N, L, 2, S, Hkv, D] storage with two blocks per page, block tables shuffled
across pages. fp32 must match within 1e-4 of max|ref| (IEEE products); bf16
within 1e-2 of the fp32 reference on the same (bf16-rounded) inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.interpreter import DEVICE, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

from radianced.kernels import attention, reference, rope

require_interpreted(attention._paged_attention_kernel, "attention")

BLOCK = 16  # tokens per block
PER_PAGE = 2  # blocks per page


class Paged:
    """A batch laid out as the engine lays it: context in shuffled paged blocks, new queries last."""

    def __init__(self, q_lens: list[int], ctx_lens: list[int], q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        needed = sum(-(-c // BLOCK) for c in ctx_lens) + 1
        pages = -(-needed // PER_PAGE) + 1
        # [P, N, L, 2, S, Hkv, D]: the KV storage; this layer's K and V are strided views into it
        storage = torch.randn((pages, PER_PAGE, layers, 2, BLOCK, kv_heads, head_dim), generator=g)
        self.storage = storage.to(dtype).to(DEVICE)
        self.k_cache, self.v_cache = self.storage[:, :, 1, 0], self.storage[:, :, 1, 1]
        free = torch.randperm(pages * PER_PAGE, generator=g).tolist()
        tables = [[free.pop() for _ in range(-(-c // BLOCK))] for c in ctx_lens]
        width = max((len(t) for t in tables), default=1) or 1
        self.block_tables = torch.zeros((len(ctx_lens), width), dtype=torch.int32)
        for b, t in enumerate(tables):
            self.block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        self.block_tables = self.block_tables.to(DEVICE)
        self.query_start = [0]
        for n in q_lens:
            self.query_start.append(self.query_start[-1] + n)
        self.seq_lens = list(ctx_lens)
        self.q = torch.randn((self.query_start[-1], q_heads, head_dim), generator=g).to(dtype).to(DEVICE)
        self.scale = head_dim ** -0.5

    def reference(self) -> torch.Tensor:
        """fp32 truth on the same (possibly bf16-rounded) values."""
        return reference.paged_attention(self.q.float().cpu(), self.k_cache.float().cpu(),
                                         self.v_cache.float().cpu(), self.block_tables.cpu(),
                                         self.query_start, self.seq_lens, self.scale)

    def kernel(self, **kw) -> torch.Tensor:
        return attention.paged_attention(self.q, self.k_cache, self.v_cache, self.block_tables,
                                         self.query_start, self.seq_lens, self.scale, **kw).cpu()


@pytest.mark.parametrize("t", [1, 15, 63, 300])
def test_prefill_of_a_fresh_sequence_matches_reference(t):
    """SmolLM2's 9 query / 3 KV heads (a non-power-of-two group) at head dim 64."""
    batch = Paged([t], [t], q_heads=9, kv_heads=3, head_dim=64)
    assert rel_err(batch.kernel(), batch.reference()) < 1e-4


@pytest.mark.parametrize("t, before", [(15, 37), (63, 1), (40, 80)])
def test_prefill_chunk_after_cached_context_matches_reference(t, before):
    """A later chunk of a prompt: its queries sit at positions before .. before + t - 1."""
    batch = Paged([t], [before + t], q_heads=9, kv_heads=3, head_dim=64, seed=1)
    assert rel_err(batch.kernel(), batch.reference()) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_of_decodes_chunks_and_an_empty_sequence(dtype):
    """Decode rows, prefill chunks, a sequence with no new rows (skipped) and one fresh prompt in one step."""
    q_lens = [1, 15, 0, 1, 33, 7]
    ctx_lens = [37, 15, 5, 1, 100, 40]
    batch = Paged(q_lens, ctx_lens, q_heads=9, kv_heads=3, head_dim=64, dtype=dtype, seed=2)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(batch.kernel(), batch.reference()) < tol


@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(64, 4, 4), (128, 8, 2), (256, 4, 1)])
def test_head_dims_and_gqa_groups(head_dim, q_heads, kv_heads):
    """Head dims 64, 128, 256 (Qwen3-Next) with groups of 1, 4 and 4 query heads per KV head."""
    batch = Paged([1, 9, 20], [30, 9, 50], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, seed=3)
    assert rel_err(batch.kernel(), batch.reference()) < 1e-4


@pytest.mark.parametrize("splits", [2, 3, 5, 64])
def test_decode_split_over_keys_merges_to_the_reference(splits):
    """Flash-decoding splits, including splits left empty by short contexts (1 and 17 tokens)."""
    batch = Paged([1, 1, 1, 1], [1, 17, 130, 64], q_heads=8, kv_heads=2, head_dim=64, seed=4)
    expected = batch.reference()
    assert rel_err(batch.kernel(num_splits=splits), expected) < 1e-4
    assert rel_err(batch.kernel(num_splits=1), expected) < 1e-4


@pytest.mark.parametrize("sms", [78, 132, 256])
def test_the_receipt_bounds_the_split_partials(monkeypatch, sms):
    """sizing.activation_bytes charges splits x rows partial rows up to PROGRAMS_PER_SM x MAX_SMS / Hkv: what
    attention_config gives any decode batch on a device of up to MAX_SMS SMs."""
    from radianced import sizing

    assert attention.MAX_SPLITS == sizing.ATTENTION_MAX_SPLITS and sms <= sizing.MAX_SMS
    assert attention.MAX_PROGRAMS_PER_SM == sizing.ATTENTION_PROGRAMS_PER_SM
    monkeypatch.setattr(attention.pdl, "sm_count", lambda device: sms)
    for kv_heads in (1, 2, 4, 8):
        bound = sizing.ATTENTION_PROGRAMS_PER_SM * sizing.MAX_SMS // kv_heads
        for rows in range(1, 300):
            cfg = attention.attention_config(rows, rows, 8 * kv_heads, kv_heads, 128, torch.device("cuda"))
            assert cfg.num_splits == 1 or cfg.num_splits * rows <= min(rows * sizing.ATTENTION_MAX_SPLITS, bound)


# (k_bits, v_bits) of each format, as kv_int.kernel_cache gives them to attention_config
FORMAT_BITS = {"auto": (0, 0), "fp8": (8, 8), "fp8_v4": (8, 4), "k6_v4": (6, 4)}
QWEN3, NEXT = (32, 4, 128), (16, 2, 256)  # Hq, Hkv, D
CONFIG_STEPS = ((4096, 1, False), (300, 4, False), (8, 8, True), (32, 32, True))  # T, B, decode-like


def test_auto_keeps_its_tiles_at_the_measured_shapes(monkeypatch):
    """auto's configs at tools/sweep_attention.py's shapes (H200: 132 SMs): a 4K prefill, decode b8 and b32 at
    16K (as when the fp8 tiles were chosen, but decode's MIN_SPLITS: b32's 2 splits became 8)."""
    monkeypatch.setattr(attention.pdl, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    got = {(heads[2], t, b): attention.attention_config(t, b, *heads, cuda, 4096 if t > b else 16384)
           for heads in (QWEN3, NEXT) for t, b in ((4096, 1), (8, 8), (32, 32))}
    assert got == {(128, 4096, 1): attention.AttentionConfig(64, 8, 64, 1, 4, 2),
                   (128, 8, 8): attention.AttentionConfig(16, 2, 64, 8, 4, 2),
                   (128, 32, 32): attention.AttentionConfig(16, 2, 64, 8, 4, 2),
                   (256, 4096, 1): attention.AttentionConfig(32, 4, 32, 1, 4, 2),
                   (256, 8, 8): attention.AttentionConfig(16, 2, 32, 16, 4, 2),
                   (256, 32, 32): attention.AttentionConfig(16, 2, 32, 8, 4, 2)}


@pytest.mark.parametrize("fmt", list(FORMAT_BITS))
@pytest.mark.parametrize("heads", [(9, 3, 64), QWEN3, NEXT])
def test_fp8_alone_takes_its_measured_tiles(monkeypatch, fmt, heads):
    """attention_config's fp8 tiles (bench/results/2026-12-03-h200-9ec6e66-sweep-attention.json): 128-key
    prefill tiles and 3 stages at decode, at head dim <= 128; every other format and head dim keeps auto's
    (an int6 K's decode its 8 warps)."""
    monkeypatch.setattr(attention.pdl, "sm_count", lambda device: 132)
    fp8 = fmt == "fp8" and heads[2] <= 128
    for t, b, decode in CONFIG_STEPS:
        auto = attention.attention_config(t, b, *heads, torch.device("cuda"), 16384)
        got = attention.attention_config(t, b, *heads, torch.device("cuda"), 16384, None, *FORMAT_BITS[fmt])
        assert got == dataclasses.replace(auto, block_n=128 if fp8 and not decode else auto.block_n,
                                          num_stages=3 if fp8 and decode else auto.num_stages,
                                          num_warps=8 if fmt == "k6_v4" and decode else auto.num_warps)


def test_decode_split_in_bf16():
    batch = Paged([1, 1], [90, 7], q_heads=9, kv_heads=3, head_dim=64, dtype=torch.bfloat16, seed=5)
    assert rel_err(batch.kernel(num_splits=4), batch.reference()) < 1e-2


def test_lengths_as_device_tensors_give_the_same_result():
    """The graph-capturable spelling: query_start and seq_lens already on the device."""
    batch = Paged([1, 15, 4], [20, 15, 40], q_heads=9, kv_heads=3, head_dim=64, seed=6)
    qs = torch.tensor(batch.query_start, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(batch.seq_lens, dtype=torch.int64, device=DEVICE)
    as_tensors = attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, qs, sl,
                                           batch.scale).cpu()
    assert torch.equal(as_tensors, batch.kernel())


def test_bad_head_ratio_is_refused_with_the_numbers():
    batch = Paged([1], [4], q_heads=4, kv_heads=4, head_dim=64)
    q = torch.randn(1, 6, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of KV heads \(4\)"):
        attention.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, [0, 1], [4], 0.1)


# -- the fused decode: qk-norm, RoPE and the KV write in the attention launch ----------------------

THETA = 10000.0


class Step:
    """One step of an attention layer from its q/k/v projection, as the engine lays it out: new
    tokens at the end of each context, their KV slots where the block tables put them, q, k, v
    strided views of one [T, (Hq + 2 Hkv) * D] projection (`gated`: [T, (2 Hq + 2 Hkv) * D], each
    query head beside its output gate, as Qwen3-Next's). A `padding` row is a decode graph's: one
    key of context, slot -1."""

    def __init__(self, q_lens: list[int], ctx_lens: list[int], q_heads: int, kv_heads: int, head_dim: int,
                 rotary_dim: int, qk_norm: bool = False, zero_centred: bool = False, gated: bool = False,
                 dtype: torch.dtype = torch.float32, padding: tuple[int, ...] = (), seed: int = 0):
        self.paged = Paged(q_lens, ctx_lens, q_heads, kv_heads, head_dim, dtype, seed=seed)
        g = torch.Generator().manual_seed(seed + 100)
        t = self.paged.query_start[-1]
        q_width = (2 if gated else 1) * q_heads * head_dim
        proj = torch.randn((t, q_width + 2 * kv_heads * head_dim), generator=g).to(dtype).to(DEVICE)
        q, k, v = proj.split([q_width, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        self.q = q.reshape(t, q_heads, -1)[:, :, :head_dim]
        self.k, self.v = k.reshape(t, kv_heads, head_dim), v.reshape(t, kv_heads, head_dim)
        positions, slots = [], []
        tables = self.paged.block_tables.tolist()
        for b, (n, ctx) in enumerate(zip(q_lens, ctx_lens)):
            for pos in range(ctx - n, ctx):
                positions.append(pos)
                slots.append(-1 if b in padding else tables[b][pos // BLOCK] * BLOCK + pos % BLOCK)
        self.positions = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        self.inv_freq = reference.rotary_inv_freq(rotary_dim, THETA, DEVICE)
        self.norms = {}
        if qk_norm:
            qw, kw = (torch.randn(head_dim, generator=g) * 0.2 for _ in range(2))
            self.norms = dict(q_weight=qw.to(dtype).to(DEVICE), k_weight=kw.to(dtype).to(DEVICE),
                              zero_centred=zero_centred)

    def fused(self, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, KV storage after the step) of `rotary_paged_attention`, on a copy of the storage."""
        storage = self.paged.storage.clone()
        k_cache, v_cache = storage[:, :, 1, 0], storage[:, :, 1, 1]
        out = attention.rotary_paged_attention(self.q, self.k, self.v, self.positions, self.inv_freq, k_cache,
                                               v_cache, self.slots, self.paged.block_tables, self.paged.query_start,
                                               self.paged.seq_lens, self.paged.scale, **self.norms, **kw)
        return out.cpu(), storage.cpu()

    def two_launches(self, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """The same through `rope.rotary_write_kv` then `paged_attention`."""
        storage = self.paged.storage.clone()
        k_cache, v_cache = storage[:, :, 1, 0], storage[:, :, 1, 1]
        q = rope.rotary_write_kv(self.q, self.k, self.v, self.positions, self.inv_freq, k_cache, v_cache, self.slots,
                                 **self.norms)
        out = attention.paged_attention(q, k_cache, v_cache, self.paged.block_tables, self.paged.query_start,
                                        self.paged.seq_lens, self.paged.scale, **kw)
        return out.cpu(), storage.cpu()

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 truth on the same values: `reference.rotary_paged_attention`."""
        storage = self.paged.storage.float().cpu()
        norms = {name: w.float().cpu() if isinstance(w, torch.Tensor) else w for name, w in self.norms.items()}
        out = reference.rotary_paged_attention(
            self.q.float().cpu(), self.k.float().cpu(), self.v.float().cpu(), self.positions.cpu(),
            self.inv_freq.cpu(), storage[:, :, 1, 0], storage[:, :, 1, 1], self.slots.cpu(),
            self.paged.block_tables.cpu(), self.paged.query_start, self.paged.seq_lens, self.paged.scale, **norms)
        return out, storage


DECODE_CASES = {
    # name: (contexts, Hq, Hkv, D, rotary dim, qk-norm, zero-centred and gated (Qwen3-Next), splits, dtype)
    "b1_group1_ctx_ends_on_a_block": ([32], 4, 4, 64, 64, False, False, 1, torch.float32),
    "b1_group4_ctx_just_past_a_block_split": ([33], 8, 2, 128, 128, True, False, 3, torch.bfloat16),
    "b3_group3_partial_rotary_next": ([16, 17, 50], 9, 3, 64, 16, True, True, 1, torch.bfloat16),
    "b3_group4_hd128_split_with_an_empty_split": ([1, 40, 95], 8, 2, 128, 128, True, False, 4, torch.float32),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_fused_decode_gives_the_bits_of_the_two_launches(case):
    """`rotary_paged_attention(decode=True)` (one launch + merge) against rope.rotary_write_kv then
    paged_attention: the same output and the same caches, bit for bit; both near the fp32 truth."""
    ctx_lens, hq, hkv, d, rot, qk_norm, next_like, splits, dtype = DECODE_CASES[case]
    step = Step([1] * len(ctx_lens), ctx_lens, hq, hkv, d, rot, qk_norm, zero_centred=next_like, gated=next_like,
                dtype=dtype, seed=len(case))
    out, storage = step.fused(decode=True, num_splits=splits)
    want_out, want_storage = step.two_launches(num_splits=splits)
    assert torch.equal(out, want_out) and torch.equal(storage, want_storage)
    ref_out, ref_storage = step.reference()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and rel_err(out, ref_out) < tol and rel_err(storage, ref_storage) < tol


@pytest.mark.parametrize("splits", [1, 2])
def test_fused_decode_writes_nothing_for_a_padding_row(splits):
    """A decode graph's padding row (slot -1, one key of context) writes no slot; the real rows
    write theirs only, and every row's output is still the two launches' (the padding row reads
    its block as it is)."""
    step = Step([1] * 4, [20, 1, 64, 7], 9, 3, 64, 64, qk_norm=True, dtype=torch.bfloat16, padding=(1,), seed=7)
    out, storage = step.fused(decode=True, num_splits=splits)
    want_out, want_storage = step.two_launches(num_splits=splits)
    assert torch.equal(out, want_out) and torch.equal(storage, want_storage)
    changed = (storage != step.paged.storage.cpu()).flatten(5).any(-1)  # [P, N, L, K|V, S]
    pages, in_page, layers, kv, offsets = changed.nonzero().T
    slots = (pages * PER_PAGE + in_page) * BLOCK + offsets
    assert layers.unique().tolist() == [1] and kv.unique().tolist() == [0, 1]
    assert sorted(set(slots.tolist())) == sorted(s for s in step.slots.tolist() if s >= 0)


def test_a_prefill_step_takes_the_two_launches():
    """Prompt chunks and a decode row in one step (not decode-shaped): the op runs rotary_write_kv
    then paged_attention, and decode=True is refused for it."""
    step = Step([5, 1, 12], [5, 30, 40], 9, 3, 64, 16, qk_norm=True, zero_centred=True, seed=8)
    out, storage = step.fused()
    want_out, want_storage = step.two_launches()
    assert torch.equal(out, want_out) and torch.equal(storage, want_storage)
    ref_out, ref_storage = step.reference()
    assert rel_err(out, ref_out) < 1e-4 and rel_err(storage, ref_storage) < 1e-4
    with pytest.raises(ValueError, match=r"decode=True needs one query row per sequence \(query_start 0, 1"):
        step.fused(decode=True)
    with pytest.raises(ValueError, match=r"decode=True needs one query row per sequence \(query_start 0, 1"):
        reference.rotary_paged_attention(step.q, step.k, step.v, step.positions, step.inv_freq,
                                         step.paged.k_cache.clone(), step.paged.v_cache.clone(), step.slots,
                                         step.paged.block_tables, step.paged.query_start, step.paged.seq_lens,
                                         step.paged.scale, decode=True)


def test_bad_fused_inputs_are_refused_with_the_numbers():
    """What the fused op cannot take: a decode promise that the rows belie, one norm weight of
    two, weights that would rotate q into a dtype the caches do not hold, a slot_mapping short
    of the rows."""
    step = Step([1, 1], [9, 4], 4, 2, 64, 64, seed=9)
    args = (step.q, step.k, step.v, step.positions, step.inv_freq, step.paged.k_cache, step.paged.v_cache,
            step.slots, step.paged.block_tables)
    qs = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"decode=True needs one query row per sequence: q has 2 rows for 1"):
        attention.rotary_paged_attention(*args, qs, torch.tensor([9], device=DEVICE), 0.1, decode=True)
    with pytest.raises(ValueError, match=r"rotary_paged_attention needs both q_weight and k_weight"):
        attention.rotary_paged_attention(*args, [0, 1, 2], [9, 4], 0.1, q_weight=torch.ones(64, device=DEVICE),
                                         decode=True)
    wide = torch.ones(64, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=r"cache dtype torch.float32/torch.float32 differs from q's torch.float64"):
        attention.rotary_paged_attention(*args, [0, 1, 2], [9, 4], 0.1, q_weight=wide, k_weight=wide, decode=True)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[2\]"):
        attention.rotary_paged_attention(*args[:7], step.slots[:1], step.paged.block_tables, [0, 1, 2], [9, 4], 0.1,
                                         decode=True)
