"""`--quantize`'s torch quantizers against the gguf package's own (model/quantize.py): the same bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radianced.model.quantize import fits, parse_quantize, quantize

GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def awkward(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] fp32 values that exercise every branch of the block rules: normal rows, an all-zero block, a
    block whose largest magnitudes tie with opposite signs, values exactly halfway between two steps,
    scales below fp16's normal range and above its largest finite value's neighbourhood."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((n, k), generator=g) * torch.logspace(-3, 1, n)[:, None]
    w[0, :32] = 0.0
    w[1, :32] = torch.randn(32, generator=g)
    w[1, 3], w[1, 9] = 2.5, -2.5  # ties: the first of them sets q4_0's sign
    w[2, :32] = torch.arange(32) - 15.5  # halfway points under both rules
    w[3, :32] *= 1e-6  # scales in fp16's subnormal range
    w[4, :32] *= 1e4
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("shape", [(5, 32), (7, 96), (33, 256)])
def test_gguf_bytes(fmt, shape):
    w = awkward(*shape, seed=shape[0])
    got = quantize(w, fmt)
    want = gguf.quants.quantize(w.numpy(), GGUF_TYPES[fmt])
    assert got.data.shape == want.shape
    assert np.array_equal(got.data.numpy(), want)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_gguf_bytes_from_bf16(fmt):
    """A bf16 source is widened to fp32 first, as the converter hands gguf fp32 values."""
    w = awkward(9, 64, seed=3).bfloat16()
    want = gguf.quants.quantize(w.float().numpy(), GGUF_TYPES[fmt])
    assert np.array_equal(quantize(w, fmt).data.numpy(), want)


def test_fp8_block_rule():
    """fp8_b128: a scale per 128 x 128 block, amax / 448, the values E4M3 of w / scale; padded edges."""
    w = awkward(130, 200, seed=5)
    got = quantize(w, "fp8_b128")
    back = got.dequantize()
    block = w[:128, :128]
    scale = block.abs().max() / 448.0
    assert torch.equal(back[:128, :128], (block / scale).to(torch.float8_e4m3fn).float() * scale)
    assert back.shape == (130, 200)
    assert (back - w).abs().max() <= w.abs().max() / 448.0 * 16  # E4M3's coarsest step at the top of a block


def test_refuses_partial_blocks():
    assert not fits("q4_0", (4, 48))
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        quantize(torch.ones(4, 48), "q4_0")


def test_parse_quantize():
    assert parse_quantize("experts=int4,layers=fp8") == {"experts": "q4_0", "layers": "fp8_b128"}
    with pytest.raises(ValueError, match="CLASS=SCHEME"):
        parse_quantize("experts=int3")
