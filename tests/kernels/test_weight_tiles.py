"""`weight_tile` (kernels/weight_tiles.py) alone: the tiles of a compact matrix, stored as the kernel
dequantizes them, equal the oracle's dequantization (`CompactWeight.dequantize`, kernels/dequant.py)
bit for bit, and are 0 where the tile's mask is off.

A small kernel walks the matrix as the linear and MoE kernels do (program i: rows [i * BLOCK_N, +BLOCK_N),
K steps of BLOCK_K from 0) and stores every tile whole into a padded output. N = 150 (not a multiple of
BLOCK_N = 32; two fp8 scale rows, the second partial) and K = 288 (nine GGUF blocks, not a multiple of
64 or 256: the last step holds fewer blocks, whole; three fp8 scale columns, the last 32 wide). BLOCK_K
16 is the narrow per-value path, 32 to 256 the blocked one (one block a row to eight, the last step
masked), 512 whole rows as the gemv takes them (fp8_b128's scales per 128-wide block), 1024 whole rows
wider than `BLOCK_PATH_MAX_K` (the GGUF formats value by value again). Nine blocks a
row make every other q8_0 / q4_0 row and block start 2 mod 4 (read from the aligned words around them);
a matrix starting 2 mod 4 too. GGUF blocks are
random bytes with finite fp16 scales (every quant pattern: q8_0's -128, every nibble); fp8_b128 is
`quantize`d. q4_1's `d * q + m` may fuse into one FMA on a GPU (one rounding where the oracle rounds
twice), so there it is held within an ulp of |d * q|; everywhere else, and interpreted, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import DEVICE, INTERPRET, require_interpreted  # before triton loads

import triton
import triton.language as tl

from radianced.kernels import weight_tiles
from radianced.kernels.compact import CompactWeight
from radianced.kernels.formats import FORMATS
from radianced.kernels.weight_tiles import weight_tile
from radianced.model.quantize import quantize

require_interpreted(weight_tiles.weight_tile, "weight_tiles")

N, K, BLOCK_N = 150, 288, 32


@triton.jit
def _tiles_kernel(w_ptr, out_ptr, n_rows, k_cols, stride_out, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    for k0 in range(0, k_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = weight_tile(w_ptr, n, k, (n < n_rows)[:, None] & (k < k_cols)[None, :], n_rows, k_cols, FMT)
        tl.store(out_ptr + n[:, None] * stride_out + k[None, :], w)


def _gguf(fmt: str, n: int, k: int, seed: int) -> CompactWeight:
    """Random blocks of `fmt` whose fp16 d (and m) are finite, of either sign."""
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * k // 32, f.block_bytes), generator=g, dtype=torch.uint8)
    scales = 2 if fmt == "q4_1" else 1
    f16 = (torch.randn((n * k // 32, scales), generator=g) * 0.01).half()
    blocks[:, :2 * scales] = f16.view(torch.uint8)
    return CompactWeight(fmt, (n, k), blocks.reshape(-1))


def _weight(fmt: str, seed: int = 0) -> CompactWeight:
    if fmt == "fp8_b128":
        return quantize(torch.randn((N, K), generator=torch.Generator().manual_seed(seed)) * K ** -0.5, fmt)
    return _gguf(fmt, N, K, seed)


def _tiles(w: CompactWeight, block_k: int, at: int = 0) -> torch.Tensor:
    """The kernel's tiles, whole, in a NaN-filled [ceil(N / BLOCK_N) * BLOCK_N, ceil(K / BLOCK_K) * BLOCK_K];
    the matrix's bytes `at` bytes into a buffer of 0xFF bytes (16-byte aligned)."""
    n, k = w.shape
    rows, cols = triton.cdiv(n, BLOCK_N) * BLOCK_N, triton.cdiv(k, block_k) * block_k
    out = torch.full((rows, cols), float("nan"), device=DEVICE)
    buf = torch.full((at + w.data.numel() + 16,), 0xFF, dtype=torch.uint8)
    buf[at:at + w.data.numel()] = w.data
    _tiles_kernel[(rows // BLOCK_N,)](buf.to(DEVICE)[at:], out, n, k, out.stride(0), FMT=w.fmt, BLOCK_N=BLOCK_N,
                                      BLOCK_K=block_k)
    return out.cpu()


@pytest.mark.parametrize("block_k", [16, 32, 64, 256, 512, 1024])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "fp8_b128"])
def test_tiles_are_the_oracles_dequantization_and_zero_past_the_matrix(fmt, block_k):
    w = _weight(fmt, seed=block_k)
    got, want = _tiles(w, block_k), w.dequantize()
    assert torch.equal(got[N:], torch.zeros_like(got[N:])) and torch.equal(got[:, K:], torch.zeros_like(got[:, K:]))
    got = got[:N, :K]
    if fmt == "q4_1" and not INTERPRET:
        b = w.data.view(-1, 20)
        d = b[:, :2].contiguous().view(torch.float16).float().repeat_interleave(32).view(N, K)
        assert ((got - want).abs() <= d.abs() * 15 * 2 ** -23).all()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_matrix_starting_2_mod_4_is_read_from_the_aligned_words_around_it(fmt):
    """An expert's up piece follows its gate piece in the extent, so q8_0's and q4_0's can start 2 bytes
    past a 4-byte boundary (I and H / 32 odd); the words before and after it hold other bytes."""
    w = _gguf(fmt, N, K, seed=7)
    assert torch.equal(_tiles(w, 64, at=2)[:N, :K], w.dequantize())


def test_a_block_of_8_bit_quants_keeps_each_sign_and_a_block_of_nibbles_ggmls_order():
    """Hand-made blocks (d = 1): q8_0's quants -128..127 come back as themselves; q4_0's bytes 0..15
    holding (low, high) nibbles (j, 15 - j) give values j - 8 (0..15) then 7 - j (16..31)."""
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    q8 = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).view(torch.uint8).view(8, 32)
    blocks = torch.cat([one.expand(8, 2), q8], dim=1)  # [8 blocks, 34]: one row of K = 256
    got = _tiles(CompactWeight("q8_0", (1, 256), blocks.reshape(-1).clone()), 256)[0]
    assert torch.equal(got, torch.arange(-128, 128, dtype=torch.float32))
    j = torch.arange(16, dtype=torch.uint8)
    q4 = torch.cat([one, j | ((15 - j) << 4)])  # [18]: one block
    got = _tiles(CompactWeight("q4_0", (1, 32), q4.clone()), 32)[0, :32]
    assert torch.equal(got, torch.cat([j.float() - 8, 7 - j.float()]))
