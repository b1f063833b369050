"""The Triton linear on compact weights (kernels/linear.py, `weight_tile`) against `reference.linear`
on the same `CompactWeight` (its fp32 dequantization, rounded to x's dtype).

Without CUDA the kernels run in Triton's interpreter on CPU tensors, so shapes stay small: N = 130
(not a multiple of the 16 / 64 columns of a program, two fp8 scale blocks, the second partial) and
K = 288 (nine 32-value GGUF blocks: not a multiple of the 64 / 256 / 512 K steps, so the last step
holds fewer blocks, masked whole; three fp8 scale blocks). T = 1 (gemv), 5 and 16 ("dot", 16-row
tiles, 512-value steps), 37 (a 64-row tile) and 37 in 16-row tiles (three programs down the grid's
second axis); T = 5 also in 16-value steps (weight_tiles.py's per-value path, half a GGUF block a
step) and in 32 x 256 tiles. Weights are written as the
converters write them (`quantize`: q8_0, q4_0, fp8_b128; `gguf.quants.quantize`: q4_1). Outputs are
poisoned with NaN (every element must be written). fp32 activations: within 1e-5 of max|ref|, and
bit for bit the same kernel over the dense dequantized weight where the dequantization is a bare
product; bf16: within 2^-7 of the fp32 reference on the bf16-rounded weight (two roundings, of the
product and of the residual sum, each within 2^-8 of its value).
"""

from __future__ import annotations

import gguf
import pytest
import torch

from tests.kernels.interpreter import DEVICE, rand, require_interpreted  # before triton loads
from tests.kernels.compare import f32, rel_err

from radianced.kernels import linear, reference
from radianced.kernels import norm as norm_kernels
from radianced.kernels.compact import CompactWeight, RowStack
from radianced.model.quantize import quantize

require_interpreted(linear._linear_kernel, "linear")

N, K = 130, 288
FORMATS = ("q8_0", "q4_0", "q4_1", "fp8_b128")
PRODUCTS = ("q8_0", "q4_0", "fp8_b128")  # dequantized by a bare product: the very fp32 weights


def compact(fmt: str, n: int = N, k: int = K, seed: int = 0) -> CompactWeight:
    w = torch.randn((n, k), generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    if fmt == "q4_1":  # not a --quantize scheme: a GGUF's Q4_1 blocks, as gguf writes them
        blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
        cw = CompactWeight(fmt, (n, k), torch.from_numpy(blocks))
    else:
        cw = quantize(w, fmt)
    return cw.to(DEVICE)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every float tensor the op allocates starts as NaN: an element it does not write shows."""
    real_empty, real_like = torch.empty, torch.empty_like

    def nan(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan(real_like(*a, **kw)))


def _operands(t: int, n: int, dtype: torch.dtype, seed: int = 0):
    x = rand(t, K, dtype=dtype, seed=seed)
    return x, rand(n, dtype=dtype, seed=seed + 1), rand(t, n, dtype=dtype, seed=seed + 2, scale=4.0)


def _want(x, w: CompactWeight | RowStack, bias, residual, norm=None, **kw):
    """The reference in fp32 on x's values and the weight rounded to x's dtype (`compact.dense`)."""
    dense = w.dequantize(x.dtype).float().cpu()
    return reference.linear(f32(x), dense, *(None if a is None else f32(a) for a in (bias, residual)),
                            None if norm is None else (f32(norm[0]), *norm[1:]), **kw)


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2 ** -7


CASES = [(1, None), (5, None), (16, None), (37, None), (37, linear.LinearConfig(64, 64, 4, 2, block_m=16)),
         (5, linear.LinearConfig(16, 16, 4, 2)), (5, linear.LinearConfig(32, 256, 4, 2))]


@pytest.mark.parametrize("t,cfg", CASES, ids=["t1_gemv", "t5", "t16", "t37", "t37_tiles16", "t5_step16", "t5_step256"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_format_matches_the_reference_with_bias_and_residual(fmt, t, cfg, dtype):
    w = compact(fmt)
    x, b, r = _operands(t, N, dtype)
    got = linear.linear(x, w, b, r, cfg=cfg)
    assert got.dtype == dtype and got.shape == (t, N) and not got.isnan().any()
    assert rel_err(got.cpu(), _want(x, w, b, r)) < _tol(dtype)


@pytest.mark.parametrize("t,cfg", [(1, None), (5, None), (37, None)], ids=["t1_gemv", "t5", "t37"])
@pytest.mark.parametrize("fmt", PRODUCTS)
def test_dequantized_in_registers_equals_the_dense_weight_bit_for_bit(fmt, t, cfg):
    """Same kernel, same tiles, same order: the compact bytes give the bits of the dense fp32 weight."""
    w = compact(fmt, seed=1)
    x, b, r = _operands(t, N, torch.float32, seed=3)
    cfg = linear.linear_config(t, N, K, torch.float32, fmt)
    assert torch.equal(linear.linear(x, w, b, r, cfg=cfg), linear.linear(x, w.dequantize(), b, r, cfg=cfg))


@pytest.mark.parametrize("t", [1, 5, 20])
@pytest.mark.parametrize("zero_centred", [False, True], ids=["plain", "zero_centred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_norm_before_a_compact_projection(t, zero_centred, dtype):
    """`norm=` with `keep_normed` (the router's call): in the gemv launch at T = 1, the norm kernel
    first above; the normed rows are the norm kernel's own, bit for bit."""
    w = compact("q4_1", seed=2)
    x, b, r = _operands(t, N, dtype, seed=4)
    norm = (rand(K, dtype=dtype, seed=5, scale=0.2), 1e-6, zero_centred)
    got, normed = linear.linear(x * 3, w, b, r, norm, keep_normed=True)
    assert torch.equal(normed, norm_kernels.rms_norm(x * 3, *norm))
    assert rel_err(got.cpu(), _want(normed, w, b, r)) < _tol(dtype)
    assert torch.equal(linear.linear(x * 3, w, b, r, norm), got)


@pytest.mark.parametrize("t", [1, 3, 17])
def test_fp32_logits_of_a_compact_weight_are_the_rounded_values_widened(t):
    w = compact("q8_0", seed=6)
    x, b, r = _operands(t, N, torch.bfloat16, seed=7)
    norm = (rand(K, dtype=torch.bfloat16, seed=8, scale=0.2), 1e-6, False)
    got = linear.linear(x, w, b, r, norm, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, linear.linear(x, w, b, r, norm).float())


@pytest.mark.parametrize("t", [1, 5, 20])
def test_a_row_stack_runs_each_part_into_its_columns(t):
    """[q | k | v] of several formats (`compact.cat_rows` gives a RowStack for fp8_b128 parts or mixed
    ones): fp8_b128 [130, K], q4_0 [40, K] and a dense [24, K], with the bias and residual split."""
    parts = (compact("fp8_b128", seed=9), compact("q4_0", 40, seed=10), rand(24, K, seed=11, scale=K ** -0.5))
    stack = RowStack(parts)
    x, b, r = _operands(t, 194, torch.float32, seed=12)
    got = linear.linear(x, stack, b, r)
    assert got.shape == (t, 194) and not got.isnan().any()
    assert rel_err(got.cpu(), _want(x, stack, b, r)) < 1e-5


@pytest.mark.parametrize("t", [1, 3, 20])
def test_the_mlp_of_compact_weights_projects_through_the_kernels(t):
    """`silu_mlp` (what `ops.select("cuda")` binds): every projection compact, or gate compact beside
    dense up and down; the reference dequantizes each weight to x's dtype."""
    gate, up, down = compact("q4_0", 96, seed=13), compact("q8_0", 96, seed=14), compact("fp8_b128", K, 96, seed=15)
    x = rand(t, K, seed=16)
    want = reference.silu_mlp(f32(x), *(w.dequantize() for w in (gate, up, down)))
    assert rel_err(linear.silu_mlp(x, gate, up, down).cpu(), want) < 1e-5
    mixed = (gate, up.dequantize().to(DEVICE), down.dequantize().to(DEVICE))
    assert rel_err(linear.silu_mlp(x, *mixed).cpu(), reference.silu_mlp(f32(x), *(f32(
        w.dequantize() if isinstance(w, CompactWeight) else w) for w in mixed))) < 1e-5


def test_no_rows_give_an_empty_result():
    got = linear.linear(rand(0, K), compact("q4_0"), rand(N), rand(0, N))
    assert got.shape == (0, N) and got.dtype == torch.float32


def test_formats_without_kernels_and_bad_weights_are_refused():
    x = rand(2, K)
    q6 = CompactWeight("q6_k", (16, 256), torch.zeros(16 * 210, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match=r"reads q8_0, q4_0, q4_1, fp8_b128 weights, not q6_k .* --quantize layers"):
        linear.linear(rand(2, 256), q6)
    with pytest.raises(ValueError, match=r"weight must be \[N, K=288\], got a q4_0 matrix of shape \[130, 256\]"):
        linear.linear(x, compact("q4_0", k=256))
    w = compact("q8_0")
    shifted = CompactWeight("q8_0", w.shape, torch.empty(w.nbytes + 2, dtype=torch.uint8, device=DEVICE)[2:])
    with pytest.raises(ValueError, match=r"must be contiguous, 16-byte aligned"):
        linear.linear(x, shifted)
    with pytest.raises(ValueError, match=r"weight is on meta, x on"):
        linear.linear(x, CompactWeight("q8_0", w.shape, w.data.to("meta")))


def test_config_of_a_compact_weight_is_always_a_kernel():
    """No cuBLAS path for compact bytes: the gemv at T = 1, "dot" tiles at 2..16 rows and wide N (K steps
    of 512 values, or next_pow2(K) below: whole GGUF blocks), and above 16 rows tiles of next_pow2(T)
    rows up to 128."""
    bf16 = torch.bfloat16
    assert linear.linear_config(1, 5120, 2048, bf16, "q4_0").kind == "gemv"
    assert linear.linear_config(8, 5120, 2048, bf16, "fp8_b128") == linear.LinearConfig(16, 512, 4, 3)
    assert linear.linear_config(8, 130, 288, bf16, "q8_0").block_k == 512
    assert linear.linear_config(8, 130, 96, bf16, "q4_1").block_k == 128
    assert linear.linear_config(1, 64, linear.GEMV_MAX_K + 32, bf16, "q4_0") == linear.LinearConfig(16, 512, 4, 3)
    assert linear.linear_config(17, 5120, 2048, bf16, "q8_0").block_m == 32
    assert linear.linear_config(4096, 2048, 4096, bf16, "q4_1") == linear.LinearConfig(64, 64, 8, 3, block_m=128)
    assert linear.linear_config(8, 5120, 2048, bf16) is None  # the same shapes dense: cuBLAS


def test_the_dense_mlp_layer_projects_compact_weights_through_the_ops_cuda_binds():
    """model/layers.py's DenseMLP with compact weights under `ops.select("cuda")` (the kernels
    interpreted here) gives what the CPU's ops give within fp32 rounding."""
    from radianced.kernels import ops
    from radianced.model.layers import DenseMLP

    weights = {"mlp.gate_proj.weight": compact("q4_1", 96, seed=17), "mlp.up_proj.weight": compact("q4_0", 96, seed=18),
               "mlp.down_proj.weight": compact("q8_0", K, 96, seed=19)}
    mlp = DenseMLP("mlp", weights.__getitem__)
    x = rand(3, K, seed=20)
    try:
        assert ops.select("cuda") == "triton" and ops.silu_mlp is linear.silu_mlp
        got = mlp(x).cpu()
    finally:
        ops.select("cpu", oracle=True)
        want = mlp(x).cpu()
        ops.select("cpu")
    assert rel_err(got, want) < 1e-5
