"""A tiny qwen3moe GGUF, written with the gguf package the way llama.cpp names and stacks it, against
transformers' load of the same file: routed experts stored as Q8_0, Q4_0 and Q4_1 (one type per layer),
kept compact or dequantized."""

from __future__ import annotations

import gguf
import pytest
import torch

from radianced.kernels.compact import CompactWeight
from radianced.kv.cache import KVCache
from radianced.model.config import UnsupportedModel
from radianced.model.gguf import convert_gguf
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from tests.model.test_gguf import add_tiny_tokenizer
from tests.oracle import compare_prefill_rows

Q = gguf.GGMLQuantizationType
H, HEADS, KV, D, E, K, INTER = 64, 4, 2, 16, 4, 2, 32
EXPERT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1)  # layer i's experts
PROMPTS = [[5, 9, 40, 41, 200, 7, 100, 12, 33], [3, 100, 250]]


def _weights(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "output.weight": (vocab, H)}
    for i in range(len(EXPERT_TYPES)):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (H,), b + "ffn_norm.weight": (H,), b + "attn_q.weight": (HEADS * D, H),
                   b + "attn_k.weight": (KV * D, H), b + "attn_v.weight": (KV * D, H),
                   b + "attn_output.weight": (H, HEADS * D), b + "attn_q_norm.weight": (D,),
                   b + "attn_k_norm.weight": (D,), b + "ffn_gate_inp.weight": (E, H),
                   b + "ffn_gate_exps.weight": (E, INTER, H), b + "ffn_up_exps.weight": (E, INTER, H),
                   b + "ffn_down_exps.weight": (E, H, INTER)}
    return {n: torch.randn(s, generator=g) * (0.15 if len(s) > 1 else 0.1) + (1.0 if len(s) == 1 else 0.0)
            for n, s in shapes.items()}


def write_qwen3moe_gguf(path, stack_types=EXPERT_TYPES, down_type=None, layer_types=None):
    """The tiny qwen3moe GGUF: layer i's expert stacks in `stack_types[i]` (ffn_down_exps in `down_type` if
    given), the other tensors in F32 unless `layer_types` names a type for them (by the name after
    `blk.N.`, e.g. "attn_q.weight", or the whole name: "token_embd.weight", "output.weight")."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(len(stack_types))
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(INTER)
    vocab = add_tiny_tokenizer(w, "qwen2")
    for name, t in _weights(vocab).items():
        qtype = (layer_types or {}).get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
        if "_exps" in name:
            layer = int(name.split(".")[1])
            qtype = down_type if down_type is not None and "down" in name else stack_types[layer]
        if qtype is None or qtype == Q.F32:
            w.add_tensor(name, t.numpy())
        else:
            w.add_tensor(name, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def qwen3moe_gguf(tmp_path_factory):
    return write_qwen3moe_gguf(tmp_path_factory.mktemp("q3moe") / "tiny-qwen3moe.gguf")


@pytest.fixture(scope="module")
def hf(qwen3moe_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3moe_gguf.parent, gguf_file=qwen3moe_gguf.name,
                                                dtype=torch.float32, moe_intermediate_size=INTER).eval()


@pytest.mark.parametrize("compact", [True, False])
def test_qwen3moe_gguf_matches_transformers(qwen3moe_gguf, hf, tmp_path, compact):
    convert_gguf(qwen3moe_gguf, tmp_path / "m.rad", None, compact=compact)
    with RadFile.open(tmp_path / "m.rad") as rad:
        assert rad.model.family == "qwen3_moe" and rad.model.moe_intermediate_size == INTER
        formats = [rad.expert_entry(i, 0).dtype for i in range(3)]
        assert formats == (["q8_0", "q4_0", "q4_1"] if compact else ["f32"] * 3)
        model = load_model(rad)
        cache = KVCache.allocate(rad.model, num_blocks=8, block_size=16, num_state_slots=2, dtype=torch.float32)
        compare_prefill_rows(model, cache, hf, PROMPTS, tol=1e-5)


def test_each_compact_expert_is_its_slice_of_the_stacks(qwen3moe_gguf, tmp_path):
    convert_gguf(qwen3moe_gguf, tmp_path / "c.rad", None, compact=True)
    convert_gguf(qwen3moe_gguf, tmp_path / "f.rad", None)
    with RadFile.open(tmp_path / "c.rad") as c, RadFile.open(tmp_path / "f.rad") as f:
        for layer in range(3):
            for e in range(E):
                for got, want in zip(c.expert(layer, e), f.expert(layer, e)):
                    assert isinstance(got, CompactWeight) and torch.equal(got.dequantize(), want)


def test_a_down_stack_in_another_block_type_stays_compact_beside_gate_and_up(tmp_path):
    """A Q4_K_M file stores ffn_down_exps in another type than gate/up: the extent records both formats."""
    from transformers import AutoModelForCausalLM

    src = write_qwen3moe_gguf(tmp_path / "mixed.gguf", down_type=Q.Q8_0)
    convert_gguf(src, tmp_path / "c.rad", None, compact=True)
    convert_gguf(src, tmp_path / "f.rad", None)
    with RadFile.open(tmp_path / "c.rad") as c, RadFile.open(tmp_path / "f.rad") as f:
        assert [c.expert_entry(i, 0).dtype for i in range(3)] == ["q8_0", "q4_0+q8_0", "q4_1+q8_0"]
        gate, up, down = c.expert(2, 1)
        assert (gate.fmt, up.fmt, down.fmt) == ("q4_1", "q4_1", "q8_0")
        for got, want in zip(c.expert(2, 1), f.expert(2, 1)):
            assert torch.equal(got.dequantize(), want)
        hf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32,
                                                  moe_intermediate_size=INTER).eval()
        cache = KVCache.allocate(c.model, num_blocks=8, block_size=16, num_state_slots=2, dtype=torch.float32)
        compare_prefill_rows(load_model(c), cache, hf, PROMPTS, tol=1e-5)


def test_compact_refuses_a_float_down_stack_beside_quantized_gate_and_up(tmp_path):
    src = write_qwen3moe_gguf(tmp_path / "mixed.gguf", down_type=Q.F32)
    with pytest.raises(UnsupportedModel, match="expert stacks are stored as"):
        convert_gguf(src, tmp_path / "m.rad", None, compact=True)
    convert_gguf(src, tmp_path / "m.rad", None)  # dequantized, they convert


def test_quantize_requantizes_a_gguf_from_its_dequantized_values(tmp_path):
    """Mixed stack types are fine once requantized: every expert becomes q4_0 of the file's values."""
    from radianced.model.quantize import quantize

    src = write_qwen3moe_gguf(tmp_path / "mixed.gguf", down_type=Q.Q8_0)
    convert_gguf(src, tmp_path / "q.rad", None, formats={"experts": "q4_0", "layers": "fp8_b128"})
    convert_gguf(src, tmp_path / "f.rad", None)
    with RadFile.open(tmp_path / "q.rad") as q, RadFile.open(tmp_path / "f.rad") as f:
        assert {e.dtype for e in q.header.experts} == {"q4_0"}
        assert q.tensor_entry("model.layers.0.self_attn.q_proj.weight").dtype == "fp8_b128"
        assert q.tensor_entry("model.layers.0.mlp.gate.weight").dtype == "f32"  # the router stays
        for got, want in zip(q.expert(1, 2), f.expert(1, 2)):
            assert torch.equal(got.data.reshape(-1), quantize(want, "q4_0").data.reshape(-1))
