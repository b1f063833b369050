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
from tests.kernels.compare import rel_err

BLOCK = 16


@pytest.fixture(scope="module")
def kernels():
    """(attention, moe) modules; imported here so CPU collection never imports triton for CUDA."""
    if gpu_device() != "cuda":
        pytest.skip("the Triton kernels need CUDA; on the CPU tests/kernels runs them in the interpreter")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32, not tf32
    from radianced.kernels import attention, moe
    return attention, moe


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


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("ctx", [1024, 1100])
def test_fused_decode_attention_is_the_two_launches_bit_for_bit(kernels, ctx, batch):
    """Qwen3-30B-A3B's attention core at decode (32 / 4 heads x 128, full rotary, plain qk-norm,
    bf16; q, k, v views of one projection; lengths as device tensors, as the decode graphs pass
    them, so the split heuristic's pick): `rotary_paged_attention(decode=True)`, one launch + the
    merge, gives the output and the caches of rope.rotary_write_kv then paged_attention, bit for
    bit. At batch 32 the contexts spread below ctx (across block boundaries) and the last row is a
    graph's padding row (slot -1, one key of context)."""
    from radianced.kernels import rope
    attention, _ = kernels
    hq, hkv, d = 32, 4, 128
    ctx_lens = [ctx] if batch == 1 else [ctx - 5 * i for i in range(batch - 1)] + [1]
    _, kc, vc, bt, _, _ = _paged([1] * batch, ctx_lens, hq, hkv, d, torch.bfloat16, seed=ctx + batch)
    qkv = _rand(batch, (hq + 2 * hkv) * d, dtype=torch.bfloat16, seed=batch)  # the projection's output
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(batch, hq, d), k.reshape(batch, hkv, d), v.reshape(batch, hkv, d)
    last = torch.tensor(ctx_lens, device="cuda") - 1
    slots = bt[torch.arange(batch, device="cuda"), last // BLOCK].long() * BLOCK + last % BLOCK
    if batch > 1:
        slots[-1] = -1  # the padding row
    at = (last, reference.rotary_inv_freq(d, 1e6, "cuda"))
    norms = dict(q_weight=_rand(d, dtype=torch.bfloat16, seed=1, scale=0.2),
                 k_weight=_rand(d, dtype=torch.bfloat16, seed=2, scale=0.2))
    qs = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    sl = torch.tensor(ctx_lens, dtype=torch.int64, device="cuda")
    before = (kc.clone(), vc.clone())
    fused = attention.rotary_paged_attention(q, k, v, *at, kc, vc, slots, bt, qs, sl, d ** -0.5, **norms, decode=True)
    after = (kc.clone(), vc.clone())
    kc.copy_(before[0])
    vc.copy_(before[1])
    rotated = rope.rotary_write_kv(q, k, v, *at, kc, vc, slots, **norms)
    unfused = attention.paged_attention(rotated, kc, vc, bt, qs, sl, d ** -0.5)
    assert torch.equal(fused, unfused)
    assert torch.equal(after[0], kc) and torch.equal(after[1], vc)
    k32, v32 = before[0].float(), before[1].float()
    want = reference.rotary_paged_attention(q.float(), k.float(), v.float(), *at, k32, v32, slots, bt, qs, sl,
                                            d ** -0.5, **{n: w.float() for n, w in norms.items()}, decode=True)
    _check("kernel_rotary_paged_attention", f"b{batch}_ctx{ctx}", torch.bfloat16, fused, want)


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


@pytest.mark.parametrize("t", [1, 32])
def test_moe_residual_is_the_unfused_sum(kernels, experts, t):
    """`residual=` (the layer's `x + moe(x)` in the last launch): bitwise the unfused add in the
    ordered sum; within bf16 rounding of it with the atomic scatter (T > 1)."""
    _, moe = kernels
    slab, table, _ = experts
    x, ids, w = _routing(t, seed=20 + t, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    alone = moe.moe(x, ids, w, table, slab, INTER, deterministic=True)
    assert torch.equal(moe.moe(x, ids, w, table, slab, INTER, deterministic=True, residual=residual),
                       residual + alone)
    err = rel_err(moe.moe(x, ids, w, table, slab, INTER, residual=residual), residual + alone)
    record({"test": "kernel_moe_residual", "tokens": t, "rel_err": err, "tolerance": 1e-2})
    assert err < 1e-2


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


@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float32], ids=["bf16_logits", "fp32_logits"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["alone", "residual"])
def test_route_moe_at_batch_1_is_route_then_moe_bit_for_bit(kernels, experts, with_residual, renormalize,
                                                            logits_dtype):
    """Qwen3-30B-A3B's b1 experts (bf16), routed inside the gate/up launch: `route`'s ids and weights
    and `moe`'s output on them, bit for bit (the same order keys, exact p of each pick, sums in fixed
    point, one division; then the same expert kernels), over 8 draws of logits with a few hot
    experts; within 1e-2 of the fp32 reference. fp32 logits (no ties) give the reference's ids."""
    _, moe = kernels
    from radianced.kernels import router
    slab, table, slab32 = experts
    worst = 0.0
    for seed in range(8):
        g = torch.Generator(device="cuda").manual_seed(30 + seed)
        x = torch.randn((1, HIDDEN), generator=g, device="cuda").bfloat16()
        logits = torch.randn((1, E), generator=g, device="cuda") * 2.0
        logits[:, :4] += 2.0
        logits = logits.to(logits_dtype)
        residual = torch.randn((1, HIDDEN), generator=g, device="cuda").bfloat16() if with_residual else None
        out, ids, weights = moe.route_moe(x, logits, TOP_K, renormalize, table, slab, INTER, residual=residual)
        want_ids, want_weights = router.route(logits, TOP_K, renormalize, torch.bfloat16)
        want = moe.moe(x, want_ids, want_weights, table, slab, INTER, residual=residual)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights), seed
        assert torch.equal(out, want), seed
        if logits_dtype == torch.float32:
            assert torch.equal(ids, reference.route(logits, TOP_K, renormalize, torch.float32)[0]), seed
        ref = reference.moe(x.float(), ids, weights.float(), table, slab32, INTER,
                            residual=None if residual is None else residual.float())
        worst = max(worst, rel_err(out, ref))
    record({"test": "kernel_route_moe", "tokens": 1, "renormalize": renormalize, "residual": with_residual,
            "logits": str(logits_dtype).removeprefix("torch."), "rel_err": worst, "tolerance": 1e-2})
    assert worst < 1e-2


def test_ops_select_binds_triton_on_cuda_and_reference_elsewhere(kernels):
    from radianced.kernels import ops
    try:
        assert ops.select("cuda") == "triton"
        assert ops.rotary_paged_attention is kernels[0].rotary_paged_attention and ops.moe is kernels[1].moe
        assert ops.route_moe is kernels[1].route_moe
        assert ops.select("cuda", deterministic=True) == "triton" and ops.moe.keywords == {"deterministic": True}
        assert ops.route_moe.keywords == {"deterministic": True}
    finally:
        assert ops.select("cpu", oracle=True) == "reference"
    assert ops.moe is reference.moe and ops.rotary_paged_attention is reference.rotary_paged_attention
    assert ops.route_moe is reference.route_moe


# == norms, RoPE, Gated DeltaNet, router, linear (radianced/kernels/norm.py, rope.py, deltanet.py, ...) ==
# Shapes: Qwen3-30B-A3B (hidden 2048; 32 / 4 heads x 128, full rotary, plain qk-norm), Qwen3-Next-80B
# (16 / 2 heads x 256, rotary 64, zero-centred norms, the q view strided by the output gate; DeltaNet
# 16 key / 32 value heads x 128, 8192 conv channels, W = 4), SmolLM2 (9 / 3 x 64, no qk-norm); the skinny
# linear at Qwen3-30B-A3B's decode projections (q/k/v 2048 -> 5120, o_proj 4096 -> 2048, router 2048 -> 128).


@pytest.fixture(scope="module")
def layer_kernels():
    """(norm, rope, deltanet) modules; deltanet's chunked prefill imports fla-core on first use."""
    if gpu_device() != "cuda":
        pytest.skip("the Triton kernels need CUDA; on the CPU tests/kernels runs them in the interpreter")
    torch.backends.cuda.matmul.allow_tf32 = False
    from radianced.kernels import deltanet, norm, rope
    return norm, rope, deltanet


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)


def _check(test: str, case: str, dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, **extra) -> None:
    err = rel_err(got, want)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    record({"test": test, "case": case, "dtype": str(dtype).removeprefix("torch."), "rel_err": err,
            "tolerance": tol, **extra})
    assert err < tol, f"{test} {case}: rel err {err:.2e} over {tol}"


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


@DTYPES
@pytest.mark.parametrize("t", [1, 63, 4096])
@pytest.mark.parametrize("zero_centred", [False, True], ids=["plain", "zero_centred"])
def test_rms_norm_real_shapes(layer_kernels, t, zero_centred, dtype):
    norm = layer_kernels[0]
    x, w = _rand(t, 2048, dtype=dtype, seed=t, scale=4.0), _rand(2048, dtype=dtype, seed=1, scale=0.2)
    got = norm.rms_norm(x, w, 1e-6, zero_centred)
    assert got.dtype == dtype
    _check("kernel_rms_norm", f"t{t}_{'zc' if zero_centred else 'plain'}", dtype, got,
           reference.rms_norm(x.float(), w.float(), 1e-6, zero_centred))


@DTYPES
@pytest.mark.parametrize("t", [1, 300])
def test_gated_rms_norm_real_shapes(layer_kernels, t, dtype):
    norm = layer_kernels[0]
    x, w = _rand(t, 32, 128, dtype=dtype, seed=t, scale=2.0), _rand(128, dtype=dtype, seed=2)
    z = _rand(t, 32, 256, dtype=dtype, seed=3)[:, :, 128:]
    _check("kernel_gated_rms_norm", f"t{t}", dtype, norm.gated_rms_norm(x, z, w, 1e-6),
           reference.gated_rms_norm(x.float(), z.float(), w.float(), 1e-6))


ROTARY_CASES = {
    # name: (Hq, Hk, D, rotary dim, qk-norm, zero-centred)
    "qwen3_moe": (32, 4, 128, 128, True, False),
    "qwen3_next": (16, 2, 256, 64, True, True),
    "smollm2": (9, 3, 64, 64, False, False),
}


@DTYPES
@pytest.mark.parametrize("t", [1, 300])
@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_rotary_qk_real_shapes(layer_kernels, case, t, dtype):
    rope = layer_kernels[1]
    hq, hk, d, rd, qk_norm, zc = ROTARY_CASES[case]
    q = _rand(t, hq, 2 * d, dtype=dtype, seed=4)[:, :, :d]  # strided, as the output-gated q_proj leaves it
    k = _rand(t, hk, d, dtype=dtype, seed=5)
    at = (torch.randint(0, 32768, (t,), device="cuda"), reference.rotary_inv_freq(rd, 1e6, "cuda"))
    weights = (_rand(d, dtype=dtype, seed=6, scale=0.2), _rand(d, dtype=dtype, seed=7, scale=0.2)) if qk_norm else ()
    got = rope.rotary_qk(q, k, *at, *weights, eps=1e-6, zero_centred=zc)
    want = reference.rotary_qk(q.float(), k.float(), *at, *(w.float() for w in weights), eps=1e-6,
                               zero_centred=zc)
    _check("kernel_rotary_qk", f"{case}_t{t}_q", dtype, got[0], want[0])
    _check("kernel_rotary_qk", f"{case}_t{t}_k", dtype, got[1], want[1])


@pytest.mark.parametrize("t", [1, 300])
@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_rotary_write_kv_is_rotary_qk_then_write_kv(layer_kernels, case, t):
    """The fused prologue at real shapes, bf16: bit for bit the unfused rotary_qk + write_kv, over
    interleaved strided caches with scattered slots and padding rows (slot -1)."""
    rope = layer_kernels[1]
    hq, hk, d, rd, qk_norm, zc = ROTARY_CASES[case]
    q = _rand(t, hq, 2 * d, seed=8, dtype=torch.bfloat16)[:, :, :d]
    k, v = _rand(t, hk, d, seed=9, dtype=torch.bfloat16), _rand(t, hk, d, seed=10, dtype=torch.bfloat16)
    at = (torch.randint(0, 32768, (t,), device="cuda"), reference.rotary_inv_freq(rd, 1e6, "cuda"))
    weights = tuple(_rand(d, seed=s, scale=0.2, dtype=torch.bfloat16) for s in (11, 12)) if qk_norm else ()
    storage = _rand(t // 16 + 2, 4, 2, BLOCK, hk, d, seed=13, dtype=torch.bfloat16)  # [P, N, K|V, S, Hkv, D]
    slots = torch.randperm(storage.shape[0] * 4 * BLOCK, device="cuda")[:t]
    slots[::7] = -1
    k_cache, v_cache = storage[:, :, 0], storage[:, :, 1]
    want = storage.clone()
    want_q, rotated_k = rope.rotary_qk(q, k, *at, *weights, eps=1e-6, zero_centred=zc)
    reference.write_kv(want[:, :, 0], want[:, :, 1], rotated_k, v, slots)
    got_q = rope.rotary_write_kv(q, k, v, *at, k_cache, v_cache, slots, *weights, eps=1e-6, zero_centred=zc)
    assert torch.equal(got_q, want_q) and torch.equal(storage, want)


HK_DN, HV_DN, K_DN, V_DN, W_DN = 16, 32, 128, 128, 4  # Qwen3-Next-80B's Gated DeltaNet
C_DN = 2 * HK_DN * K_DN + HV_DN * V_DN


def _deltanet_tokens(t: int, dtype: torch.dtype, seed: int):
    """One sequence's inputs to the layer's ops: x [T, C], a, b [T, Hv], as the projections give them."""
    return (_rand(t, C_DN, dtype=dtype, seed=seed), _rand(t, HV_DN, dtype=dtype, seed=seed + 1, scale=2.0),
            _rand(t, HV_DN, dtype=dtype, seed=seed + 2, scale=2.0))


def _deltanet_layer(ops_mod, params, x, a, b, conv_pool, rec_pool, slot_or_slots, decode: bool):
    """The GatedDeltaNet op sequence of radianced/model/qwen3_next.py for one sequence (prefill) or a batch
    (decode), through `ops_mod` (the reference module or the Triton modules, by name)."""
    conv_w, a_log, dt_bias = params
    t = x.shape[0]
    g, beta = ops_mod.deltanet_gates(a, b, a_log, dt_bias)
    if decode:
        y = ops_mod.causal_conv1d_update(x, conv_w, conv_pool, slot_or_slots)
    else:
        y, conv_pool[slot_or_slots] = ops_mod.causal_conv1d_prefill(x, conv_w, conv_pool[slot_or_slots])
    q, k, v = y.split([HK_DN * K_DN, HK_DN * K_DN, HV_DN * V_DN], dim=-1)
    q, k, v = q.view(t, HK_DN, K_DN), k.view(t, HK_DN, K_DN), v.view(t, HV_DN, V_DN)
    if decode:
        return ops_mod.gated_delta_rule_decode(q, k, v, g, beta, rec_pool, slot_or_slots, use_qk_l2norm=True)
    o, rec_pool[slot_or_slots] = ops_mod.gated_delta_rule_chunked(q, k, v, g, beta, rec_pool[slot_or_slots],
                                                                  use_qk_l2norm=True)
    return o


class _TritonOps:
    """The deltanet module's ops under the names the layer uses."""

    def __init__(self, deltanet):
        for name in ("deltanet_gates", "causal_conv1d_prefill", "causal_conv1d_update",
                     "gated_delta_rule_chunked", "gated_delta_rule_decode"):
            setattr(self, name, getattr(deltanet, name))


@DTYPES
def test_deltanet_prefill_mixed_lengths_then_decode_over_slots(layer_kernels, dtype):
    """Prompts of 1, 15, 63, 300 and 1000 tokens prefilled into shuffled pool slots (the last one from a
    carried-over state), then 3 decode steps of all five plus a padding row, all against the fp32 reference
    on the same values. bf16 runs fla-core's chunked kernels; fp32 the reference chunked form."""
    deltanet = layer_kernels[2]
    ours = _TritonOps(deltanet)
    params = (_rand(C_DN, W_DN, dtype=dtype, seed=10, scale=0.5), _rand(HV_DN, seed=11, scale=0.5),
              _rand(HV_DN, dtype=dtype, seed=12))
    params32 = tuple(p.float() for p in params)
    pools = 9
    conv = _rand(pools, C_DN, W_DN - 1, dtype=dtype, seed=13)
    rec = _rand(pools, HV_DN, K_DN, V_DN, seed=14, scale=0.1)
    conv[[2, 0, 7, 5]] = 0  # fresh sequences start from zeroed slots; slot 4 keeps its state
    rec[[2, 0, 7, 5]] = 0
    conv32, rec32 = conv.float().clone(), rec.clone()
    lengths, slots = (1, 15, 63, 300, 1000), (2, 0, 7, 5, 4)
    for i, (t, slot) in enumerate(zip(lengths, slots)):
        x, a, b = _deltanet_tokens(t, dtype, seed=20 + 3 * i)
        got = _deltanet_layer(ours, params, x, a, b, conv, rec, slot, decode=False)
        want = _deltanet_layer(reference, params32, x.float(), a.float(), b.float(), conv32, rec32, slot, decode=False)
        _check("kernel_deltanet_prefill", f"t{t}", dtype, got, want, slot=slot)
        _check("kernel_deltanet_prefill_state", f"t{t}", dtype, rec[slot], rec32[slot])
    batch_slots = torch.tensor([4, -1, 0, 7, 2, 5], device="cuda")
    for step in range(3):
        x, a, b = _deltanet_tokens(len(batch_slots), dtype, seed=50 + 3 * step)
        got = _deltanet_layer(ours, params, x, a, b, conv, rec, batch_slots, decode=True)
        want = _deltanet_layer(reference, params32, x.float(), a.float(), b.float(), conv32, rec32, batch_slots,
                               decode=True)
        _check("kernel_deltanet_decode", f"b6_step{step}", dtype, got, want)
        assert torch.equal(got[1], torch.zeros_like(got[1]))  # the padding row
    _check("kernel_deltanet_decode_state", "after_3_steps", dtype, rec, rec32)
    _check("kernel_deltanet_conv_state", "after_3_steps", dtype, conv, conv32)
    assert torch.equal(rec[[1, 3, 6, 8]], rec32[[1, 3, 6, 8]])  # nobody's slots untouched


def test_deltanet_decode_batch_32_in_place_over_a_pool(layer_kernels):
    """Decode at batch 32 over a 64-slot fp32 pool (the product's layout), bf16 activations."""
    deltanet = layer_kernels[2]
    b = 32
    q, k = _rand(b, HK_DN, K_DN, dtype=torch.bfloat16, seed=60), _rand(b, HK_DN, K_DN, dtype=torch.bfloat16, seed=61)
    v = _rand(b, HV_DN, V_DN, dtype=torch.bfloat16, seed=62)
    g = -torch.rand((b, HV_DN), device="cuda")
    beta = torch.rand((b, HV_DN), device="cuda").bfloat16()
    pool = _rand(64, HV_DN, K_DN, V_DN, seed=63, scale=0.1)
    slots = torch.randperm(64, device="cuda")[:b]
    want_pool = pool.clone()
    want = reference.gated_delta_rule_decode(q.float(), k.float(), v.float(), g, beta.float(), want_pool, slots,
                                             use_qk_l2norm=True)
    got = deltanet.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, use_qk_l2norm=True)
    _check("kernel_deltanet_decode", "b32_pool64", torch.bfloat16, got, want)
    _check("kernel_deltanet_decode_state", "b32_pool64", torch.float32, pool, want_pool)


@pytest.mark.parametrize("t", [1, 32, 4096])
@pytest.mark.parametrize("experts,top_k", [(128, 8), (512, 10)], ids=["qwen3_moe", "qwen3_next"])
def test_route_real_shapes(layer_kernels, t, experts, top_k):
    """The fused router on fp32 logits: the reference's ids exactly, weights within 1e-4 (bf16
    logits tie, and ties are broken differently: tests/kernels/test_router.py covers them)."""
    from radianced.kernels import router
    logits = _rand(t, experts, seed=t, scale=2.0)
    ids, weights = router.route(logits, top_k, True, torch.float32)
    want_ids, want_weights = reference.route(logits, top_k, True, torch.float32)
    assert torch.equal(ids, want_ids)
    _check("route", f"{experts}e top{top_k} t{t}", torch.float32, weights, want_weights)


LINEAR_CASES = {
    # name: (N, K, bias, residual): Qwen3-30B-A3B's decode projections (q/k/v, o_proj + the residual, router)
    "qkv": (5120, 2048, False, False),
    "qkv_bias": (5120, 2048, True, False),
    "o_proj_residual": (2048, 4096, False, True),
    "router": (128, 2048, False, False),
}


@DTYPES
@pytest.mark.parametrize("t", [1, 8, 16])
@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_real_shapes(layer_kernels, case, t, dtype):
    """The skinny linear (gemv at T = 1, tiles or cuBLAS above, as linear_config picks) against the
    fp32 reference."""
    from radianced.kernels import linear
    n, k, bias, residual = LINEAR_CASES[case]
    x = _rand(t, k, dtype=dtype, seed=t)
    w = _rand(n, k, dtype=dtype, seed=1, scale=k ** -0.5)
    b = _rand(n, dtype=dtype, seed=2) if bias else None
    r = _rand(t, n, dtype=dtype, seed=3, scale=4.0) if residual else None
    got = linear.linear(x, w, b, r)
    assert got.dtype == dtype and got.shape == (t, n)
    want = reference.linear(*(None if a is None else a.float() for a in (x, w, b, r)))
    config = getattr(linear.linear_config(t, n, k, dtype), "__dict__", "torch")
    _check("kernel_linear", f"{case}_t{t}", dtype, got, want, config=config)


@pytest.mark.parametrize("t", [1, 8])
def test_lm_head_with_the_final_norm_gives_fp32_logits(layer_kernels, t):
    """Qwen3's lm_head (2048 -> 151,936, bf16) as the model calls it: the final norm in the launch
    at T = 1 (4 rows a gemv program), fp32 logits out; the values of the bf16 result, and within
    1e-2 of fp32."""
    from radianced.kernels import linear
    x = _rand(t, 2048, dtype=torch.bfloat16, seed=33, scale=3.0)
    w = _rand(151936, 2048, dtype=torch.bfloat16, seed=34, scale=2048 ** -0.5)
    norm = (_rand(2048, dtype=torch.bfloat16, seed=35, scale=0.2), 1e-6, False)
    got = linear.linear(x, w, norm=norm, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, linear.linear(x, w, norm=norm).float())
    want = reference.linear(x.float(), w.float(), norm=(norm[0].float(), 1e-6, False))
    _check("kernel_lm_head", f"t{t}", torch.bfloat16, got, want)


@pytest.mark.parametrize("zero_centred", [False, True], ids=["plain", "zero_centred"])
@pytest.mark.parametrize("case", ["qkv", "router"])
def test_linear_with_the_norm_in_its_launch(layer_kernels, case, zero_centred):
    """T = 1, bf16: the layer's RMSNorm inside the gemv launch (the router keeps the normed row for
    the experts): within bf16 rounding of the norm kernel then the projection, and of fp32."""
    from radianced.kernels import linear
    norm_kernels = layer_kernels[0]
    n, k, _, _ = LINEAR_CASES[case]
    x = _rand(1, k, dtype=torch.bfloat16, seed=30, scale=3.0)
    w = _rand(n, k, dtype=torch.bfloat16, seed=31, scale=k ** -0.5)
    norm = (_rand(k, dtype=torch.bfloat16, seed=32, scale=0.2), 1e-6, zero_centred)
    got, normed = linear.linear(x, w, norm=norm, keep_normed=True)
    unfused = norm_kernels.rms_norm(x, *norm)
    assert rel_err(normed, unfused) < 1e-2 and rel_err(got, linear.linear(unfused, w)) < 1e-2
    want = reference.linear(x.float(), w.float(), norm=(norm[0].float(), 1e-6, zero_centred))
    _check("kernel_linear_norm", f"{case}_{'zc' if zero_centred else 'plain'}", torch.bfloat16, got, want)


def test_ops_select_binds_the_layer_kernels(layer_kernels):
    from radianced.kernels import linear, ops
    norm, _, deltanet = layer_kernels
    try:
        assert ops.select("cuda") == "triton"
        assert ops.linear is linear.linear
        assert ops.rms_norm is norm.rms_norm and ops.gated_rms_norm is norm.gated_rms_norm
        assert ops.gated_delta_rule_decode is deltanet.gated_delta_rule_decode
        assert ops.gated_delta_rule_chunked is deltanet.gated_delta_rule_chunked
    finally:
        assert ops.select("cpu", oracle=True) == "reference"
    assert ops.rms_norm is reference.rms_norm and ops.linear is reference.linear
    assert ops.causal_conv1d_update is reference.causal_conv1d_update


def test_programmatic_dependent_launch_changes_no_bit(kernels, experts, monkeypatch):
    """A b1 Qwen3-30B-A3B layer's kernels (norm + q/k/v gemv, split attention with the qk-norm,
    RoPE and KV write in its launch, the split merge, o_proj + residual, norm + router gemv, experts
    routing in their gate/up launch + residual) captured in a CUDA graph and replayed twice at every
    PDL level (plain, wait only, small grids signalling after and before their wait): the same bits."""
    from radianced.kernels import linear, pdl
    attention, moe = kernels
    slab, table, _ = experts
    hq, hkv, d, ctx = 32, 4, 128, 1024
    x = _rand(1, HIDDEN, dtype=torch.bfloat16, seed=40)
    wqkv = _rand((hq + 2 * hkv) * d, HIDDEN, dtype=torch.bfloat16, seed=41, scale=HIDDEN ** -0.5)
    wo = _rand(HIDDEN, hq * d, dtype=torch.bfloat16, seed=42, scale=(hq * d) ** -0.5)
    wr = _rand(E, HIDDEN, dtype=torch.bfloat16, seed=43, scale=HIDDEN ** -0.5)
    norm_w, qk_w = _rand(HIDDEN, dtype=torch.bfloat16, seed=44), _rand(d, dtype=torch.bfloat16, seed=45)
    _, kc, vc, bt, _, _ = _paged([1], [ctx], hq, hkv, d, torch.bfloat16, seed=46)
    qs, sl = torch.tensor([0, 1], device="cuda"), torch.tensor([ctx], device="cuda")
    last = ctx - 1
    slots = (bt[0, last // BLOCK].long() * BLOCK + last % BLOCK).reshape(1)
    at = (torch.tensor([last], device="cuda"), reference.rotary_inv_freq(d, 1e6, "cuda"))

    def layer():
        q, k, v = linear.linear(x, wqkv, norm=(norm_w, 1e-6, False)).split([hq * d, hkv * d, hkv * d], dim=-1)
        o = attention.rotary_paged_attention(q.reshape(1, hq, d), k.reshape(1, hkv, d), v.reshape(1, hkv, d), *at,
                                             kc, vc, slots, bt, qs, sl, d ** -0.5, q_weight=qk_w, k_weight=qk_w,
                                             decode=True).reshape(1, hq * d)
        h = linear.linear(o, wo, residual=x)
        logits, hn = linear.linear(h, wr, norm=(norm_w, 1e-6, False), keep_normed=True)
        out, _, _ = moe.route_moe(hn, logits, TOP_K, True, table, slab, INTER, residual=h)
        return out

    outs = []
    for lv in pdl.LEVELS:
        monkeypatch.setenv("RADIANCED_PDL", str(lv))
        pdl._level.cache_clear()
        assert pdl.level(x.device) == lv
        layer()  # compiles, and sizes the arrival counters, before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer()
        for _ in range(2):
            graph.replay()
            outs.append(out.clone())
    pdl._level.cache_clear()
    assert torch.isfinite(outs[0].float()).all()
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_only_grids_of_one_program_per_sm_signal_early(monkeypatch):
    from radianced.kernels import pdl
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    try:
        for lv in pdl.LEVELS:
            monkeypatch.setenv("RADIANCED_PDL", str(lv))
            pdl._level.cache_clear()
            assert pdl.launch(dev, sms) == {"PDL": lv, "launch_pdl": lv > 0}
            assert pdl.launch(dev, sms + 1)["PDL"] == min(lv, 1)
            assert pdl.launch(dev)["PDL"] == min(lv, 1)
    finally:
        pdl._level.cache_clear()


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_argmax_is_torchs_at_qwen3_vocabulary(batch, dtype):
    """The sampler's greedy pick over Qwen3's 151,936 logits: torch's index bit for bit, a tie
    across two programs' blocks included (the lower index wins)."""
    from radianced.kernels import argmax
    logits = _rand(batch, 151_936, dtype=dtype, seed=47)
    logits[0, [70_001, 90_000]] = 100.0
    got = argmax.argmax(logits)
    assert got[0].item() == 70_001
    assert torch.equal(got, logits.argmax(dim=-1))
