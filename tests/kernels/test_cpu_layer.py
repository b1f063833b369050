"""kernels/cpu_layer.py: a Llama layer of a decode step in one C call, against the model's own ops.

A tiny random Llama converted with its layers in q8_0 (`--quantize layers=int8`) or q4_0 (int4), the formats
the block kernels read, decoded greedily (tests/greedy.py: a batch of prompts of different lengths, so the
contexts differ) with the fused layer and with it off (`ops.dense_layer` bound to the reference's, which
declines): the logits agree to fp32 rounding (the fused RMSNorm's sums run in another order), the greedy tokens
are the same, and the KV cache the steps wrote agrees too; over a plain fp32 cache and over each quantized cache's
planes (`--kv-cache-dtype fp8 | fp8_v4 | k6_v4`: the fused layer's attention then cpu_attention.c's over them).
SmolLM2 on the fused layer is held to transformers by tests/model/test_smollm2_compact.py (64 greedy tokens, no
ties)."""

from __future__ import annotations

import pytest
import torch

from radianced.kernels import cpu, cpu_layer, ops, reference
from radianced.kv.cache import KVCache
from radianced.model.convert import convert
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from tests.greedy import greedy_generate

PROMPTS = [[5, 9, 200, 17, 33, 4, 8], [100, 3], [44] * 19]
STEPS = 12


@pytest.fixture(scope="module", params=["int8", "int4"])
def tiny_llama(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"llama_{request.param}")
    make_tiny("llama", root / "hf")
    convert(root / "hf", root / "m.rad", quantize=f"layers={request.param}")
    return root / "m.rad"


def _decode(path, fused: bool, monkeypatch, kv_dtype: str = "auto"):
    if not fused:
        monkeypatch.setattr(ops, "dense_layer", reference.dense_layer)
    with RadFile.open(path) as rad:
        model = load_model(rad)
        cache = KVCache.allocate(rad.model, num_blocks=32, block_size=4, num_state_slots=1, dtype=torch.float32,
                                 kv_dtype=kv_dtype)
        trace = greedy_generate(model, cache, PROMPTS, STEPS)
    monkeypatch.undo()
    return trace, cache, model


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_v4", "k6_v4"])
def test_a_decode_layer_in_one_call_is_the_layer_of_ops(tiny_llama, monkeypatch, kv_dtype):
    calls = []
    monkeypatch.setattr(ops, "dense_layer", lambda *a: calls.append(cpu.dense_layer(*a)) or calls[-1])
    fused, fused_cache, model = _decode(tiny_llama, True, monkeypatch, kv_dtype)
    fused_calls = sum(c is not None for c in calls)  # every decode step's layers; the prefill's declined
    assert fused_calls == (STEPS - 1) * len(model.layers) and len(calls) == STEPS * len(model.layers)
    ops_trace, ops_cache, _ = _decode(tiny_llama, False, monkeypatch, kv_dtype)
    assert fused.tokens == ops_trace.tokens
    for a, b in zip(fused.logits, ops_trace.logits):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    # fp32 values within the RMSNorm's rounding; the planes' bytes equal (a code could move with such a difference;
    # in these cases none does)
    torch.testing.assert_close(fused_cache.storage, ops_cache.storage, rtol=0, atol=1e-5)


def test_layers_it_does_not_run_are_left_to_the_ops(tiny_llama, tmp_path):
    """A layer in fp32 (weights the block kernels do not read) has no fused form, nor a batch past its products'
    `gemm_rows`; the call checks x, the step's rows and the rotation's tables before the library reads them."""
    make_tiny("llama", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "dense.rad")
    with RadFile.open(tmp_path / "dense.rad") as rad:
        assert cpu._dense_layer(load_model(rad).layers[0]) is None
    with RadFile.open(tiny_llama) as rad:
        layer = load_model(rad).layers[0]
        fused = cpu._dense_layer(layer)
        assert isinstance(fused, cpu_layer.DenseLayer)
        context = cpu.cpu_attention.Context(torch.tensor([[0, 4]]), torch.tensor([6]), 4, torch.tensor([5]))
        cos = sin = torch.ones(1, 1, 16)
        scratch = fused.scratch(context, cos, sin, None)
        assert fused.scratch(context, cos, sin, scratch) is scratch
        x = torch.randn(1, 64)
        with pytest.raises(ValueError, match=r"x must be contiguous fp32 \[1, 64\]"):
            fused(torch.randn(2, 64), scratch, torch.zeros(16, 32), 8)
        with pytest.raises(ValueError, match="the keys read reach row 16 of 12"):
            fused(x, scratch, torch.zeros(12, 32), 8)  # V rows 8 past K: the context's row 7 reads past row 12
        assert fused(x, scratch, torch.zeros(16, 32), 8).shape == (1, 64)
        with pytest.raises(ValueError, match="R even and at most 16"):
            fused.scratch(context, torch.ones(1, 1, 18), torch.ones(1, 1, 18), None)
        # a quantized cache's scratch (block ids and slots) for its planes, and neither for the other
        cache = KVCache.allocate(rad.model, num_blocks=4, block_size=4, num_state_slots=1, dtype=torch.float32,
                                 kv_dtype="k6_v4")
        pair = cpu.cpu_attention.PlanePair.of(*cache.layer(0))
        reads = cpu.cpu_attention.PlaneReads(torch.tensor([[0, 1]]), [6], 1, 4)
        planes_scratch = fused.scratch((reads, cpu.cpu_attention.PlaneSlots(torch.tensor([5]))), cos, sin, None)
        assert fused.planes(x, planes_scratch, pair).shape == (1, 64)
        with pytest.raises(ValueError, match="addresses quantized planes"):
            fused(x, planes_scratch, torch.zeros(16, 32), 8)
        with pytest.raises(ValueError, match="addresses a plain cache's rows"):
            fused.planes(x, scratch, pair)
        far = cpu.cpu_attention.PlaneReads(torch.tensor([[0, 4]]), [6], 1, 4)  # block 4 of a 4-block cache
        with pytest.raises(ValueError, match="outside the cache's 4 blocks"):
            fused.planes(x, fused.scratch((far, cpu.cpu_attention.PlaneSlots(torch.tensor([5]))), cos, sin, None),
                         pair)
        # past its products' gemm_rows the op path dequantizes for torch's GEMM (other sums): declined there
        limits = [m.gemm_rows for m in fused.keep[1] if m.gemm_rows is not None]
        assert fused.rows == (min(limits) if limits else None)
        if fused.rows is not None:
            decode = type("Decode", (), {"is_decode": True})()  # only read before the rows are
            assert cpu.dense_layer(layer, torch.randn(fused.rows + 1, 64), None, decode, None) is None
