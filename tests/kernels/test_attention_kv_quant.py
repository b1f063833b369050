"""The Triton kernels over a quantized KV cache (`fp8`: kernels/kv_fp8.py; `fp8_v4`, `k6_v4`:
kernels/kv_int.py): the fused write gives the bytes of the reference quantize (`KVPlane.store`; a
rotated V plane's up to its rotation's last bit, `same_bytes`), and the attention over the cache is
the reference attention over the same bytes, within fp32 rounding.

In Triton's interpreter (tests/kernels/interpreter.py) on small shapes. The cache is the
product's: uint8 blocks of two layers, three blocks a page, this layer's planes viewed inside
them (kv/cache.py), block tables shuffled across pages. The reference write is given the k that
`rope.rotary_qk` returns, the bits the fused launches round k to before quantizing it.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.kernels.interpreter import DEVICE, require_interpreted  # before triton loads
from tests.kernels.compare import rel_err

from radianced.kernels import attention, kv_int, reference, rope
from radianced.kernels.kv_formats import KV_FORMATS
from radianced.kernels.kv_quant import unpack
from radianced.kv.cache import KVCache

require_interpreted(attention._paged_attention_kernel, "attention")

BLOCK, PER_PAGE, PAGES = 16, 3, 8
THETA = 10000.0
KV_DTYPES = list(KV_FORMATS)  # every quantized format
# A rotated V plane's values may sit on a rounding boundary that the kernel's rotation (a sum in order)
# and the reference's (a torch matmul) round to either side of: a code one off, or a group's fp16 step
# or min one step off (and so its codes, a few one off). At most this share of V's codes and scales.
V_FLIPS = 1e-3


def _cache(hkv: int, d: int, storage: torch.Tensor | None = None, kv_dtype: str = "fp8") -> KVCache:
    fmt = KV_FORMATS[kv_dtype]
    if storage is None:
        storage = torch.zeros((PAGES, PER_PAGE, fmt.block_bytes(2, BLOCK, hkv, d)), dtype=torch.uint8, device=DEVICE)
    return KVCache(storage, (0, 1), fmt=fmt, geometry=(BLOCK, hkv, d))


def same_bytes(got: KVCache, want: KVCache) -> bool:
    """got's bytes are want's; a rotated V plane's (fp8_v4, k6_v4) up to `V_FLIPS` of its codes one off
    and of its fp16 steps and mins one fp16 step off."""
    _, got_v = got.layer(1)
    _, want_v = want.layer(1)
    if not want_v.fmt.rotated:
        return torch.equal(got.storage, want.storage)
    pairs = ((unpack(got_v.codes, 4, got_v.head_dim), unpack(want_v.codes, 4, want_v.head_dim)),
             (got_v.scales.view(torch.int16).int(), want_v.scales.view(torch.int16).int()))
    for a, b in pairs:
        off = (a - b).abs()
        if off.max() > 1 or (off > 0).float().mean() > V_FLIPS:
            return False
    rest = got.storage.clone()  # all but V's codes and scales, bit for bit
    v = _cache(got_v.shape[3], got_v.head_dim, rest, want.fmt.name).layer(1)[1]
    v.codes.copy_(want_v.codes)
    v.scales.copy_(want_v.scales)
    return torch.equal(rest, want.storage)


class Step:
    """A step of one attention layer over a quantized cache: each sequence's context (ctx - q_len tokens)
    written earlier by the reference, its q_len new tokens last; the first `shared` blocks of every table
    are one block chain (a prefix hit: written once, by sequence 0)."""

    def __init__(self, q_lens, ctx_lens, hq, hkv, d, dtype=torch.float32, shared=0, rotary_dim=None, qk_norm=False,
                 seed=0, kv_dtype="fp8"):
        g = torch.Generator().manual_seed(seed)
        self.hkv, self.d, self.dtype, self.kv_dtype = hkv, d, dtype, kv_dtype
        self.cache = _cache(hkv, d, kv_dtype=kv_dtype)
        free = torch.randperm(PAGES * PER_PAGE, generator=g).tolist()
        prefix = [free.pop() for _ in range(shared)]
        tables = [prefix + [free.pop() for _ in range(-(-c // BLOCK) - shared)] for c in ctx_lens]
        self.block_tables = torch.zeros((len(ctx_lens), max(map(len, tables))), dtype=torch.int32)
        for b, t in enumerate(tables):
            self.block_tables[b, :len(t)] = torch.tensor(t)
        old = [(b, p) for b, (c, n) in enumerate(zip(ctx_lens, q_lens)) for p in range(c - n)
               if p >= shared * BLOCK or b == 0]
        new = [(b, p) for b, (c, n) in enumerate(zip(ctx_lens, q_lens)) for p in range(c - n, c)]
        k_plane, v_plane = self.cache.layer(1)
        # K with channels that barely move (what the residual from the block's first token is for)
        k_old = torch.randn((len(old), hkv, d), generator=g) + torch.linspace(-8, 8, d)
        reference.write_kv(k_plane, v_plane, k_old.to(DEVICE), torch.randn((len(old), hkv, d), generator=g).to(DEVICE),
                           self._slots(old))
        self.query_start = [0]
        for n in q_lens:
            self.query_start.append(self.query_start[-1] + n)
        self.seq_lens = list(ctx_lens)
        t = self.query_start[-1]
        self.q, self.k, self.v = (torch.randn((t, h, d), generator=g).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))
        self.k = self.k + torch.linspace(-8, 8, d).to(dtype).to(DEVICE)
        self.positions = torch.tensor([p for _, p in new], device=DEVICE)
        self.slots = self._slots(new)
        self.block_tables = self.block_tables.to(DEVICE)
        self.inv_freq = reference.rotary_inv_freq(rotary_dim or d, THETA, DEVICE)
        self.norms = {}
        if qk_norm:
            qw, kw = (torch.randn(d, generator=g) * 0.2 for _ in range(2))
            self.norms = dict(q_weight=qw.to(dtype).to(DEVICE), k_weight=kw.to(dtype).to(DEVICE))

    def _slots(self, pairs) -> torch.Tensor:
        return torch.tensor([int(self.block_tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in pairs],
                            dtype=torch.int64, device=DEVICE)

    def fused(self, **kw) -> tuple[torch.Tensor, KVCache]:
        """`attention.rotary_paged_attention` on a copy of the cache: (output, the cache after)."""
        cache = _cache(self.hkv, self.d, self.cache.storage.clone(), self.kv_dtype)
        out = attention.rotary_paged_attention(self.q, self.k, self.v, self.positions, self.inv_freq, *cache.layer(1),
                                               self.slots, self.block_tables, self.query_start, self.seq_lens,
                                               self.d ** -0.5, **self.norms, **kw)
        return out, cache

    def reference(self) -> tuple[torch.Tensor, KVCache]:
        """The reference write of Triton's rotated k (the same bits the fused launches quantize), then the
        reference attention of Triton's rotated q over the cache it leaves, in fp32."""
        cache = _cache(self.hkv, self.d, self.cache.storage.clone(), self.kv_dtype)
        q, k = rope.rotary_qk(self.q, self.k, self.positions, self.inv_freq, **self.norms)
        reference.write_kv(*cache.layer(1), k, self.v, self.slots)
        out = reference.paged_attention(q.float(), *cache.layer(1), self.block_tables, self.query_start,
                                        self.seq_lens, self.d ** -0.5)
        return out, cache


@pytest.fixture
def last_program_first(monkeypatch):
    """Run the interpreter's programs in reverse order along the grid's first axis (the tokens of a write,
    the query tiles of an attention): a block's later tokens are quantized before its first token's
    program has stored it, as may happen on a GPU, so a kernel that read that first token back from the
    cache instead of recomputing it would see what the cache held before."""
    from triton.runtime import interpreter

    set_grid_idx = interpreter.InterpreterBuilder.set_grid_idx
    monkeypatch.setattr(interpreter.InterpreterBuilder, "set_grid_idx",
                        lambda self, x, y, z: set_grid_idx(self, self.grid_dim[0] - 1 - x, y, z))


WRITES = {
    # name: (first write's slots, second write's slots, Hkv, D, dtype, rotary dim, qk-norm)
    # block 4's first token in the second write with its later ones; block 7 begun by the first write;
    # a padding row (-1) in between
    "fp32_two_writes": ([7 * 16 + i for i in range(5)], [7 * 16 + 5, 7 * 16 + 6, -1] + [4 * 16 + i for i in range(16)]
                        + [10 * 16], 2, 64, torch.float32, None, False),
    "bf16_partial_rotary_qk_norm_odd_dim": ([3 * 16 + i for i in range(9)], [3 * 16 + 9, 5 * 16, 5 * 16 + 1, -1],
                                            3, 40, torch.bfloat16, 16, True),
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", list(WRITES))
def test_the_fused_write_gives_the_reference_bytes(case, kv_dtype, last_program_first):
    """The RoPE + store launch (rope.rotary_write_kv; kv_int's for fp8_v4 and k6_v4) into a quantized
    cache, twice (a block's tokens spread over both writes), with the cache's bytes random to begin
    with: every byte equals what `KVPlane.store` writes for the k that rope.rotary_qk returns and the v
    as given (codes and fp16 scales; `same_bytes`), and no slot outside the writes changes (a padding
    row writes nothing)."""
    first, second, hkv, d, dtype, rot, qk_norm = WRITES[case]
    g = torch.Generator().manual_seed(len(case))
    fmt = KV_FORMATS[kv_dtype]
    storage = torch.randint(0, 256, (PAGES, PER_PAGE, fmt.block_bytes(2, BLOCK, hkv, d)), generator=g,
                            dtype=torch.uint8).to(DEVICE)
    got, want = _cache(hkv, d, storage.clone(), kv_dtype), _cache(hkv, d, storage.clone(), kv_dtype)
    write = rope.rotary_write_kv if kv_dtype == "fp8" else kv_int.rotary_write_kv
    inv_freq = reference.rotary_inv_freq(rot or d, THETA, DEVICE)
    norms = {}
    if qk_norm:
        norms = dict(q_weight=(torch.randn(d, generator=g) * 0.2).to(dtype).to(DEVICE),
                     k_weight=(torch.randn(d, generator=g) * 0.2).to(dtype).to(DEVICE))
    for slots in (first, second):
        t = len(slots)
        slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        q = torch.randn((t, 2 * hkv, d), generator=g).to(dtype).to(DEVICE)
        k = (torch.randn((t, hkv, d), generator=g) * 2 + torch.linspace(-6, 6, d)).to(dtype).to(DEVICE)
        v = torch.randn((t, hkv, d), generator=g).to(dtype).to(DEVICE)
        positions = torch.arange(t, device=DEVICE) + 30
        q_out = write(q, k, v, positions, inv_freq, *got.layer(1), slots, **norms)
        q_ref, k_ref = rope.rotary_qk(q, k, positions, inv_freq, **norms)
        reference.write_kv(*want.layer(1), k_ref, v, slots)
        assert torch.equal(q_out, q_ref)
    assert same_bytes(got, want)
    changed = (got.storage != storage).any(-1).flatten().nonzero().flatten().tolist()  # blocks written
    assert changed == sorted({s // BLOCK for s in first + second if s >= 0})


DECODES = {
    # name: (contexts, Hq, Hkv, D, splits, dtype, rotary dim, qk-norm); a context of 16k + 1 puts the new token
    # first in its block (stored as itself), the others after the block's first (read back as the base)
    "b4_group3_splits": ([17, 5, 40, 33], 6, 2, 64, 3, torch.float32, None, False),
    "b3_group4_bf16_qk_norm": ([16, 49, 2], 8, 2, 32, 1, torch.bfloat16, 16, True),
    "b2_hd256_split_with_an_empty_split": ([1, 20], 4, 1, 256, 4, torch.float32, None, False),
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", list(DECODES))
def test_fused_decode_is_the_two_launches_and_the_reference(case, kv_dtype):
    """`rotary_paged_attention(decode=True)` (the KV write in the attention launch) into a quantized
    cache: the bytes of the reference write (`same_bytes`), the output and bytes of the two launches bit
    for bit, and the output within fp32 rounding of the reference attention over the same bytes (bf16:
    the dots in fp16 over the codes, `kv_int.dot_operand`; a rotated V rotated back once)."""
    ctx_lens, hq, hkv, d, splits, dtype, rot, qk_norm = DECODES[case]
    step = Step([1] * len(ctx_lens), ctx_lens, hq, hkv, d, dtype, rotary_dim=rot, qk_norm=qk_norm, seed=len(case),
                kv_dtype=kv_dtype)
    out, cache = step.fused(decode=True, num_splits=splits)
    two, two_cache = step.fused(num_splits=splits)
    want, want_cache = step.reference()
    assert same_bytes(cache, want_cache) and torch.equal(two_cache.storage, cache.storage)
    assert torch.equal(out, two)
    assert rel_err(out, want) < (2e-6 if dtype == torch.float32 else 1e-2)


PREFILLS = {
    # name: (q_lens, contexts, Hq, Hkv, D, shared prefix blocks, dtype)
    "chunk_after_context": ([19], [50], 8, 2, 64, 0, torch.float32),
    "fresh_prompt_of_odd_length": ([37], [37], 6, 3, 32, 0, torch.float32),
    "mixed_decodes_chunks_and_an_empty_sequence": ([1, 23, 0, 1, 5], [40, 23, 7, 3, 70], 6, 3, 64, 0, torch.float32),
    "prefix_hit": ([9, 14, 1], [41, 46, 33], 4, 2, 64, 2, torch.float32),
    "mixed_bf16": ([1, 12, 3], [30, 28, 50], 6, 2, 64, 1, torch.bfloat16),
    "odd_head_dim_80": ([7, 1], [30, 20], 4, 2, 80, 0, torch.float32),  # a last group of 16 dims, one of none
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", list(PREFILLS))
def test_prefill_and_mixed_steps_are_the_reference(case, kv_dtype, last_program_first):
    """The two launches (the RoPE + store launch, then paged_attention) of a chunked-prefill, mixed or
    prefix-hit step, programs run last first: the reference write's bytes (`same_bytes`), and its
    attention over them within fp32 rounding."""
    q_lens, ctx_lens, hq, hkv, d, shared, dtype = PREFILLS[case]
    step = Step(q_lens, ctx_lens, hq, hkv, d, dtype, shared=shared, seed=len(case), kv_dtype=kv_dtype)
    out, cache = step.fused()
    want, want_cache = step.reference()
    assert same_bytes(cache, want_cache)
    assert rel_err(out, want) < (2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_attention_reads_the_bytes_it_is_given(kv_dtype):
    """A prefix hit read by paged_attention alone (the cache written by the reference): the same as the
    reference, and not the same once one block's K scales are doubled (the scales are read, per token)."""
    step = Step([4, 4], [40, 36], 4, 2, 64, shared=2, seed=11, kv_dtype=kv_dtype)
    q = rope.rotary_qk(step.q, step.k, step.positions, step.inv_freq)[0]
    args = (step.block_tables, step.query_start, step.seq_lens, step.d ** -0.5)
    want = reference.paged_attention(q, *step.cache.layer(1), *args)
    assert rel_err(attention.paged_attention(q, *step.cache.layer(1), *args), want) < 2e-6
    k_plane, _ = step.cache.layer(1)
    shared = int(step.block_tables[0, 1])
    k_plane.scales[shared // PER_PAGE, shared % PER_PAGE, 3:] *= 2  # later tokens of the second shared block
    moved = reference.paged_attention(q, *step.cache.layer(1), *args)
    assert rel_err(moved, want) > 1e-3
    assert rel_err(attention.paged_attention(q, *step.cache.layer(1), *args), moved) < 2e-6


BITS = {"fp8": (8, 8), "fp8_v4": (8, 4), "k6_v4": (6, 4)}  # (k_bits, v_bits): fp8's K is fp8_v4's


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_launches_give_attention_config_the_format(kv_dtype, monkeypatch):
    """paged_attention and the fused decode tell attention_config the cache's K and V formats (fp8's own tiles
    are fp8_v4's only if measured there)."""
    config, seen = attention.attention_config, []

    def spy(*args, **kwargs):
        bound = inspect.signature(config).bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append((bound.arguments["k_bits"], bound.arguments["v_bits"]))
        return config(*args, **kwargs)

    monkeypatch.setattr(attention, "attention_config", spy)
    Step([1, 1], [20, 9], 4, 2, 32, seed=12, kv_dtype=kv_dtype).fused(decode=True)
    Step([5, 1], [20, 9], 4, 2, 32, seed=13, kv_dtype=kv_dtype).fused()
    assert seen == [BITS[kv_dtype]] * 2


def test_planes_of_two_formats_are_refused():
    """A K plane of one format beside a V plane of another is no format: refused (paged.cache_views)."""
    k_plane, _ = _cache(2, 64, kv_dtype="k6_v4").layer(1)
    _, v_plane = _cache(2, 64, kv_dtype="fp8").layer(1)
    q = torch.zeros((1, 4, 64), device=DEVICE)
    with pytest.raises(ValueError, match=r"kv cache dtype mixed: .* a K and a V of two formats are no format"):
        attention.paged_attention(q, k_plane, v_plane, torch.zeros((1, 1), dtype=torch.int32, device=DEVICE), [0, 1],
                                  [1], 0.125)
