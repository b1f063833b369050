"""The Triton skinny linear against `reference.linear`.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors. T = 1, 3, 15
and 16 rows run the kernel; 17 and 40 take torch's F.linear. Shapes N = 130,
K = 200 and N = 64, K = 2048: N not a multiple of the 16 or 32 columns of a
program, K (200) not a multiple of its reduction step. fp32 within 1e-4 of
max|ref|; bf16 within 1e-2 of the fp32 reference on the same bf16 values, and,
on integer values where every sum is exact, equal to the bf16 reference bit for
bit (the bias before the one rounding, the residual after it).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, rand, require_interpreted  # before triton loads
from tests.kernels.compare import f32, rel_err

from radianced.kernels import linear, reference
from radianced.kernels import norm as norm_kernels

require_interpreted(linear._linear_kernel, "linear")

SHAPES = pytest.mark.parametrize("n,k", [(130, 200), (64, 2048)], ids=["n130_k200", "n64_k2048"])


def _operands(t: int, n: int, k: int, bias: bool, residual: bool, dtype=torch.float32):
    x, w = rand(t, k, dtype=dtype, seed=t), rand(n, k, dtype=dtype, seed=k, scale=k ** -0.5)
    b = rand(n, dtype=dtype, seed=n) if bias else None
    r = rand(t, n, dtype=dtype, seed=t + n, scale=4.0) if residual else None
    return x, w, b, r


def _f32(*tensors):
    return tuple(None if a is None else f32(a) for a in tensors)


@pytest.mark.parametrize("t", [1, 3, 15, 16])
@SHAPES
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["no_residual", "residual"])
def test_fp32_matches_reference(t, n, k, bias, residual):
    x, w, b, r = _operands(t, n, k, bias, residual)
    got = linear.linear(x, w, b, r)
    assert got.dtype == torch.float32 and got.shape == (t, n)
    assert rel_err(got.cpu(), reference.linear(*_f32(x, w, b, r))) < 1e-4


@pytest.mark.parametrize("t", [1, 3, 16])
@SHAPES
@pytest.mark.parametrize("block_n", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemv_kind_matches_reference(t, n, k, block_n, dtype):
    """The CUDA-core kernel (whole rows in registers), with the bias and the residual."""
    x, w, b, r = _operands(t, n, k, True, True, dtype)
    got = linear.linear(x, w, b, r, cfg=linear.LinearConfig(block_n, 0, 4, 1, "gemv"))
    assert got.dtype == dtype and got.shape == (t, n)
    assert rel_err(got.cpu(), reference.linear(*_f32(x, w, b, r))) < (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("zero_centred", [False, True], ids=["plain", "zero_centred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_norm_before_the_projection(t, zero_centred, dtype):
    """`norm=`: RMSNorm of x, then the projection. T = 1 does it in the gemv launch (every program
    normalizes the row; program 0 keeps it), T = 3 (tiles) and 17 (torch) run the norm kernel
    first. The normed rows are the norm kernel's own, bit for bit."""
    x, w, b, r = _operands(t, 130, 200, True, True, dtype)
    x = x * 3
    norm = (rand(200, dtype=dtype, seed=21, scale=0.2), 1e-6, zero_centred)
    got, normed = linear.linear(x, w, b, r, norm, keep_normed=True)
    assert torch.equal(normed, norm_kernels.rms_norm(x, *norm))
    want, want_normed = reference.linear(*_f32(x, w, b, r), (f32(norm[0]), 1e-6, zero_centred), keep_normed=True)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(got.cpu(), want) < tol and rel_err(normed.cpu(), want_normed) < tol
    assert torch.equal(linear.linear(x, w, b, r, norm), got)


@pytest.mark.parametrize("t", [1, 3, 17])
def test_fp32_logits_are_the_rounded_values_widened(t):
    """`out_dtype=torch.float32` (the lm_head): the bf16 result's own values stored as fp32, on every
    path (gemv at T = 1 with the norm in its launch, tiles at 3, torch at 17): no cast launch, the
    same numbers as `linear(...).float()`."""
    x, w, b, r = _operands(t, 130, 200, True, True, torch.bfloat16)
    norm = (rand(200, dtype=torch.bfloat16, seed=22, scale=0.2), 1e-6, False)
    got = linear.linear(x, w, b, r, norm, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (t, 130)
    assert torch.equal(got, linear.linear(x, w, b, r, norm).float())
    assert torch.equal(reference.linear(x, w, b, r, norm, out_dtype=torch.float32),
                       reference.linear(x, w, b, r, norm).float())


def test_a_norm_weight_of_another_width_is_refused():
    x, w = rand(1, 200), rand(130, 200)
    with pytest.raises(ValueError, match=r"the norm weight must be \[K=200\]"):
        linear.linear(x, w, norm=(rand(199), 1e-6, False))


@pytest.mark.parametrize("t", [1, 16])
@SHAPES
def test_bf16_within_1e_2_of_fp32(t, n, k):
    x, w, b, r = _operands(t, n, k, True, True, torch.bfloat16)
    got = linear.linear(x, w, b, r)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.cpu(), reference.linear(*_f32(x, w, b, r))) < 1e-2


def test_bf16_rounds_the_product_before_the_residual_as_torch_does():
    """Integer values, every sum exact in fp32: row 0's products are 257 (bf16 256) and the bias
    +1 or -1 joins before the rounding (258, 256); the residual 1 joins after it (256 + 1 rounds
    back to 256; added before, 258 would stay). Bit for bit the bf16 reference."""
    k, n = 257, 40
    x = torch.ones(3, k)
    x[1, :100] = -1.0  # row 1: 257 - 200 = 57
    x[2] = torch.arange(k) % 3 - 1.0  # row 2: a small mix
    w = torch.ones(n, k)
    w[::2, ::5] = 2.0
    b = torch.tensor([1.0, -1.0, 0.0, 3.0] * 10)
    r = torch.ones(3, n)
    x, w, b, r = (a.bfloat16().to(DEVICE) for a in (x, w, b, r))
    for bias, residual in ((None, None), (b, None), (None, r), (b, r)):
        got = linear.linear(x, w, bias, residual).cpu()
        want = reference.linear(x.cpu(), w.cpu(), *(None if a is None else a.cpu() for a in (bias, residual)))
        assert torch.equal(got, want)
    assert linear.linear(x[:1], w[1:2], None, r[:1, :1]).item() == 256.0  # 257 -> 256, + 1 -> 256


@pytest.mark.parametrize("t", [17, 40])
def test_more_rows_than_skinny_max_are_torchs_own_result(t):
    x, w, b, r = _operands(t, 130, 200, True, True)
    assert torch.equal(linear.linear(x, w, b, r), reference.linear(x, w, b, r))


def test_strided_rows_of_x_and_residual():
    """Rows cut from wider tensors (row strides 400 and 300), as views of a projection would be."""
    x = rand(15, 400, seed=1)[:, 100:300]
    r = rand(15, 300, seed=2)[:, :130]
    w, b = rand(130, 200, seed=3, scale=0.1), rand(130, seed=4)
    assert x.stride(0) == 400 and r.stride(0) == 300
    assert rel_err(linear.linear(x, w, b, r).cpu(), reference.linear(*_f32(x, w, b, r))) < 1e-4


def test_no_rows_give_an_empty_result():
    got = linear.linear(rand(0, 200), rand(130, 200), rand(130), rand(0, 130))
    assert got.shape == (0, 130) and got.dtype == torch.float32


def test_config_follows_the_h200_sweep():
    """T = 1: the gemv kernel (4 rows a program from GEMV_WIDE_N outputs); 1 < T <= 16: the
    tensor-core tiles, except wide N (cuBLAS wins, None); above 16 rows torch (None). fp32 steps
    span as many bytes as bf16 ones."""
    bf16 = torch.bfloat16
    assert linear.linear_config(1, 5120, 2048, bf16) == linear.LinearConfig(2, 0, 8, 1, "gemv")
    assert linear.linear_config(1, 151936, 2048, bf16) == linear.LinearConfig(4, 0, 8, 1, "gemv")  # an lm_head
    assert linear.linear_config(1, 2048, 4096, torch.float32).kind == "gemv"
    assert linear.linear_config(1, 64, linear.GEMV_MAX_K + 1, bf16).kind == "dot"
    assert linear.linear_config(4, 2048, 4096, bf16) == linear.LinearConfig(16, 512, 4, 3, "dot")
    assert linear.linear_config(16, 128, 2048, torch.float32).block_k == 256
    assert linear.linear_config(4, 130, 40, torch.float32).block_k == 64
    assert linear.linear_config(4, 5120, 2048, bf16) is None and linear.linear_config(17, 64, 64, bf16) is None


def test_rows_cublas_takes_are_torchs_own_result():
    x, w, _, r = _operands(4, linear.CUBLAS_MIN_N, 64, False, True)
    assert torch.equal(linear.linear(x, w, residual=r), reference.linear(x, w, None, r))


def test_bad_operands_are_refused_with_the_numbers():
    x, w = rand(3, 200), rand(130, 200)
    with pytest.raises(ValueError, match=r"weight must be \[N, K=200\] .* got shape \(130, 201\)"):
        linear.linear(x, rand(130, 201))
    with pytest.raises(ValueError, match=r"residual must be \[T=3, N=130\] .* got shape \(3, 129\)"):
        linear.linear(x, w, residual=rand(3, 129))
    with pytest.raises(ValueError, match=r"bias must be \[N=130\], got shape \(131,\)"):
        linear.linear(x, w, rand(131))
    with pytest.raises(ValueError, match=r"weight is on meta, x on"):
        linear.linear(x, w.to("meta"))
    with pytest.raises(ValueError, match=r"residual is torch.bfloat16, x is torch.float32"):
        linear.linear(x, w, residual=rand(3, 130, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be \[T, K\] with a contiguous last dim"):
        linear.linear(rand(200, 3).T, w)
