"""kernels/cpu_blocks.c's AMX path (M >= `cpu_blocks.amx_rows(fmt)` where the CPU has AMX-BF16 and Linux grants
the tile state): W's quants as exact bf16 integers, x in three bf16 parts, y += d * sum(q x) (+- m * sum(x)) a chunk.

That is gguf's w = d * q + m factored, not W's dequantized fp32 values multiplied, so the product is checked
against the exact one (float64) within what fp32 rounding allows any order of sums: |y - y64| <= (K + 64) u
|x| @ (|W| + 2 |m|).T with u = 2^-24, a bound on both factorings' terms (|d q| + |m| <= |w| + 2 |m|); the fp32
oracle `x @ W.dequantize().T` meets the same bound. Then the bits the factoring must keep: one nonzero x a chunk
times a power-of-two weight is exact, which x cut to bf16 (8 bits) or two parts (16) would not be.
On a machine without the path these run the AVX-512 or AVX2 tiles, which meet the same bounds."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radianced.kernels import cpu_blocks
from tests.kernels.test_cpu_blocks import TYPES, _matrix, _ulps

U = 2.0 ** -24


def _min_bound(data: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """[N, K] float64: a bound on |m| of each value's chunk (0 where the format has no min): Q4_1's fp16 m,
    a K-quant's 63 |dmin| (its 6-bit min times the block's fp16 dmin)."""
    n = data.shape[0]
    if fmt not in ("q4_1", "q4_k", "q5_k"):
        return torch.zeros(n, k, dtype=torch.float64)
    values = 32 if fmt == "q4_1" else 256
    blocks = data.numpy().reshape(n, k // values, -1)
    m = np.abs(blocks[..., 2:4].copy().view(np.float16).astype(np.float64)) * (1 if fmt == "q4_1" else 63)
    return torch.from_numpy(np.repeat(m.reshape(n, -1), values, axis=1))


def _bound(x: torch.Tensor, ref: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Per element of y: (K + 64) u times a bound on the sum of |terms| of either factoring (float64):
    |w| for the oracle's, |d q| + |m| <= |w| + 2 |m| for the kernel's."""
    ax = x.double().abs()
    return (x.shape[1] + 64) * U * (ax @ (ref.double().abs() + 2 * mins).t())


def _check(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, data: torch.Tensor, fmt: str) -> None:
    exact = x.double() @ ref.double().t()
    err, bound = (y.double() - exact).abs(), _bound(x, ref, _min_bound(data, fmt, x.shape[1]))
    assert y.dtype == torch.float32 and bool((err <= bound).all()), \
        f"{fmt}: worst error {(err / bound.clamp_min(1e-300)).max().item():.2f} of the fp32 bound"


def _ks(fmt: str) -> list[int]:
    """One chunk (a block), SmolLM2's K, and K past cpu_blocks.c's segment of 512 values (3 of them)."""
    return [256, 512, 1280] if fmt.endswith("_k") else [32, 576, 1536]


@pytest.mark.parametrize("fmt", list(TYPES))
@pytest.mark.parametrize("n", [17, 130])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 35])
def test_products_around_the_threshold_are_exact_to_fp32_rounding(fmt, n, m):
    """Rows of x below and past each format's threshold (1-8), one and several groups of 16 (the A tiles' rows),
    W's tiles of 16 rows and a tail (17, 130), every format, each K; `_matrix` puts a zero row and a constant row
    (a min-only Q4_1 block) in the quantized formats."""
    for k in _ks(fmt):
        data, ref = _matrix(fmt, n, k, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
        _check(cpu_blocks.matmul(x, data, fmt, (n, k)), x, ref, data, fmt)


@pytest.mark.parametrize("fmt", list(TYPES))
def test_the_fp32_oracle_meets_the_same_bound(fmt):
    """The bound is fp32's, not the kernel's: `x @ W.T` in fp32 (torch's order of sums) meets it too."""
    k = _ks(fmt)[-1]
    data, ref = _matrix(fmt, 130, k)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(1))
    _check(x @ ref.t(), x, ref, data, fmt)


@pytest.mark.parametrize("m", [5, 8, 16, 17])
def test_x_keeps_all_its_24_bits(m):
    """A Q8_0 matrix of one chunk with d = 1 and quants that are powers of two, x with one nonzero value: each
    y is q * x exactly (x's three bf16 parts sum back to x; a part left out would lose bits 9-24)."""
    n, k = 19, 32
    rng = np.random.default_rng(m)
    blocks = np.zeros((n, k // 32, 34), dtype=np.uint8)
    blocks[..., 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    q = rng.choice(np.array([1, 2, 4, 64, -1, -8, -128], dtype=np.int8), size=(n, k // 32, 32))
    blocks[..., 2:] = q.view(np.uint8)
    data = torch.from_numpy(blocks.reshape(n, -1))
    x = torch.zeros(m, k)
    at = torch.from_numpy(rng.integers(0, 32, size=(m, k // 32)))
    x[torch.arange(m), at[:, 0]] = torch.from_numpy((1 + rng.random(m, dtype=np.float32))  # 24-bit mantissas
                                                    * rng.choice([-1.0, 1.0], size=m).astype(np.float32))
    y = cpu_blocks.matmul(x, data, "q8_0", (n, k))
    w = torch.from_numpy(q.reshape(n, k).astype(np.float32))
    expected = x.double() @ w.double().t()  # a power of two times x: exact in fp32
    assert torch.equal(y.double(), expected) and bool((y != 0).all())


@pytest.mark.parametrize("m", [5, 8, 17, 33])
def test_rows_are_the_same_whatever_the_threads_and_neighbours(m):
    """Each W row's sums are its own (its lane of the B tiles and of C), whichever thread takes it and
    whatever rows share its tile of 16: y is the same bit for bit on 1 or 2 threads and for W's slices."""
    n, k = 130, 576
    data, _ = _matrix("q4_1", n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_blocks.matmul(x, data, "q4_1", (n, k))
        torch.set_num_threads(2)
        two = cpu_blocks.matmul(x, data, "q4_1", (n, k))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for r0, r1 in ((0, 1), (3, 20), (15, 17), (127, 130)):
        assert torch.equal(cpu_blocks.matmul(x, data[r0:r1], "q4_1", (r1 - r0, k)), two[:, r0:r1])


def test_a_row_of_x_is_the_same_whatever_the_others():
    """Past the threshold x's rows are the A tiles' rows, each summed alone: a row of y does not depend on M
    or on the other rows of x (below it the AVX2 tiles' sums depend on M, cpu_blocks.c's J_OF)."""
    amx = cpu_blocks.amx_rows("q8_0")
    if not amx:
        pytest.skip("no AMX path on this machine")
    data, _ = _matrix("q8_0", 48, 576)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(0))
    full = cpu_blocks.matmul(x, data, "q8_0", (48, 576))
    for m0, m1 in ((0, amx), (3, 20), (17, 40)):
        assert torch.equal(cpu_blocks.matmul(x[m0:m1], data, "q8_0", (48, 576)), full[m0:m1])


@pytest.mark.parametrize("flags,tiles", [(("-mno-amx-tile", "-mno-amx-bf16"), "AVX-512 or AVX2"),
                                         (("-mno-avx512f",), "AVX2")], ids=["no-amx", "no-avx512"])
def test_a_build_without_amx_or_avx512_runs_tiles_with_the_dequantized_values(tmp_path, monkeypatch, flags, tiles):
    """The fallbacks a CPU without AMX gets (here: the same source built with -mno-amx-tile: the AVX-512 tiles of
    Q4_0 / Q4_1 / Q8_0 where the CPU has AVX-512, Zen 4's path) and one without AVX-512 too (-mno-avx512f: the
    AVX2 tiles): no AMX path, the long prefill back on dequantize + GEMM past `gemm_rows`, and W's dequantized
    values summed in another order, on the rows of x an AMX machine sends to the tiles; the fused SwiGLU on them."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not cpu_blocks.available():
        pytest.skip("no C compiler")
    out = tmp_path / "fallback.so"
    done = subprocess.run([cc, *cpu_blocks.FLAGS, *flags, "-o", str(out), *map(str, cpu_blocks.SOURCES)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lib = cpu_blocks.declare(ctypes.CDLL(str(out)))
    monkeypatch.setattr(cpu_blocks, "_lib", lambda: lib)
    assert cpu_blocks.amx_rows("q4_1") == 0
    assert cpu_blocks.gemm_rows("q4_1") in ((64,) if tiles == "AVX2" else (64, 192))
    assert cpu_blocks.gemm_rows("q6_k") == 64
    for fmt in TYPES:
        k = _ks(fmt)[1]
        data, ref = _matrix(fmt, 130, k)
        for m in (1, 5, 8, 17, cpu_blocks.gemm_rows(fmt) + 1):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            expected = x @ ref.t()
            torch.testing.assert_close(cpu_blocks.matmul(x, data, fmt, (130, k)), expected, rtol=0,
                                       atol=1e-5 * expected.abs().max().item())
        gate, up = cpu_blocks.Matrix(data, fmt, (130, k)), cpu_blocks.Matrix(_matrix(fmt, 130, k, seed=1)[0], fmt,
                                                                         (130, k))
        x = torch.randn(8, k)
        assert float(_ulps(cpu_blocks.SwiGLU.make(gate, up)(x), F.silu(gate(x)) * up(x)).max()) <= 2.0
