"""A llama GGUF converted with its blocks kept compact: the bytes in the `.rad` are the file's, in HF row
order, and the model's logits equal transformers' (which dequantizes at load) to fp32 rounding."""

from __future__ import annotations

import gguf
import pytest
import torch

from radianced.kernels.compact import CompactWeight
from radianced.kv.cache import KVCache
from radianced.model.gguf import convert_gguf
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from tests.model.test_gguf import hf_model, rad_tensors, write_tiny_gguf
from tests.oracle import compare_prefill_rows

Q = gguf.GGMLQuantizationType
QUANTIZED = {
    "token_embd.weight": Q.Q8_0, "attn_q.weight": Q.Q4_1, "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q8_0,
    "attn_output.weight": Q.Q4_0, "ffn_gate.weight": Q.Q4_1, "ffn_up.weight": Q.Q8_0, "ffn_down.weight": Q.Q4_1,
}


def test_compact_tensors_dequantize_to_the_fp32_conversion_bit_for_bit(tmp_path):
    src, _ = write_tiny_gguf(tmp_path / "t.gguf", types=QUANTIZED, untied=True)
    convert_gguf(src, tmp_path / "fp32.rad", None)
    convert_gguf(src, tmp_path / "compact.rad", None, compact=True)
    dense, compact = rad_tensors(tmp_path / "fp32.rad"), rad_tensors(tmp_path / "compact.rad")
    assert set(dense) == set(compact)
    kept = {n: t for n, t in compact.items() if isinstance(t, CompactWeight)}
    assert len(kept) == 1 + 7 * 2  # the embeddings and 7 matrices per layer (lm_head is F32 here)
    for name, t in compact.items():
        got = t.dequantize() if isinstance(t, CompactWeight) else t
        assert torch.equal(got, dense[name]), name
    with RadFile.open(tmp_path / "compact.rad") as rad:
        assert rad.tensor_entry("model.layers.0.self_attn.q_proj.weight").dtype == "q4_1"


@pytest.mark.parametrize("oracle", [True, False], ids=["reference-ops", "host-blocks"])
def test_compact_model_matches_transformers_prefill(tmp_path, request, oracle):
    """To fp32 rounding on both: the reference ops dequantize per use, the host backend's block kernels
    read the same weight values from the blocks (kernels/cpu_blocks.py) and sum in another order."""
    if oracle:
        request.getfixturevalue("oracle_ops")
    src, _ = write_tiny_gguf(tmp_path / "t.gguf", types=QUANTIZED)
    convert_gguf(src, tmp_path / "compact.rad", None, compact=True)
    with RadFile.open(tmp_path / "compact.rad") as rad:
        model = load_model(rad)
        attn = model.layers[0].attn  # q4_1 q, q4_0 k, q8_0 v: a RowStack the block kernels read part by part
        assert [p.fmt for p in attn.wqkv.parts] == ["q4_1", "q4_0", "q8_0"] and attn.wo.fmt == "q4_0"
        cache = KVCache.allocate(rad.model, num_blocks=8, block_size=16, num_state_slots=2, dtype=torch.float32)
        compare_prefill_rows(model, cache, hf_model(src), [[5, 9, 40, 41, 200, 7], [3, 100, 250]], tol=1e-5)


def test_compact_refuses_a_cast(tmp_path):
    src, _ = write_tiny_gguf(tmp_path / "t.gguf", types=QUANTIZED)
    with pytest.raises(ValueError, match="cannot be combined"):
        convert_gguf(src, tmp_path / "x.rad", "bf16", compact=True)


def test_a_tied_compact_table_is_one_dense_copy_on_a_card_as_the_receipt_charges(tmp_path):
    """Off the CPU (the meta device stands in for the card) the tied q8_0 table is made dense once, read by
    the lookups and the lm_head, on the card whatever --embedding-placement says; the other compact
    matrices keep their bytes: the placed bytes are the CUDA receipt's weights."""
    from radianced.budget import plan
    from radianced.card import Card
    from radianced.config import Config
    from radianced.sizing import ModelFacts

    src, _ = write_tiny_gguf(tmp_path / "t.gguf", types=QUANTIZED)
    convert_gguf(src, tmp_path / "compact.rad", None, compact=True)
    with RadFile.open(tmp_path / "compact.rad") as rad:
        model = load_model(rad, device="meta", embedding_placement="ram")
        receipt = plan(Card.from_mib(1024, cuda=True), ModelFacts.from_header(rad.header),
                       Config(embedding_placement="ram"))
        vocab, hidden = rad.model.vocab_size, rad.model.hidden_size
    assert rad.model.tie_word_embeddings and model.lm_head.weight is model.embed.weight
    assert model.embed.weight.device.type == "meta" and model.embed.weight.shape == (vocab, hidden)
    assert isinstance(model.layers[0].attn.wo, CompactWeight) and model.layers[0].attn.wo.device.type == "meta"
    assert (model.placed.device_bytes, model.placed.host_bytes) == (receipt.weights_bytes, 0)
    assert {p.name: p.bytes for p in receipt.weights}["lm_head"] == vocab * hidden * 4
