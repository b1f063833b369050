"""kernels/cpu_blocks.py: the host backend's GGUF block kernels against gguf's own quantizer and dequantizer.

Q4_0 / Q4_1 / Q8_0 weights come from `gguf.quants.quantize` (llama.cpp's layouts, byte for byte); the
K-quants, which gguf's Python package does not quantize, are random blocks with finite fp16 scales (every
bit pattern of their quants, scales and mins is a valid block). The oracle is `gguf.quants.dequantize`
then an fp32 matmul. The kernels' dequantization must be gguf's bit for bit, and a product may differ
from the oracle's only by fp32 rounding: by the order of its sums in the AVX2 and AVX-512 tiles; past
`cpu_blocks.amx_rows(fmt)` rows of x on an AMX machine, also by gguf's w = d * q + m factored into
d * sum(q x) + m * sum(x) a chunk (test_cpu_blocks_amx.py bounds it against the exact product)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from radianced.kernels import cpu_blocks
from radianced.kernels.formats import FORMATS

TYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
F16_AT = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # a K-quant block's fp16 scale (and min) bytes
SHAPES = [(1, 32), (17, 96), (48, 576), (130, 64)]  # one row, odd N, SmolLM2's K, N past a thread's share
K_SHAPES = [(1, 256), (17, 512), (130, 256)]


def _shapes(fmt: str) -> list[tuple[int, int]]:
    return K_SHAPES if fmt in F16_AT else SHAPES


CASES = [(fmt, shape) for fmt in TYPES for shape in _shapes(fmt)]


def _matrix(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks [N, row bytes] uint8, gguf's fp32 dequantization [N, K]) of a random matrix: quantized by
    gguf, with one row of zeros and one of a constant, so a block's scale of 0 and a min-only Q4_1 block
    occur; or, for a K-quant, random blocks whose fp16 scales are finite."""
    rng = np.random.default_rng(seed)
    if fmt in F16_AT:
        blocks = rng.integers(0, 256, size=(n, k // 256, FORMATS[fmt].block_bytes), dtype=np.uint8)
        for at in F16_AT[fmt]:
            blocks[..., at:at + 2] = rng.uniform(-0.1, 0.1, size=(n, k // 256, 1)).astype(np.float16).view(np.uint8)
        blocks = blocks.reshape(n, -1)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32)
        w[0] = 0.0
        if n > 2:
            w[2] = 0.75
        blocks = gguf_quantize(w, TYPES[fmt])
    ref = torch.from_numpy(gguf_dequantize(blocks, TYPES[fmt]).reshape(n, k))
    return torch.from_numpy(blocks.reshape(n, -1).copy()), ref


@pytest.mark.parametrize("fmt,shape", CASES, ids=str)
def test_dequantize_is_gguf_bit_for_bit(fmt, shape):
    data, ref = _matrix(fmt, *shape)
    assert torch.equal(cpu_blocks.dequantize(data, fmt, shape), ref)


@pytest.mark.parametrize("fmt,shape", CASES, ids=str)
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 17, 32, 33, 64, 67, 192, 195])
def test_matmul_is_the_dequantized_fp32_product(fmt, shape, m):
    """Every tile of x's rows (the AVX2 tiles' 4, 3, 2, 1, direct up to 4 rows, through the dequantized panel
    from 5; the AVX-512 tiles' 8 and 7 to 1), W's rows in pairs and an odd N's last alone, and the long-prefill
    path (dequantize, then torch's GEMM) past `gemm_rows`: 64 rows of x, 192 on the AVX-512 tiles."""
    data, ref = _matrix(fmt, *shape, seed=m)
    x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(m))
    y = cpu_blocks.matmul(x, data, fmt, shape)
    expected = x @ ref.t()
    assert y.shape == (m, shape[0]) and y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5 * max([1.0, *expected.abs().flatten().tolist()]))


@pytest.mark.parametrize("rows", [1, 3, 6, 7])
def test_leading_dims_and_strided_rows(rows):
    """x [B, T, K] keeps its leading dims; a row view with a stride past K (a slice of a wider buffer) is read
    in place, by the direct tile (1, 3 rows) and the panel (6, 7), and a column-strided one is made
    contiguous first."""
    data, ref = _matrix("q4_1", 41, 576)
    wide = torch.randn(1, rows, 600)
    x = wide[..., 10:586]
    assert x.stride(-2) == 600
    torch.testing.assert_close(cpu_blocks.matmul(x, data, "q4_1", (41, 576)), x @ ref.t(), rtol=0, atol=1e-4)
    xt = torch.randn(576, rows).t()
    torch.testing.assert_close(cpu_blocks.matmul(xt, data, "q4_1", (41, 576)), xt @ ref.t(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q6_k"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_a_row_is_the_same_whatever_its_neighbours(fmt, m):
    """W's rows are taken two at a time, an odd N's last alone: each row's sums are in the same order either
    way, so a row of y is the same bit for bit whether its matrix has 1, 2 or 65 rows."""
    n, k = 65, 1536 if fmt != "q6_k" else 1024
    data, _ = _matrix(fmt, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    full = cpu_blocks.matmul(x, data, fmt, (n, k))
    for r in (0, 1, 63, 64):
        assert torch.equal(cpu_blocks.matmul(x, data[r:r + 1], fmt, (1, k)), full[:, r:r + 1])
    for r in (0, 1, 62):  # a pair starting on an odd row: rows 1 and 2 together, apart in the full matrix
        assert torch.equal(cpu_blocks.matmul(x, data[r:r + 2], fmt, (2, k)), full[:, r:r + 2])


def test_the_c_kernel_takes_more_than_32_rows():
    """`matmul` sends past `gemm_rows` rows to torch's GEMM, but the C function takes any M (in panels of 32
    rows of x, or tiles of 8): its product is still the dequantized one."""
    data, ref = _matrix("q4_0", 34, 576)
    x = torch.randn(70, 576)
    y = torch.empty(70, 34)
    cpu_blocks._lib().rad_blocks_matmul(x.data_ptr(), 70, 576, 576, data.data_ptr(), 34, data.stride(0),
                                        cpu_blocks.FORMATS["q4_0"], y.data_ptr(), 34, 2)
    expected = x @ ref.t()
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_rows_are_the_same_whatever_the_threads(m):
    """Each output row is one thread's, its sums in one order: the result does not depend on the thread count.
    (It does depend on M: a tile of 1, 2, or 3-4 rows of x keeps 4, 2 or 1 partial sums a row.)"""
    data, _ = _matrix("q8_0", 301, 576)
    x = torch.randn(m, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_blocks.matmul(x, data, "q8_0", (301, 576))
        torch.set_num_threads(2)
        two = cpu_blocks.matmul(x, data, "q8_0", (301, 576))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_inputs_name_what_is_wrong():
    data, _ = _matrix("q4_0", 4, 64)
    with pytest.raises(ValueError, match="format fp8_b128 has no CPU block kernel; these do: q4_0, q4_1, q8_0, q4_k"):
        cpu_blocks.matmul(torch.randn(1, 64), data, "fp8_b128", (4, 64))
    with pytest.raises(ValueError, match=r"q4_0 \[5, 64\]: need CPU uint8 rows"):
        cpu_blocks.matmul(torch.randn(1, 64), data, "q4_0", (5, 64))
    for m in (1, 300):  # the kernel's path and the long prefill's (past gemm_rows but on AMX)
        with pytest.raises(ValueError, match="x must be fp32, got torch.bfloat16"):
            cpu_blocks.matmul(torch.randn(m, 64, dtype=torch.bfloat16), data, "q4_0", (4, 64))


def test_a_kept_matrix_is_matmul_and_checks_each_x():
    """`Matrix` (W checked once, what the host backend keeps per weight) gives `matmul`'s values bit for bit on
    every path (the kernel, leading dims, a strided x, the long prefill), and refuses an x it cannot read."""
    data, _ = _matrix("q8_0", 48, 576)
    mat = cpu_blocks.Matrix(data, "q8_0", (48, 576))
    for x in (torch.randn(3, 576), torch.randn(2, 3, 576), torch.randn(576, 5).t(), torch.randn(576),
              torch.randn(300, 576), torch.randn(0, 576)):
        assert torch.equal(mat(x), cpu_blocks.matmul(x, data, "q8_0", (48, 576)))
    with pytest.raises(ValueError, match=r"x must be CPU fp32 \[\.\.\., 576\], got \[2, 64\]"):
        mat(torch.randn(2, 64))
    with pytest.raises(ValueError, match="x must be fp32"):
        mat(torch.randn(2, 576, dtype=torch.float64))
    for k in (512, 1024):  # rows of 612 bytes: too many for 512 (a wrong shape), too few for 1024 (reads past)
        with pytest.raises(ValueError, match=rf"q8_0 \[48, {k}\]: need CPU uint8 rows \[N, {k // 32 * 34} bytes\]"):
            cpu_blocks.Matrix(data, "q8_0", (48, k))


def test_the_library_is_built_once_per_source_and_machine(tmp_path, monkeypatch):
    """`build` compiles into radianced's cache folder under a name keyed by the source and flags, and a second
    call reuses the file; no compiler on PATH is a BuildError that names the fix."""
    monkeypatch.setenv("RADIANCED_CACHE", str(tmp_path))
    path = cpu_blocks.build()
    assert path.parent == tmp_path / "kernels" and path.name.startswith("cpu_blocks-") and path.stat().st_size
    mtime = path.stat().st_mtime_ns
    assert cpu_blocks.build() == path and path.stat().st_mtime_ns == mtime
    monkeypatch.setenv("RADIANCED_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(cpu_blocks.BuildError, match="no C compiler .* install gcc"):
        cpu_blocks.build()


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of fp32 rounding at want (at least the smallest normal's)."""
    f = torch.finfo(torch.float32)
    return (got.double() - want.double()).abs() / (want.double().abs().clamp_min(f.tiny) * f.eps)


@pytest.mark.parametrize("fmt", list(TYPES))
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13, 64])
def test_swiglu_is_torchs_silu_of_the_two_products(fmt, m):
    """`SwiGLU(gate, up)(x)` against `F.silu(gate(x)) * up(x)`: the products are the same (a row's sums do not
    depend on its neighbours), the silu within two units of fp32 rounding (cpu_exp.h's e^x against Sleef's, each
    within one); N of 37 ends on a partial chunk of 16 columns. x spread wide, so |gate(x)| passes 88.7, where
    e^-g is infinite or 0: silu is g or -0 there, as torch's."""
    n, k = 37, 512 if fmt in F16_AT else 576
    (dg, _), (du, _) = _matrix(fmt, n, k, seed=1), _matrix(fmt, n, k, seed=2)
    gate, up = cpu_blocks.Matrix(dg, fmt, (n, k)), cpu_blocks.Matrix(du, fmt, (n, k))
    pair = cpu_blocks.SwiGLU.make(gate, up)  # where the C call declines (AMX, no AVX2): the products and torch's
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.logspace(2, -1, m)[:, None]
    got, g = pair(x), gate(x)
    want = F.silu(g) * up(x)
    assert got.shape == (m, n) and bool((g.abs() > 88.8).any())
    assert float(_ulps(got, want).max()) <= 2.0


def test_swiglu_past_its_rows_and_on_other_pairs_is_the_two_products():
    """Past the rows of x the C call takes (cpu_blocks.c's SW_ROWS, 64: a long prefill) it runs the two products
    and torch's ops, bit for bit; a pair of two formats or shapes is not fused (`make`: None)."""
    (dg, _), (du, _), (d8, _) = _matrix("q4_1", 40, 576, 1), _matrix("q4_1", 40, 576, 2), _matrix("q8_0", 40, 576)
    gate, up = cpu_blocks.Matrix(dg, "q4_1", (40, 576)), cpu_blocks.Matrix(du, "q4_1", (40, 576))
    assert cpu_blocks.SwiGLU.make(gate, cpu_blocks.Matrix(d8, "q8_0", (40, 576))) is None
    assert cpu_blocks.SwiGLU.make(gate, cpu_blocks.Matrix(du[:39], "q4_1", (39, 576))) is None
    pair = cpu_blocks.SwiGLU.make(gate, up)
    x = torch.randn(65, 576)
    assert torch.equal(pair(x), F.silu(gate(x)).mul_(up(x)))
