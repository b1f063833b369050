"""Hugging Face folders to compact `.rad`s: block-scaled FP8 kept as it is, `--quantize` per class.

The FP8 folder's oracle is transformers' own load, which on the CPU dequantizes the FP8
weights to bf16 and runs in bf16: logits agree within bf16's tolerance. Our fp32
dequantization of the kept bytes is checked exactly: every matrix equals `w.float() *
scale_inv` of the folder's own tensors.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from radianced.kernels.compact import CompactWeight
from radianced.kernels.dequant import dequantize_fp8_b128
from radianced.kv.cache import KVCache
from radianced.model.convert import ConvertError, convert
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from radianced.model.quantize import quantize
from tests.greedy import greedy_generate
from tests.model.fp8_folder import make_fp8_folder
from tests.oracle import compare_prefill_rows

PROMPTS = [[5, 9, 40, 41, 200, 7, 300, 12], [3, 100, 250]]


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    return make_fp8_folder(tmp_path_factory.mktemp("fp8"))


def test_fp8_folder_keeps_its_fp8_bytes_and_scales(fp8_folder, tmp_path):
    convert(fp8_folder, tmp_path / "m.rad")
    with RadFile.open(tmp_path / "m.rad") as rad, safe_open(fp8_folder / "model.safetensors", "pt") as src:
        assert rad.tensor_entry("model.layers.0.self_attn.q_proj.weight").dtype == "fp8_b128"
        assert rad.tensor_entry("model.embed_tokens.weight").dtype == "bf16"
        assert {e.dtype for e in rad.header.experts} == {"fp8_b128"}
        q = rad.tensor("model.layers.1.self_attn.q_proj.weight")
        name = "model.layers.1.self_attn.q_proj.weight"
        assert torch.equal(q.dequantize(), dequantize_fp8_b128(src.get_tensor(name), src.get_tensor(name + "_scale_inv")))
        gate, up, down = rad.expert(2, 5)
        p = "model.layers.2.mlp.experts.5."
        for got, proj in ((gate, "gate_proj"), (up, "up_proj"), (down, "down_proj")):
            want = dequantize_fp8_b128(src.get_tensor(f"{p}{proj}.weight"), src.get_tensor(f"{p}{proj}.weight_scale_inv"))
            assert isinstance(got, CompactWeight) and torch.equal(got.dequantize(), want)


def test_fp8_folder_matches_transformers_own_load_within_bf16(fp8_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    convert(fp8_folder, tmp_path / "m.rad")
    hf = AutoModelForCausalLM.from_pretrained(fp8_folder).eval()  # dequantized to bf16 on the CPU
    with RadFile.open(tmp_path / "m.rad") as rad:
        model = load_model(rad)
        cache = KVCache.allocate(rad.model, num_blocks=8, block_size=16, num_state_slots=2, dtype=torch.bfloat16)
        assert compare_prefill_rows(model, cache, hf, PROMPTS, tol=3e-2) < 3e-2


@pytest.mark.parametrize("spec,formats", [
    ("experts=int4,layers=fp8", {"experts": "q4_0", "q_proj": "fp8_b128", "embed": "bf16"}),
    ("experts=int8,layers=int8,embeddings=int8", {"experts": "q8_0", "q_proj": "q8_0", "embed": "q8_0"}),
    ("experts=fp8", {"experts": "fp8_b128", "q_proj": "f32", "embed": "f32"}),
])
def test_quantize_requantizes_each_class(tmp_path, spec, formats):
    src = make_tiny("qwen3_moe", tmp_path / "src")
    convert(src, tmp_path / "q.rad", quantize=spec)
    convert(src, tmp_path / "ref.rad")
    with RadFile.open(tmp_path / "q.rad") as rad, RadFile.open(tmp_path / "ref.rad") as ref:
        assert {e.dtype for e in rad.header.experts} == {formats["experts"]}
        assert rad.tensor_entry("model.layers.0.self_attn.q_proj.weight").dtype == formats["q_proj"]
        embed = rad.tensor_entry("model.embed_tokens.weight").dtype
        assert embed == (formats["embed"] if formats["embed"] != "bf16" else "f32")
        assert rad.tensor_entry("model.layers.0.mlp.gate.weight").dtype == "f32"  # the router stays
        assert rad.tensor_entry("model.norm.weight").dtype == "f32"
        # the stored blocks are exactly round-to-nearest of the source (gguf's / HF's rules, quantize.py)
        name = "model.layers.0.self_attn.q_proj.weight"
        got = rad.tensor(name)
        if isinstance(got, CompactWeight):
            assert torch.equal(got.data.reshape(-1), quantize(ref.tensor(name), got.fmt).data.reshape(-1))
        gate, up, down = rad.expert(1, 3)
        for piece, want in zip((gate, up, down), ref.expert(1, 3)):
            assert torch.equal(piece.data.reshape(-1), quantize(want, piece.fmt).data.reshape(-1))
        model = load_model(rad)
        cache = KVCache.allocate(rad.model, num_blocks=8, block_size=16, num_state_slots=2, dtype=torch.float32)
        logits = greedy_generate(model, cache, PROMPTS[:1], 4).logits
        assert all(bool(step.isfinite().all()) for step in logits)


def test_quantize_refuses_a_bad_spec(tmp_path):
    src = make_tiny("llama", tmp_path / "src")
    with pytest.raises(ConvertError, match="CLASS=SCHEME"):
        convert(src, tmp_path / "x.rad", quantize="experts=int3")
    assert not (tmp_path / "x.rad").exists()


def test_radiancectl_convert_wires_compact_and_quantize(tmp_path, capsys):
    from radianced.ctl import main
    from tests.model.test_gguf_qwen3moe import write_qwen3moe_gguf

    src = make_tiny("qwen3_moe", tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "q.rad"), "--quantize", "experts=int4,layers=fp8"]) == 0
    gguf_src = write_qwen3moe_gguf(tmp_path / "m.gguf")
    assert main(["convert", str(gguf_src), str(tmp_path / "c.rad"), "--compact"]) == 0
    with RadFile.open(tmp_path / "q.rad") as q, RadFile.open(tmp_path / "c.rad") as c:
        assert {e.dtype for e in q.header.experts} == {"q4_0"}
        assert q.tensor_entry("model.layers.0.self_attn.o_proj.weight").dtype == "fp8_b128"
        assert c.expert_entry(0, 0).dtype == "q8_0"
    assert main(["convert", str(src), str(tmp_path / "x.rad"), "--quantize", "weights=int4"]) == 1
    assert "CLASS=SCHEME" in capsys.readouterr().err
