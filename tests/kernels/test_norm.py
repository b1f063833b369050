"""The Triton RMSNorms (plain, zero-centred, gated) against `kernels/reference.py`.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (set up by
tests/kernels/interpreter.py before triton is imported), so shapes stay small and odd:
D = 72 and 200 (not powers of two), T = 1, 15, 63, 300. fp32 within 1e-4 of
max|ref|; bf16 within 1e-2 of the fp32 reference on the same bf16 values.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import rand, require_interpreted  # before triton loads
from tests.kernels.compare import f32, rel_err

from radianced.kernels import norm, reference

require_interpreted(norm._rms_norm_kernel, "norm")

EPS = 1e-6


@pytest.mark.parametrize("t", [1, 15, 63, 300])
@pytest.mark.parametrize("zero_centred", [False, True], ids=["plain", "zero_centred"])
def test_rms_norm_fp32_matches_reference(t, zero_centred):
    x, w = rand(t, 200, seed=t, scale=3.0), rand(200, seed=1, scale=0.1)
    want = reference.rms_norm(f32(x), f32(w), EPS, zero_centred)
    assert rel_err(norm.rms_norm(x, w, EPS, zero_centred).cpu(), want) < 1e-4


@pytest.mark.parametrize("zero_centred", [False, True], ids=["plain", "zero_centred"])
def test_rms_norm_bf16_within_1e_2_of_fp32(zero_centred):
    x, w = rand(33, 72, dtype=torch.bfloat16, seed=2), rand(72, dtype=torch.bfloat16, seed=3)
    got = norm.rms_norm(x, w, EPS, zero_centred)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.cpu(), reference.rms_norm(f32(x), f32(w), EPS, zero_centred)) < 1e-2


def test_plain_output_dtype_follows_torch_promotion():
    """bf16 activations with an fp32 weight give fp32, as `weight * x` does in the reference."""
    x, w = rand(5, 72, dtype=torch.bfloat16), rand(72, seed=4)
    got = norm.rms_norm(x, w, EPS)
    want = reference.rms_norm(x.cpu(), w.cpu(), EPS)
    assert got.dtype == want.dtype == torch.float32
    assert rel_err(got.cpu(), want) < 1e-4


def test_per_head_norm_of_a_strided_projection_view():
    """Qwen3's q-norm: heads of [T, H, D] cut from a wider projection (row stride > H * D)."""
    proj = rand(15, 9, 2 * 64, seed=5)
    q = proj[:, :, :64]  # [T, 9, 64] view, strides (1152, 128, 1)
    w = rand(64, seed=6)
    assert rel_err(norm.rms_norm(q, w, EPS).cpu(), reference.rms_norm(f32(q), f32(w), EPS)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 63])
def test_gated_rms_norm_matches_reference(dtype, t):
    """DeltaNet's output norm over [T, Hv, V] with the gate a strided view, Hv = 6."""
    x = rand(t, 6, 40, dtype=dtype, seed=7, scale=2.0)
    z = rand(t, 6, 2 * 40, dtype=dtype, seed=8)[:, :, 40:]
    w = rand(40, dtype=dtype, seed=9)
    got = norm.gated_rms_norm(x, z, w, EPS)
    want = reference.gated_rms_norm(f32(x), f32(z), f32(w), EPS)
    assert got.dtype == dtype
    assert rel_err(got.cpu(), want) < (1e-4 if dtype == torch.float32 else 1e-2)


def test_bad_shapes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"x has last dim 72, the weight has 64"):
        norm.rms_norm(rand(3, 72), rand(64), EPS)
    with pytest.raises(ValueError, match=r"gate \(3, 40\) must have x's shape \(3, 72\)"):
        norm.gated_rms_norm(rand(3, 72), rand(3, 40), rand(72), EPS)
