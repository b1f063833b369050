"""Reference dequantizers equal gguf's numpy ones bit for bit; fp8_b128 equals `w.float() * scale_inv` per block.

Q8_0 / Q4_0 / Q4_1 blocks come from `gguf.quants.quantize` (what a converter writes);
the K-quants, which gguf cannot quantize, from random bytes with finite fp16 scales
(every bit pattern of the rest is a valid block).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radianced.kernels.dequant import dequantize, dequantize_fp8_b128, dequantize_rows, split_fp8_b128
from radianced.kernels.formats import FORMATS

Q = gguf.GGMLQuantizationType
WRITTEN = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
K_QUANTS = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
# where each K-quant's fp16 scales sit in its block (random bytes there could be inf / nan)
F16_AT = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


@pytest.mark.parametrize("fmt", sorted(WRITTEN))
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (33, 64)])
def test_quantized_by_gguf_dequantizes_like_gguf(fmt, shape):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3, size=(shape[0], 1))).astype(np.float32)
    w[0, :8] = 0  # an all-zero half block, and a block with zeros
    data = gguf.quants.quantize(w, WRITTEN[fmt])
    expected = gguf.quants.dequantize(data, WRITTEN[fmt])
    ours = dequantize(torch.from_numpy(data), fmt, shape)
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, torch.from_numpy(expected))
    assert data.nbytes == FORMATS[fmt].nbytes(shape)


@pytest.mark.parametrize("fmt", sorted(K_QUANTS))
@pytest.mark.parametrize("rows", [1, 3, 10])
def test_random_k_quant_blocks_dequantize_like_gguf(fmt, rows):
    f = FORMATS[fmt]
    rng = np.random.default_rng(rows)
    data = rng.integers(0, 256, size=(rows, 2 * f.block_bytes), dtype=np.uint8)
    blocks = data.reshape(-1, f.block_bytes)
    for at in F16_AT[fmt]:
        blocks[:, at:at + 2] = rng.uniform(-2, 2, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    expected = gguf.quants.dequantize(data, K_QUANTS[fmt])
    ours = dequantize_rows(torch.from_numpy(data), fmt, 2 * f.block)
    assert torch.equal(ours, torch.from_numpy(expected))


def test_fp8_block_scales_apply_per_128_by_128_block():
    n, k = 300, 200  # partial blocks on both edges
    g = torch.Generator().manual_seed(0)
    values = (torch.randn(n, k, generator=g) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 2, generator=g) + 0.01
    expected = torch.empty(n, k)
    for i in range(3):
        for j in range(2):
            block = values[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            expected[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = block.float() * scale_inv[i, j]
    assert torch.equal(dequantize_fp8_b128(values, scale_inv), expected)
    nbytes = FORMATS["fp8_b128"].nbytes((n, k))
    data = torch.zeros(nbytes, dtype=torch.uint8)
    data[:24] = scale_inv.flatten().view(torch.uint8)
    data[24:24 + n * k] = values.flatten().view(torch.uint8)
    v, s = split_fp8_b128(data, (n, k))
    assert torch.equal(s, scale_inv) and torch.equal(v.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(dequantize(data, "fp8_b128", (n, k)), expected)
    assert nbytes == 24 + n * k + 8  # padded to 16


def test_k_quant_rows_must_hold_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        FORMATS["q4_k"].nbytes((4, 128))
