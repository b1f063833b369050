"""`--quantize` on the card: the same bytes as on the host (model/quantize.py; tests/model/test_quantize.py
holds the host's to gguf's), so a synthetic or converted model quantized on a GPU is the one the CPU writes."""

from __future__ import annotations

import pytest
import torch

from radianced.model.quantize import quantize
from tests.gpu.conftest import gpu_device
from tests.model.test_quantize import awkward


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "fp8_b128"])
def test_device_bytes_equal_host(fmt):
    w = awkward(300, 2048, seed=11)
    on_card = quantize(w.to(gpu_device()), fmt)
    assert on_card.data.device.type == torch.device(gpu_device()).type
    assert torch.equal(on_card.data.cpu(), quantize(w, fmt).data)
