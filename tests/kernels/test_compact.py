"""CompactWeight: rows gathered without dequantizing the rest, row stacking, and per-use dequantization in the
reference ops equal the same ops on the dequantized matrix."""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import reference
from radianced.kernels.compact import CompactWeight, RowStack, cat_rows
from radianced.kernels.formats import expert_formats, is_compact
from radianced.model.quantize import quantize

FORMATS = ("q8_0", "q4_0", "fp8_b128")


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_equal_the_same_rows_of_the_dequantized_matrix(fmt):
    w = quantize(torch.randn(300, 64, generator=torch.Generator().manual_seed(0)), fmt)
    ids = torch.tensor([[0, 299], [128, 127]])
    assert torch.equal(w.rows(ids), w.dequantize()[ids])
    assert w.rows(ids, torch.bfloat16).dtype == torch.bfloat16


def test_cat_rows_joins_gguf_bytes_and_stacks_the_rest():
    g = torch.Generator().manual_seed(1)
    a, b = quantize(torch.randn(8, 64, generator=g), "q8_0"), quantize(torch.randn(4, 64, generator=g), "q8_0")
    joined = cat_rows([a, b])
    assert isinstance(joined, CompactWeight) and joined.shape == (12, 64)
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    f = quantize(torch.randn(4, 64, generator=g), "fp8_b128")
    dense = torch.randn(2, 64, generator=g)
    stacked = cat_rows([a, f, dense])
    assert isinstance(stacked, RowStack) and stacked.shape == (14, 64)
    assert torch.equal(stacked.dequantize(), torch.cat([a.dequantize(), f.dequantize(), dense]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_ops_take_compact_weights(fmt):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g)
    gate, up, down = (quantize(torch.randn(*s, generator=g), fmt) for s in ((96, 64), (96, 64), (64, 96)))
    assert torch.equal(reference.linear(x, gate), reference.linear(x, gate.dequantize()))
    assert torch.equal(reference.silu_mlp(x, gate, up, down),
                       reference.silu_mlp(x, gate.dequantize(), up.dequantize(), down.dequantize()))


@pytest.mark.parametrize("fmt", [*FORMATS, "q4_0+q8_0", "fp8_b128+q4_0"])
def test_reference_moe_reads_compact_extents_through_the_table(fmt):
    g = torch.Generator().manual_seed(3)
    inter, hidden, experts = 32, 64, 4
    gate_up, down = expert_formats(fmt)
    pieces = [[quantize(torch.randn(*s, generator=g), f)
               for s, f in (((inter, hidden), gate_up), ((inter, hidden), gate_up), ((hidden, inter), down))]
              for _ in range(experts)]
    slab = torch.stack([torch.cat([p.data.reshape(-1) for p in e]) for e in pieces])  # uint8 [E, extent bytes]
    dense = torch.stack([torch.cat([p.dequantize().reshape(-1) for p in e]) for e in pieces])
    x = torch.randn(7, hidden, generator=g)
    ids = torch.randint(0, experts, (7, 2), generator=g)
    weights = torch.rand(7, 2, generator=g)
    table = torch.tensor([2, 0, 3, 1])
    got = reference.moe(x, ids, weights, table, slab[[1, 3, 0, 2]], inter, weight_format=fmt)
    want = reference.moe(x, ids, weights, table, dense[[1, 3, 0, 2]], inter)
    assert torch.equal(got, want)


def test_expert_format_names():
    assert expert_formats("q4_k") == ("q4_k", "q4_k")
    assert expert_formats("q4_k+q6_k") == ("q4_k", "q6_k")
    assert is_compact("q4_k+q6_k") and not is_compact("bf16")
    for bad in ("q4_k+q4_k", "q9_0", "q4_k+q6_k+q8_0"):
        with pytest.raises(ValueError, match="unknown expert format"):
            expert_formats(bad)
