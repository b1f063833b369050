"""tools/activation_precision.py's Q8 rounding is llama.cpp's Q8_0, checked against the gguf package's own
quantizer and dequantizer."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from tools.activation_precision import q8_blocks


def test_q8_blocks_round_as_gguf_q8_0_does():
    scales = torch.tensor([1e-3, 1.0, 40.0, 1e4])[:, None]  # each of the 4 rows of 3 blocks at its own scale
    x = torch.randn(3, 4, 96, generator=torch.Generator().manual_seed(0)) * scales
    x[0, 0, :32] = 0.0  # a block of zeros keeps its zeros
    x[1, 2, 5] = 300.0  # one large value sets its block's scale
    x[2, 1, 64:70] = torch.tensor([127.0, 2.5, -0.5, 1.5, -3.5, 0.0])  # halves: away from zero, as gguf rounds
    ref = quants.dequantize(quants.quantize(x.reshape(-1, 96).numpy(), GGMLQuantizationType.Q8_0),
                            GGMLQuantizationType.Q8_0)
    got = q8_blocks(x)
    assert got.shape == x.shape
    np.testing.assert_array_equal(got.reshape(-1, 96).numpy(), ref)
    assert not got[0, 0, :32].any()
