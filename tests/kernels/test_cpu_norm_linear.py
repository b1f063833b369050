"""The host backend's norm, projection and rotary ops (kernels/cpu.py) against
`kernels/reference.py`. In fp32 the fused RMSNorm and the rotation give the reference's values
bit for bit, so the tests assert equality; bf16 falls back to the reference's two roundings."""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import cpu, reference

SHAPES = [(1, 8), (3, 576), (17, 80), (2, 5, 24)]


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_equals_the_reference(shape, zero_centred, dtype):
    x, w = _randn(*shape, dtype=dtype), _randn(shape[-1], seed=1, dtype=dtype)
    assert torch.equal(cpu.rms_norm(x, w, 1e-6, zero_centred), reference.rms_norm(x, w, 1e-6, zero_centred))


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_of_heads_in_a_wider_row_equals_the_reference(eps):
    """qk-norm's input: [T, H, D] heads viewed inside the q/k/v projection's wider rows (not contiguous),
    normed inside inference mode as the model runs, with each eps its constants are made for."""
    qkv = _randn(5, 15 * 64)
    k = qkv.view(5, 15, 64)[:, 9:12]
    w = _randn(64, seed=1)
    with torch.inference_mode():
        assert torch.equal(cpu.rms_norm(k, w, eps), reference.rms_norm(k, w, eps))
    assert torch.equal(cpu.rms_norm(k, w, eps), reference.rms_norm(k, w, eps))


@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("norm", [None, "plain", "zero_centred"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_linear_equals_the_reference(t, norm, bias, residual):
    """Norm, projection, bias, residual add, fp32 logits and the kept normed input, each as the
    reference rounds them."""
    k, n = 40, 33
    x, w = _randn(t, k), _randn(n, k, seed=1)
    kw = dict(bias=_randn(n, seed=2) if bias else None, residual=_randn(t, n, seed=3) if residual else None,
              norm=None if norm is None else (_randn(k, seed=4), 1e-5, norm == "zero_centred"))
    got, got_normed = cpu.linear(x, w, keep_normed=True, out_dtype=torch.float32, **kw)
    want, want_normed = reference.linear(x, w, keep_normed=True, out_dtype=torch.float32, **kw)
    assert torch.equal(got, want) and torch.equal(got_normed, want_normed)


@pytest.mark.parametrize("rotary_dim, head_dim", [(8, 8), (16, 64), (32, 80)])
@pytest.mark.parametrize("t", [1, 13])
def test_rotary_equals_the_reference_full_and_partial(rotary_dim, head_dim, t):
    q, k = _randn(t, 5, head_dim), _randn(t, 1, head_dim, seed=1)
    positions = torch.arange(t) * 37 + 3
    inv_freq = reference.rotary_inv_freq(rotary_dim, 1e6, "cpu")
    for got, want in zip(cpu.rotary_qk(q, k, positions, inv_freq), reference.rotary_qk(q, k, positions, inv_freq)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rotary_dim, head_dim", [(8, 8), (32, 80)])
def test_q_and_k_of_one_projection_rotate_together_as_the_reference(rotary_dim, head_dim):
    """q and k as neighbouring heads of one fused q/k/v output (the layer's views) take one rotation;
    the values are the reference's, bit for bit."""
    t, hq, hkv = 7, 6, 2
    qkv = _randn(t, (hq + 2 * hkv) * head_dim)
    q = qkv[:, :hq * head_dim].reshape(t, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].reshape(t, hkv, head_dim)
    positions = torch.arange(t) * 11 + 5
    inv_freq = reference.rotary_inv_freq(rotary_dim, 1e4, "cpu")
    for got, want in zip(cpu.rotary_qk(q, k, positions, inv_freq), reference.rotary_qk(q, k, positions, inv_freq)):
        assert got.shape == want.shape and torch.equal(got, want)
