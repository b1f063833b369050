"""The Triton paged attention and K/V scatter against `kernels/reference.py`.

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

from tests.kernels.interpreter import DEVICE, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

from radianced.kernels import attention, reference

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
    """budget.activation_bytes charges splits x rows partial rows up to 2 x MAX_SMS / Hkv: what
    attention_config gives any decode batch on a device of up to MAX_SMS SMs."""
    from radianced import budget

    assert attention.MAX_SPLITS == budget.ATTENTION_MAX_SPLITS and sms <= budget.MAX_SMS
    monkeypatch.setattr(attention.pdl, "sm_count", lambda device: sms)
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
