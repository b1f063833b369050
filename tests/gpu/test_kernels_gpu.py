"""The Triton kernels on the GPU at real shapes, against the fp32 reference (issue 8, "Prove it").

Shapes: Qwen3-30B-A3B (32 query / 4 KV heads x 128; 128 experts, top-8,
I = 768, H = 2048), SmolLM2 (9 / 3 heads x 64), Qwen3-Next's head dim 256
(16 / 2 heads). fp32 kernels within 1e-4 of max|ref| (IEEE products, TF32 off in
the reference too); bf16 within 1e-2 of the fp32 reference computed on the same
bf16 values. The MoE also runs with its weights in pinned host memory read
through raw addresses (`moe_ptr`), which must equal the VRAM result bitwise.
Each test records its worst error for the report (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import reference
from tests.gpu.conftest import gpu_device, record

BLOCK = 16


@pytest.fixture(scope="module")
def kernels():
    """(attention, moe) modules; imported here so CPU collection never imports triton for CUDA."""
    if gpu_device() != "cuda":
        pytest.skip("the Triton kernels need CUDA; on the CPU tests/kernels runs them in the interpreter")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32, not tf32
    from radianced.kernels import attention, moe
    return attention, moe


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _paged(q_lens, ctx_lens, hq, hkv, d, dtype, seed=0):
    """q, strided caches over interleaved [P, 1, L=2, 2, S, Hkv, D] storage, shuffled block tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = sum(-(-c // BLOCK) for c in ctx_lens) + 4
    storage = torch.randn((blocks, 1, 2, 2, BLOCK, hkv, d), generator=g, device="cuda").to(dtype)
    k_cache, v_cache = storage[:, :, 1, 0], storage[:, :, 1, 1]
    free = torch.randperm(blocks, generator=g, device="cuda").tolist()
    tables = [[free.pop() for _ in range(-(-c // BLOCK))] for c in ctx_lens]
    width = max(len(t) for t in tables)
    block_tables = torch.zeros((len(ctx_lens), width), dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    query_start = [0]
    for n in q_lens:
        query_start.append(query_start[-1] + n)
    q = torch.randn((query_start[-1], hq, d), generator=g, device="cuda").to(dtype)
    return q, k_cache, v_cache, block_tables.cuda(), query_start, list(ctx_lens)


ATTENTION_CASES = {
    # name: (q_lens, ctx_lens, Hq, Hkv, D)
    "qwen3_decode_b1_ctx1024": ([1], [1024], 32, 4, 128),
    "qwen3_decode_b32_mixed_ctx": ([1] * 32, [1 + 67 * i for i in range(32)], 32, 4, 128),
    "qwen3_prefill_300": ([300], [300], 32, 4, 128),
    "qwen3_chunk_63_after_1000_and_decodes": ([63, 1, 1, 15], [1063, 5, 800, 15], 32, 4, 128),
    "smollm2_mixed": ([1, 15, 0, 300, 1], [37, 15, 5, 300, 2000], 9, 3, 64),
    "next_hd256_mixed": ([1, 1, 63], [500, 9, 63], 16, 2, 256),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_real_shapes(kernels, case, dtype):
    attention, _ = kernels
    q_lens, ctx_lens, hq, hkv, d = ATTENTION_CASES[case]
    q, kc, vc, bt, qs, sl = _paged(q_lens, ctx_lens, hq, hkv, d, dtype)
    scale = d ** -0.5
    got = attention.paged_attention(q, kc, vc, bt, qs, sl, scale)
    want = reference.paged_attention(q.float(), kc.float(), vc.float(), bt, qs, sl, scale)
    err = rel_err(got, want)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    record({"test": "kernel_paged_attention", "case": case, "dtype": str(dtype).removeprefix("torch."),
            "rel_err": err, "tolerance": tol})
    assert got.dtype == dtype and err < tol


def test_write_kv_real_shapes(kernels):
    attention, _ = kernels
    _, kc, vc, _, _, _ = _paged([1], [4096], 32, 4, 128, torch.bfloat16)
    t = 300
    k, v = torch.randn((2, t, 4, 128), device="cuda").bfloat16()
    slots = torch.randperm(kc.shape[0] * BLOCK, device="cuda")[:t]
    slots[7] = -1
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv(want_k, want_v, k, v, slots)
    attention.write_kv(kc, vc, k, v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


E, TOP_K, INTER, HIDDEN = 128, 8, 768, 2048  # Qwen3-30B-A3B's routed experts


@pytest.fixture(scope="module")
def experts(kernels):
    """bf16 slab of 128 experts (+ 8 spare rows), a permuted table, and its fp32 twin for the reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    slab = (torch.randn((E + 8, 3 * INTER * HIDDEN), generator=g, device="cuda") * HIDDEN ** -0.5).bfloat16()
    table = torch.randperm(E + 8, generator=g, device="cuda")[:E]
    return slab, table, slab.float()


def _routing(t: int, seed: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((t, HIDDEN), generator=g, device="cuda").to(dtype)
    logits = torch.randn((t, E), generator=g, device="cuda")
    logits[:, :4] += 2.0  # a few hot experts, as real routers have: several tokens per expert
    w, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return x, ids, (w / w.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("t", [1, 32, 300])
def test_moe_real_shapes(kernels, experts, t, dtype):
    _, moe = kernels
    slab, table, slab32 = experts
    x, ids, w = _routing(t, seed=t, dtype=dtype)
    got = moe.moe(x, ids, w, table, slab if dtype == torch.bfloat16 else slab32, INTER)
    want = reference.moe(x.float(), ids, w.float(), table, slab32, INTER)
    err = rel_err(got, want)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    record({"test": "kernel_moe", "tokens": t, "dtype": str(dtype).removeprefix("torch."), "rel_err": err,
            "tolerance": tol})
    assert got.dtype == dtype and err < tol


def test_moe_deterministic_is_bitwise_repeatable(kernels, experts):
    _, moe = kernels
    slab, table, _ = experts
    x, ids, w = _routing(32, seed=7, dtype=torch.bfloat16)
    runs = [moe.moe(x, ids, w, table, slab, INTER, deterministic=True) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert rel_err(runs[0], moe.moe(x, ids, w, table, slab, INTER)) < 1e-2


@pytest.mark.parametrize("t", [1, 32])
def test_moe_reads_experts_from_pinned_host_memory(kernels, experts, t):
    """Raw addresses into pinned host memory (unified addressing): the same bits as from VRAM."""
    _, moe = kernels
    slab, table, _ = experts
    host = slab.cpu().pin_memory()
    row_bytes = host.stride(0) * host.element_size()
    addresses = (host.data_ptr() + table.cpu() * row_bytes).cuda()
    x, ids, w = _routing(t, seed=11, dtype=torch.bfloat16)
    from_host = moe.moe_ptr(x, ids, w, addresses, INTER, deterministic=True)
    from_vram = moe.moe(x, ids, w, table, slab, INTER, deterministic=True)
    torch.cuda.synchronize()
    assert torch.equal(from_host, from_vram)


@pytest.mark.parametrize("t", [1, 32, 300])
def test_moe_with_part_of_the_experts_in_the_pinned_host_pool(kernels, experts, t):
    """tiers/slab.py's table: a third of the experts at negative entries (pinned host rows)."""
    _, moe = kernels
    slab, table, slab32 = experts
    host = torch.empty((E, slab.shape[1]), dtype=slab.dtype, pin_memory=True)
    host.copy_(slab[:E])
    mixed = table.clone()
    overflow = torch.arange(0, E, 3, device="cuda")
    mixed[overflow] = -1 - torch.randperm(E, device="cuda")[: overflow.numel()]
    host_rows = -1 - mixed[overflow]
    host[host_rows.cpu()] = slab[table[overflow]].cpu()  # the same weights, now only in host memory
    x, ids, w = _routing(t, seed=13, dtype=torch.bfloat16)
    got = moe.moe(x, ids, w, mixed, slab, INTER, host, deterministic=True)
    want = moe.moe(x, ids, w, table, slab, INTER, deterministic=True)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    ref = reference.moe(x.float(), ids, w.float(), table, slab32, INTER)
    assert rel_err(got, ref) < 1e-2


def test_ops_select_binds_triton_on_cuda_and_reference_elsewhere(kernels):
    from radianced.kernels import ops
    try:
        assert ops.select("cuda") == "triton"
        assert ops.paged_attention is kernels[0].paged_attention and ops.moe is kernels[1].moe
        assert ops.select("cuda", deterministic=True) == "triton" and ops.moe.keywords == {"deterministic": True}
    finally:
        assert ops.select("cpu") == "reference"
    assert ops.moe is reference.moe and ops.paged_attention is reference.paged_attention
