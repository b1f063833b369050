"""The Triton RoPE (full and partial, alone or fused with the qk-norm) against `kernels/reference.py`.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (set up by
tests/kernels/interpreter.py before triton is imported). Shapes: SmolLM2's 9 query / 3
KV heads x 64 (full rotary), Qwen3-Next's partial rotary (R = 16 of D = 64 here,
a quarter as in the real model) with zero-centred qk-norms, positions up to
4000. fp32 within 1e-4 of max|ref|; bf16 within 1e-2 of the fp32 reference on
the same bf16 values.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, rand, require_interpreted  # before triton loads
from tests.kernels.compare import f32, rel_err

from radianced.kernels import reference, rope

require_interpreted(rope._rotary_kernel, "rope")

THETA = 10000.0


def rope_at(t: int, rotary_dim: int, seed: int = 0, high: int = 4000):
    """(positions [T], inv_freq [R / 2]) on the test device: t distinct positions below `high`."""
    positions = torch.randperm(high, generator=torch.Generator().manual_seed(seed))[:t]
    return positions.to(DEVICE), reference.rotary_inv_freq(rotary_dim, THETA, DEVICE)


def cpu(rope_args):
    return tuple(a.cpu() for a in rope_args)


@pytest.mark.parametrize("t", [1, 15, 63, 300])
def test_full_rotary_matches_reference(t):
    x = rand(t, 9, 64, seed=t)
    at = rope_at(t, 64, seed=t)
    assert rel_err(rope.apply_rotary(x, *at).cpu(), reference.apply_rotary(f32(x), *cpu(at))) < 1e-4


def test_angles_far_into_the_context():
    """The kernel's own cos and sin at positions up to 131,071 (angles of 1e5 radians in fp32)."""
    x = rand(63, 4, 128, seed=5)
    at = rope_at(63, 128, seed=5, high=131072)
    assert rel_err(rope.apply_rotary(x, *at).cpu(), reference.apply_rotary(f32(x), *cpu(at))) < 1e-4


def test_bad_rope_tables_are_refused():
    positions, inv_freq = rope_at(4, 16)
    with pytest.raises(ValueError, match=r"positions must be \[T\] int32 or int64"):
        rope.apply_rotary(rand(4, 2, 64), positions.float(), inv_freq)
    with pytest.raises(ValueError, match=r"inv_freq must be \[R / 2\] float32"):
        rope.apply_rotary(rand(4, 2, 64), positions, inv_freq.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_passes_the_other_dims_through(dtype):
    x = rand(15, 3, 64, dtype=dtype, seed=1)
    at = rope_at(15, 16, seed=1)
    got = rope.apply_rotary(x, *at)
    want = reference.apply_rotary(f32(x), *cpu(at))
    assert got.dtype == dtype
    assert rel_err(got.cpu(), want) < (1e-4 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got[..., 16:], x[..., 16:])  # bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_qk_without_norm_is_two_rotations(dtype):
    """One launch for q (9 heads, a strided view of a wider projection) and k (3 heads)."""
    q = rand(15, 9, 128, dtype=dtype, seed=2)[:, :, :64]
    k = rand(15, 3, 64, dtype=dtype, seed=3)
    at = rope_at(15, 64, seed=2)
    got_q, got_k = rope.rotary_qk(q, k, *at)
    want_q, want_k = reference.rotary_qk(f32(q), f32(k), *cpu(at))
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(got_q.cpu(), want_q) < tol and rel_err(got_k.cpu(), want_k) < tol


@pytest.mark.parametrize("t", [1, 15])
@pytest.mark.parametrize("zero_centred", [False, True], ids=["qwen3_plain", "next_zero_centred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_qk_fused_with_the_qk_norm(t, zero_centred, dtype):
    """Qwen3 (plain norm, full rotary) and Qwen3-Next (zero-centred norm, partial rotary R = D / 4)."""
    rotary_dim = 16 if zero_centred else 64
    q, k = rand(t, 6, 64, dtype=dtype, seed=4) * 3, rand(t, 2, 64, dtype=dtype, seed=5)
    qw, kw = (rand(64, dtype=dtype, seed=s) * 0.1 for s in (6, 7))
    at = rope_at(t, rotary_dim, seed=t)
    got_q, got_k = rope.rotary_qk(q, k, *at, qw, kw, 1e-6, zero_centred)
    want_q, want_k = reference.rotary_qk(f32(q), f32(k), *cpu(at), f32(qw), f32(kw), 1e-6, zero_centred)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert got_q.dtype == got_k.dtype == dtype
    assert rel_err(got_q.cpu(), want_q) < tol and rel_err(got_k.cpu(), want_k) < tol


def _caches(dtype: torch.dtype, seed: int):
    """K and V cache views [P=3, N=2, S=4, Hkv=2, D=64] of one interleaved storage, as the KV pool
    lays them out (strided, only the head dim contiguous)."""
    storage = rand(3, 2, 2, 4, 2, 64, dtype=dtype, seed=seed)  # [P, N, K|V, S, Hkv, D]
    return storage[:, :, 0], storage[:, :, 1]


@pytest.mark.parametrize("zero_centred", [False, True], ids=["qwen3_plain", "next_zero_centred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_is_rotary_qk_then_write_kv(zero_centred, dtype):
    """The fused prologue: q as rotary_qk gives it, and the caches as write_kv of rotary_qk's k
    and the v leaves them, bit for bit; a slot of -1 (a padding row) writes nothing."""
    t, rotary_dim = 5, 16 if zero_centred else 64
    q = rand(t, 6, 64, dtype=dtype, seed=8)
    kv = rand(t, 2, 2, 64, dtype=dtype, seed=9)
    k, v = kv[:, 0], kv[:, 1]  # strided tokens, as views of the q/k/v projection are
    qw, kw = (rand(64, dtype=dtype, seed=s) * 0.1 for s in (11, 12))
    at = rope_at(t, rotary_dim, seed=3)
    slots = torch.tensor([13, 2, -1, 23, 6], device=DEVICE)  # pages 1, 0, -, 2, 0; blocks across pages
    k_cache, v_cache = _caches(dtype, seed=13)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_q, rotated_k = rope.rotary_qk(q, k, *at, qw, kw, 1e-6, zero_centred)
    reference.write_kv(want_k_cache, want_v_cache, rotated_k, v, slots)
    got_q = rope.rotary_write_kv(q, k, v, *at, k_cache, v_cache, slots, qw, kw, 1e-6, zero_centred)
    assert torch.equal(got_q, want_q)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)
    ref_k, ref_v = _caches(torch.float32, seed=13)
    ref_q = reference.rotary_write_kv(f32(q), f32(k), f32(v), *cpu(at), ref_k, ref_v, slots.cpu(),
                                      f32(qw), f32(kw), 1e-6, zero_centred)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(got_q.cpu(), ref_q) < tol and rel_err(k_cache.cpu(), ref_k) < tol


def test_rotary_write_kv_refuses_caches_that_do_not_fit():
    at = rope_at(2, 64)
    k_cache, v_cache = _caches(torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"do not fit caches"):
        rope.rotary_write_kv(rand(2, 6, 64), rand(2, 3, 64), rand(2, 3, 64), *at, k_cache, v_cache,
                             torch.zeros(2, dtype=torch.int64, device=DEVICE))


def test_bad_shapes_are_refused_with_the_numbers():
    at = rope_at(4, 16)
    with pytest.raises(ValueError, match=r"q has 3 tokens, positions has 4"):
        rope.apply_rotary(rand(3, 2, 64), *at)
    with pytest.raises(ValueError, match=r"rotary dim 80 must be even and at most the head dim"):
        rope.apply_rotary(rand(4, 2, 64), *rope_at(4, 80))
    with pytest.raises(ValueError, match=r"needs both q_weight and k_weight"):
        rope.rotary_qk(rand(4, 2, 64), rand(4, 2, 64), *at, q_weight=rand(64))
