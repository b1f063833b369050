"""The Triton paged attention and K/V scatter against `kernels/reference.py`; the split merge
also against the second launch it replaced, kept here.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set by tests/kernels/interpreter.py before triton is imported), so shapes stay small. Layouts are the
product's: caches are strided [P, N, S, Hkv, D] views of an interleaved
[P, N, L, 2, S, Hkv, D] storage with two blocks per page, block tables shuffled
across pages. fp32 must match within 1e-4 of max|ref| (IEEE products); bf16
within 1e-2 of the fp32 reference on the same (bf16-rounded) inputs.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, INTERPRET, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

import triton
import triton.language as tl

from radianced.kernels import arrival, attention, pdl, reference

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


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("t", [1, 15, 63, 300])
def test_prefill_of_a_fresh_sequence_matches_reference(t, splits):
    """SmolLM2's 9 query / 3 KV heads (a non-power-of-two group) at head dim 64; also split over
    its keys as a decode step would be (64-row tiles, a tile's later splits empty)."""
    batch = Paged([t], [t], q_heads=9, kv_heads=3, head_dim=64)
    assert rel_err(batch.kernel(num_splits=splits), batch.reference()) < 1e-4


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


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_tokens, stride_ot, stride_oh,
                         Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """The two-launch path's second launch (kernels/attention.py at a393b53), verbatim: the oracle of the merge."""
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


def old_merge(part_o: torch.Tensor, part_lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, Hq, D] in `dtype`: what the second launch stored from the partials o [S, T, Hq, D] and
    lse [S, T, Hq], launched as it was launched."""
    splits, t, hq, d = part_o.shape
    out = torch.empty((t, hq, d), dtype=dtype, device=part_o.device)
    block_d = triton.next_power_of_2(d)
    _merge_splits_kernel[(t, hq)](part_o, part_lse, out, t, out.stride(0), out.stride(1),
                                  Q_HEADS=hq, HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=splits,
                                  BLOCK_S=triton.next_power_of_2(splits),
                                  num_warps=4 if block_d >= 128 else 2, **pdl.launch(part_o.device))
    return out.cpu()


def kernel_and_partials(monkeypatch, batch: Paged, splits: int):
    """The kernel's output [T, Hq, D] and the partials (o, lse) its split programs left behind."""
    made = []
    make = attention._partials
    monkeypatch.setattr(attention, "_partials", lambda *args: made.append(make(*args)) or made[-1])
    return batch.kernel(num_splits=splits), made[0]


SPLIT_CASES = {
    # name: (q_lens, ctx_lens, Hq, Hkv, D, splits, dtype)
    "qwen3_b1_1024_keys_32_splits": ([1], [1024], 32, 4, 128, 32, torch.float32),  # splits 16..31 empty
    "decodes_with_empty_splits": ([1, 1, 1, 1], [1, 17, 130, 64], 8, 2, 64, 5, torch.float32),
    "mixed_batch_9_3_heads": ([1, 15, 0, 1, 3], [37, 15, 5, 1, 100], 9, 3, 64, 3, torch.bfloat16),
    "chunk_63_after_20_hd256": ([63], [83], 4, 1, 256, 2, torch.float32),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_merge_is_the_old_second_launch_bit_for_bit(monkeypatch, case):
    """The split merge stores what the old second launch stored from the same partials, bit for
    bit, and so stays within tolerance of the reference. Bit for bit in the interpreter, where
    both run their sums in the order written (numpy); on a GPU neither does (tl.sum is a tree
    that follows the layout, multiply-adds contract to FMAs), so there they agree to fp32
    rounding (one bf16 ulp)."""
    q_lens, ctx_lens, hq, hkv, d, splits, dtype = SPLIT_CASES[case]
    batch = Paged(q_lens, ctx_lens, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype, seed=8)
    out, (part_o, part_lse) = kernel_and_partials(monkeypatch, batch, splits)
    old = old_merge(part_o, part_lse, dtype)
    if INTERPRET:
        assert torch.equal(out, old)
    else:
        assert rel_err(out, old) <= (1e-5 if dtype == torch.float32 else 2 ** -7)  # bf16: an ulp of the largest
    assert rel_err(out, batch.reference()) < (1e-4 if dtype == torch.float32 else 1e-2)


def test_a_launch_leaves_its_counters_at_zero_so_the_next_gives_the_same_bits():
    """Each (tile, KV head) group's last split puts its counter back to zero: after a launch with
    padding tiles (which return before counting in) and empty splits every counter reads zero, and
    the same launch again gives the same bits (a counter left at 4 would skip every merge)."""
    batch = Paged([1, 15, 0, 1, 3], [37, 15, 5, 1, 100], q_heads=9, kv_heads=3, head_dim=64, seed=9)
    first = batch.kernel(num_splits=4)
    assert not arrival.counters(batch.q.device, 1).any()
    assert torch.equal(batch.kernel(num_splits=4), first)
    assert rel_err(first, batch.reference()) < 1e-4


@pytest.mark.parametrize("sms", [78, 132, 256])
def test_the_receipt_bounds_the_split_partials(monkeypatch, sms):
    """budget.activation_bytes charges splits x rows partial rows up to 2 x MAX_SMS / Hkv: what
    attention_config gives any decode batch on a device of up to MAX_SMS SMs."""
    from radianced import budget

    assert attention.MAX_SPLITS == budget.ATTENTION_MAX_SPLITS and sms <= budget.MAX_SMS
    monkeypatch.setattr(attention, "_sm_count", lambda device: sms)
    for kv_heads in (1, 2, 4, 8):
        bound = 2 * budget.MAX_SMS // kv_heads
        for rows in range(1, 300):
            cfg = attention.attention_config(rows, rows, 8 * kv_heads, kv_heads, 128, torch.device("cuda"))
            assert cfg.num_splits == 1 or cfg.num_splits * rows <= min(rows * budget.ATTENTION_MAX_SPLITS, bound)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_scatters_like_the_reference(dtype):
    """Slots across pages and blocks, a skipped slot (-1), k/v strided like the model's projections."""
    batch = Paged([1], [4], q_heads=3, kv_heads=3, head_dim=64, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    kv = torch.randn((6, 2, 3, 64), generator=g).to(dtype).to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]  # non-contiguous token stride
    slots = torch.tensor([0, 17, -1, 40, 31, 63], device=DEVICE)
    expected = batch.storage.clone()
    reference.write_kv(expected[:, :, 1, 0], expected[:, :, 1, 1], k, v, slots)
    attention.write_kv(batch.k_cache, batch.v_cache, k, v, slots)
    assert torch.equal(batch.storage, expected)  # other layers and the skipped token untouched
