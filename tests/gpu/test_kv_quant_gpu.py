"""The Triton kernels over a quantized KV cache on the GPU (issue 21, "Prove it"): the comparisons of
tests/kernels/test_attention_kv_quant.py at real shapes, and quantized attention timed against auto,
for each of fp8, fp8_v4 and k6_v4.

Shapes: SmolLM2 (9 / 3 heads x 64), Qwen3-30B-A3B (32 / 4 x 128), Qwen3-Next (16 / 2 x 256), bf16.
Every fused write must give the bytes of the reference quantize (`KVPlane.store` of the k that
rope.rotary_qk returns) while thousands of programs run at once (a block's first token written in
the same launch as its later ones: the race kernels/kv_fp8.py avoids), a rotated V plane's up to
its rotation's last bit (kernels/kv_int.py: at most V_FLIPS of its codes, steps and mins one off; the
shares are recorded); the attention must be within 1e-2 of the fp32 reference attention over the
same bytes (the dots run in fp16 on the codes: kv_int.dot_operand). The timings are the issue's bars
for the attention alone: decode at context 16K (b8, b32) at least 1.3x faster than auto, prefill of
a 4K prompt at most 10% slower.
"""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import reference
from radianced.kernels.kv_formats import KV_FORMATS
from radianced.kernels.kv_quant import unpack
from radianced.kv.cache import KVCache
from tests.gpu.conftest import gpu_device, record
from tests.kernels.compare import rel_err

BLOCK, PER_PAGE = 16, 4
KV_DTYPES = list(KV_FORMATS)  # every quantized format
V_FLIPS = 1e-3  # tests/kernels/test_attention_kv_quant.py says why
# How far attention over a quantized copy of a random bf16 cache may be from attention over the cache
# (rel_err). The reference attention on the CPU, qwen3's shape, 2 x 2K keys, 1 and 512 rows a sequence:
# fp8 0.061 / 0.050, fp8_v4 0.094 / 0.087, k6_v4 0.083 / 0.078 (int4 V: a step of about 0.28 sigma).
VS_AUTO = {"fp8": 0.1, "fp8_v4": 0.2, "k6_v4": 0.2}
SHAPES = {"smollm2": (9, 3, 64), "qwen3": (32, 4, 128), "next": (16, 2, 256)}  # Hq, Hkv, D


@pytest.fixture(scope="module")
def kernels():
    """(attention, rope); imported here so CPU collection never imports triton for CUDA."""
    if gpu_device() != "cuda":
        pytest.skip("the Triton kernels need CUDA; on the CPU tests/kernels runs them in the interpreter")
    torch.backends.cuda.matmul.allow_tf32 = False
    from radianced.kernels import attention, rope
    return attention, rope


def _cache(blocks: int, hkv: int, d: int, kv_dtype: str, storage: torch.Tensor | None = None) -> KVCache:
    """Layer 1 of 2 in pages of PER_PAGE blocks (the product's layout); auto: bf16."""
    pages = -(-blocks // PER_PAGE)
    fmt = None if kv_dtype == "auto" else KV_FORMATS[kv_dtype]
    if storage is None and fmt is None:
        storage = torch.randn((pages, PER_PAGE, 2, 2, BLOCK, hkv, d), device="cuda").bfloat16()
    elif storage is None:
        storage = torch.zeros((pages, PER_PAGE, fmt.block_bytes(2, BLOCK, hkv, d)), dtype=torch.uint8, device="cuda")
    return KVCache(storage, (0, 1), fmt=fmt, geometry=(BLOCK, hkv, d))


def _flips(got: KVCache, want: KVCache) -> dict:
    """How got's bytes differ from want's: `same_bytes` (all of them, a rotated V plane's codes and fp16
    steps and mins aside, which may be one off: at most V_FLIPS of each) and those shares."""
    _, got_v = got.layer(1)
    _, want_v = want.layer(1)
    if not want_v.fmt.rotated:
        return {"same_bytes": bool(torch.equal(got.storage, want.storage))}
    out, ok = {}, True
    codes = (unpack(p.codes, 4, p.head_dim) for p in (got_v, want_v))
    scales = (p.scales.view(torch.int16).int() for p in (got_v, want_v))
    for name, (a, b) in (("v_code_flips", codes), ("v_scale_flips", scales)):
        off = (a - b).abs()
        out[name] = float((off > 0).float().mean())
        ok = ok and int(off.max()) <= 1 and out[name] <= V_FLIPS
    rest = got.storage.clone()  # all but V's codes and scales, bit for bit
    v = _cache(0, got_v.shape[3], got_v.head_dim, want.fmt.name, rest).layer(1)[1]
    v.codes.copy_(want_v.codes)
    v.scales.copy_(want_v.scales)
    out["same_bytes"] = ok and bool(torch.equal(rest, want.storage))
    return out


class Step:
    """One attention layer's step: each sequence's first ctx - q_len tokens written earlier (by the
    reference), its q_len new tokens last; the first `shared` blocks of every table are sequence 0's."""

    def __init__(self, q_lens, ctx_lens, hq, hkv, d, kv_dtype, shared=0, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.hkv, self.d, self.kv_dtype = hkv, d, kv_dtype
        blocks = sum(-(-c // BLOCK) for c in ctx_lens) + PER_PAGE
        self.cache = _cache(blocks, hkv, d, kv_dtype)
        free = torch.randperm(self.cache.num_blocks, generator=g, device="cuda").tolist()
        prefix = [free.pop() for _ in range(shared)]
        tables = [prefix + [free.pop() for _ in range(-(-c // BLOCK) - shared)] for c in ctx_lens]
        width = max(map(len, tables))
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                         device="cuda")
        old = [(b, p) for b, (c, n) in enumerate(zip(ctx_lens, q_lens)) for p in range(c - n)
               if p >= shared * BLOCK or b == 0]
        new = [(b, p) for b, (c, n) in enumerate(zip(ctx_lens, q_lens)) for p in range(c - n, c)]
        offset = torch.linspace(-8, 8, d, device="cuda")  # K's channels that barely move
        reference.write_kv(*self.cache.layer(1), torch.randn((len(old), hkv, d), generator=g, device="cuda") + offset,
                           torch.randn((len(old), hkv, d), generator=g, device="cuda"), self._slots(old))
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.query_start = torch.tensor(starts, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.tensor(ctx_lens, dtype=torch.int64, device="cuda")
        t = starts[-1]
        self.q, self.k, self.v = (torch.randn((t, h, d), generator=g, device="cuda").bfloat16() for h in (hq, hkv, hkv))
        self.k = (self.k + offset).bfloat16()
        self.positions = torch.tensor([p for _, p in new], device="cuda")
        self.slots = self._slots(new)
        self.inv_freq = reference.rotary_inv_freq(d, 1e6, "cuda")
        self.norms = dict(q_weight=(torch.randn(d, generator=g, device="cuda") * 0.2).bfloat16(),
                          k_weight=(torch.randn(d, generator=g, device="cuda") * 0.2).bfloat16())

    def _slots(self, pairs) -> torch.Tensor:
        b = torch.tensor([b for b, _ in pairs], dtype=torch.int64, device="cuda")
        p = torch.tensor([p for _, p in pairs], dtype=torch.int64, device="cuda")
        return self.block_tables[b, p // BLOCK].long() * BLOCK + p % BLOCK

    def fused(self, attention, **kw) -> tuple[torch.Tensor, KVCache]:
        cache = _cache(0, self.hkv, self.d, self.kv_dtype, self.cache.storage.clone())
        out = attention.rotary_paged_attention(self.q, self.k, self.v, self.positions, self.inv_freq, *cache.layer(1),
                                               self.slots, self.block_tables, self.query_start, self.seq_lens,
                                               self.d ** -0.5, **self.norms, **kw)
        return out, cache

    def reference(self, rope) -> tuple[torch.Tensor, KVCache]:
        cache = _cache(0, self.hkv, self.d, self.kv_dtype, self.cache.storage.clone())
        q, k = rope.rotary_qk(self.q, self.k, self.positions, self.inv_freq, **self.norms)
        reference.write_kv(*cache.layer(1), k, self.v, self.slots)
        out = reference.paged_attention(q.float(), *cache.layer(1), self.block_tables, self.query_start,
                                        self.seq_lens, self.d ** -0.5)
        return out, cache


STEPS = {
    # name: (q_lens, contexts, shared prefix blocks)
    "decode_b32_mixed_ctx": ([1] * 32, [1 + 67 * i for i in range(32)], 0),
    "prefill_chunk_300_after_1000_and_decodes": ([300, 1, 1, 15], [1300, 5, 800, 15], 0),
    "fresh_prompt_2000": ([2000], [2000], 0),
    "prefix_hit_chunks": ([63, 200, 1], [1087, 1224, 1025], 64),
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("case", list(STEPS))
def test_steps_write_the_reference_bytes_and_attend_as_the_reference(kernels, case, shape, kv_dtype):
    attention, rope = kernels
    q_lens, ctx_lens, shared = STEPS[case]
    step = Step(q_lens, ctx_lens, *SHAPES[shape], kv_dtype, shared=shared, seed=len(case))
    decode = all(n == 1 for n in q_lens)
    out, cache = step.fused(attention, decode=decode)
    want, want_cache = step.reference(rope)
    err = rel_err(out, want)
    entry = {"test": "kv_quant_step", "kv_dtype": kv_dtype, "case": case, "shape": shape, **_flips(cache, want_cache),
             "rel_err": err}
    if decode:  # the fused decode against its two launches, bit for bit
        two, two_cache = step.fused(attention)
        entry["fused_is_two_launches"] = bool(torch.equal(out, two) and torch.equal(cache.storage, two_cache.storage))
    record(entry)
    assert entry["same_bytes"] and err < 1e-2 and entry.get("fused_is_two_launches", True)


def _timed(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _bench_caches(batch: int, ctx: int, hkv: int, d: int, kv_dtype: str):
    """An auto (bf16) and a quantized cache of `batch` sequences of `ctx` tokens (the quantized one from
    the same values), and their block tables."""
    blocks = batch * -(-ctx // BLOCK)
    auto = _cache(blocks, hkv, d, "auto")
    quant = _cache(blocks, hkv, d, kv_dtype)
    slots = torch.arange(blocks * BLOCK, device="cuda")
    k_auto, v_auto = auto.layer(1)
    n = k_auto.shape[1]
    tokens = (slots // BLOCK // n, slots // BLOCK % n, slots % BLOCK)
    for i in range(0, len(slots), 1 << 18):  # bounded temporaries
        part = slots[i:i + (1 << 18)]
        at = tuple(x[i:i + (1 << 18)] for x in tokens)
        reference.write_kv(*quant.layer(1), k_auto[at], v_auto[at], part)
    tables = torch.randperm(blocks, device="cuda").int().view(batch, -1)
    return auto, quant, tables


TIMINGS = {
    # name: (batch, context, query rows per sequence, shape, the bar: quantized time / auto time at most)
    "decode_b8_ctx16k": (8, 16384, 1, "qwen3", 1 / 1.3),
    "decode_b32_ctx16k": (32, 16384, 1, "qwen3", 1 / 1.3),
    "prefill_4k": (1, 4096, 4096, "qwen3", 1.10),
    "prefill_4k_hd256": (1, 4096, 4096, "next", 1.10),
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", list(TIMINGS))
def test_quantized_attention_against_auto(kernels, case, kv_dtype):
    """paged_attention alone over the same context in bf16 and quantized (the issue's bars: decode reads
    half the bytes or less, so at least 1.3x faster at 16K; a 4K prefill at most 10% slower)."""
    attention, _ = kernels
    batch, ctx, rows, shape, bar = TIMINGS[case]
    hq, hkv, d = SHAPES[shape]
    auto, quant, tables = _bench_caches(batch, ctx, hkv, d, kv_dtype)
    q = torch.randn((batch * rows, hq, d), device="cuda").bfloat16()
    qs = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device="cuda")
    sl = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    ms = {name: _timed(lambda c=c: attention.paged_attention(q, *c.layer(1), tables, qs, sl, d ** -0.5))
          for name, c in (("auto", auto), ("quant", quant))}
    got = attention.paged_attention(q, *quant.layer(1), tables, qs, sl, d ** -0.5)
    plain = attention.paged_attention(q, *auto.layer(1), tables, qs, sl, d ** -0.5)
    ratio = ms["quant"] / ms["auto"]
    record({"test": "kv_quant_attention_time", "kv_dtype": kv_dtype, "case": case, "shape": shape,
            "auto_ms": ms["auto"], "quant_ms": ms["quant"], "quant_over_auto": ratio, "bar": bar,
            "rel_err_vs_auto": rel_err(got, plain)})
    assert rel_err(got, plain) < VS_AUTO[kv_dtype]  # the same attention, up to the format's rounding of the cache
    assert ratio <= bar
