"""A tiny Qwen3-Next GGUF written from a tiny Hugging Face folder's tensors the way llama.cpp's converter
writes them (`Qwen3NextModel.modify_tensors`: its names, q/k/v/z split, norms + 1, -exp(A_log), conv
squeezed, experts stacked). transformers cannot load it, so the oracle is our conversion of the folder
itself: both `.rad`s hold the same tensors and give the same logits."""

from __future__ import annotations

import gguf
import pytest
import torch
from safetensors.torch import load_file

from radianced.kernels.compact import CompactWeight
from radianced.model.convert import convert
from radianced.model.gguf import convert_gguf
from radianced.model.loader import load_model
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from tests.model.test_gguf import add_tiny_tokenizer

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 9, 40, 41, 200, 7, 100, 12, 33, 71, 2, 90], [3, 100, 250]]
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def _llama_cpp_tensors(folder, cfg: dict) -> dict[str, torch.Tensor]:
    """The folder's tensors as llama.cpp's Qwen3NextModel would write them (GGUF name -> tensor)."""
    src = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    out = {"token_embd.weight": src["model.embed_tokens.weight"], "output.weight": src["lm_head.weight"],
           "output_norm.weight": src["model.norm.weight"] + 1}
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    vz = cfg["linear_num_value_heads"] // nk * cfg["linear_value_head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in _BLOCK.items():
            if p + hf not in src:
                continue
            t = src[p + hf]
            if hf.endswith("norm.weight") and not hf.startswith("linear_attn."):
                t = t + 1
            elif hf == "linear_attn.A_log":
                t = -torch.exp(t)
            elif hf == "linear_attn.conv1d.weight":
                t = t.squeeze()
            elif hf == "mlp.shared_expert_gate.weight":
                t = t.reshape(-1)
            out[b + gg] = t
        if p + "linear_attn.in_proj_qkvz.weight" in src:  # [q, k, v, z] per key head -> qkv by kind, z apart
            w = src[p + "linear_attn.in_proj_qkvz.weight"].T.reshape(-1, nk, 2 * dk + 2 * vz)
            q, k, v, z = w.split([dk, dk, vz, vz], dim=-1)
            out[b + "attn_qkv.weight"] = torch.cat([x.reshape(w.shape[0], -1) for x in (q, k, v)], -1).T.contiguous()
            out[b + "attn_gate.weight"] = z.reshape(w.shape[0], -1).T.contiguous()
        e = f"{p}mlp.experts."
        for proj, stack in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            out[f"{b}{stack}.weight"] = torch.stack([src[f"{e}{x}.{proj}.weight"] for x in range(cfg["num_experts"])])
    return out


def write_qwen3next_gguf(path, folder, quantized: dict[str, int] | None = None):
    import json

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "qwen3next")
    layers = cfg["num_hidden_layers"]
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(2)  # the tiny folder's layer_types: linear, full, linear, full
    add_tiny_tokenizer(w, "qwen2")
    for name, t in _llama_cpp_tensors(folder, cfg).items():
        qtype = next((q for suffix, q in (quantized or {}).items() if name.endswith(suffix)), None)
        if qtype is None:
            w.add_tensor(name, t.float().numpy())
        else:
            w.add_tensor(name, gguf.quants.quantize(t.float().numpy(), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _prefill_logits(path) -> torch.Tensor:
    from radianced.model.quality import window_logits

    with RadFile.open(path) as rad:
        return torch.cat([window_logits(load_model(rad), rad.model, [p]) for p in PROMPTS])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny("qwen3_next", tmp_path_factory.mktemp("q3next"))


def test_the_gguf_converts_to_the_folders_tensors_and_logits(folder, tmp_path):
    convert(folder, tmp_path / "hf.rad")
    convert_gguf(write_qwen3next_gguf(tmp_path / "n.gguf", folder), tmp_path / "gguf.rad", None)
    with RadFile.open(tmp_path / "hf.rad") as hf, RadFile.open(tmp_path / "gguf.rad") as gg:
        assert gg.model.layer_types == hf.model.layer_types and gg.model.family == "qwen3_next"
        for field in ("linear_num_value_heads", "linear_value_head_dim", "partial_rotary_factor",
                      "shared_expert_intermediate_size", "moe_intermediate_size", "head_dim", "attention_bias",
                      "num_experts", "num_experts_per_tok", "norm_topk_prob", "rms_norm_eps", "rope_theta",
                      "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads"):
            assert getattr(gg.model, field) == getattr(hf.model, field), field
        assert set(gg.tensor_names()) == set(hf.tensor_names())
        for name in hf.tensor_names():
            want, got = hf.tensor(name), gg.tensor(name)
            if name.endswith("A_log"):  # log(-(-exp(a))): an fp32 rounding away at most
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            elif name.endswith("norm.weight") and ".linear_attn." not in name:  # zero-centred: the model uses 1 + w
                assert torch.equal(1 + got, 1 + want), name
            else:
                assert torch.equal(got, want), name
        for got, want in zip(gg.expert(2, 5), hf.expert(2, 5)):
            assert torch.equal(got, want)
    ours, ref = _prefill_logits(tmp_path / "gguf.rad"), _prefill_logits(tmp_path / "hf.rad")
    err = float(((ours - ref).abs().max(-1).values / ref.abs().max(-1).values).max())
    assert err < 1e-5, err


def test_compact_blocks_survive_the_qkvz_join(folder, tmp_path, oracle_ops):
    quantized = {"attn_qkv.weight": Q.Q8_0, "attn_gate.weight": Q.Q8_0, "ssm_out.weight": Q.Q4_1,
                 "_exps.weight": Q.Q4_0, "attn_q.weight": Q.Q8_0}
    src = write_qwen3next_gguf(tmp_path / "q.gguf", folder, quantized)
    convert_gguf(src, tmp_path / "c.rad", None, compact=True)
    convert_gguf(src, tmp_path / "f.rad", None)
    with RadFile.open(tmp_path / "c.rad") as c, RadFile.open(tmp_path / "f.rad") as f:
        qkvz = c.tensor("model.layers.0.linear_attn.in_proj_qkvz.weight")
        assert isinstance(qkvz, CompactWeight) and qkvz.fmt == "q8_0"
        assert torch.equal(qkvz.dequantize(), f.tensor("model.layers.0.linear_attn.in_proj_qkvz.weight"))
        assert c.expert_entry(0, 0).dtype == "q4_0"
    ours, ref = _prefill_logits(tmp_path / "c.rad"), _prefill_logits(tmp_path / "f.rad")
    err = float(((ours - ref).abs().max(-1).values / ref.abs().max(-1).values).max())
    assert err < 1e-5, err
