"""The host backend's MoE (kernels/cpu.py `moe`, `route_moe`): `reference.moe` over the pointer table with each
expert's MLP through the block kernels, against the reference's per-use dequantization of the same bytes.

Four experts in a uint8 slab (two more in a host pool), each extent gate | up | down in a GGUF format as
`--quantize` writes it (q4_0 / q8_0, and a Q4_K_M-style q4_k gate/up beside a q6_k down from random
blocks); the outputs agree to fp32 rounding (the block kernels read the same weight values and sum in
another order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radianced.kernels import cpu, reference
from radianced.kernels.compact import CompactWeight
from radianced.kernels.formats import FORMATS, expert_formats
from radianced.model.quantize import quantize

H, I, E = 256, 512, 6
SLAB_ROWS = {0: 2, 2: 0, 3: 3, 5: 1}  # expert -> slab row; experts 1 and 4 live in the host pool
HOST_ROWS = {1: 1, 4: 0}


def _piece(shape: tuple[int, int], fmt: str, g: torch.Generator) -> torch.Tensor:
    if fmt in ("q4_0", "q8_0"):
        return quantize(torch.randn(shape, generator=g) * shape[1] ** -0.5, fmt).data.reshape(-1)
    f = FORMATS[fmt]  # a K-quant: random blocks, their fp16 scale (and min) finite and small
    blocks = torch.randint(0, 256, (shape[0] * shape[1] // f.block, f.block_bytes), dtype=torch.uint8, generator=g)
    for at in ((208,) if fmt == "q6_k" else (0, 2)):
        scale = (torch.rand(blocks.shape[0], 1, generator=g) * 0.02).half()
        blocks[:, at:at + 2] = scale.view(torch.uint8)
    return blocks.reshape(-1)


@pytest.mark.parametrize("weight_format", ["q4_0", "q8_0", "q4_k+q6_k"])
def test_the_host_moe_reads_compact_experts_like_the_reference(weight_format):
    g = torch.Generator().manual_seed(0)
    gate_up, down = expert_formats(weight_format)
    extents = [torch.cat([_piece(s, f, g) for s, f in (((I, H), gate_up), ((I, H), gate_up), ((H, I), down))])
               for _ in range(E)]
    width = extents[0].numel()
    slab, host = torch.zeros(4, width, dtype=torch.uint8), torch.zeros(2, width, dtype=torch.uint8)
    table = torch.empty(E, dtype=torch.int64)
    for e, row in SLAB_ROWS.items():
        slab[row], table[e] = extents[e], row
    for e, row in HOST_ROWS.items():
        host[row], table[e] = extents[e], -1 - row
    x, logits = torch.randn(5, H, generator=g), torch.randn(5, E, generator=g)
    want, ids, weights = reference.route_moe(x, logits, 2, True, table, slab, I, host, weight_format=weight_format)
    got, got_ids, got_weights = cpu.route_moe(x, logits, 2, True, table, slab, I, host, weight_format=weight_format)
    assert torch.equal(ids, got_ids) and torch.equal(weights, got_weights)
    assert set(ids.flatten().tolist()) & set(HOST_ROWS) and set(ids.flatten().tolist()) & set(SLAB_ROWS)
    tol = 1e-5 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    residual = torch.randn(5, H, generator=g)
    torch.testing.assert_close(cpu.moe(x, ids, weights, table, slab, I, host, residual=residual,
                                       weight_format=weight_format), residual + want, rtol=0, atol=tol)
