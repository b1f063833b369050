"""The tiny checkpoints every oracle test builds on are real, loadable and not degenerate."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from radianced.model.config import ModelConfig
from radianced.model.tiny import (
    DEFAULT_LAYER_TYPES, ENDOFTEXT_ID, FAMILIES, IM_END_ID, IM_START_ID, VOCAB_SIZE, make_tiny,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> checkpoint dir, each built once for the module."""
    return {f: make_tiny(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


def _weights(path):
    return load_file(path / "model.safetensors")


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _as_loaded(written: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """The file's per-expert tensors (Hub layout) as transformers holds them in memory.

    On disk: `experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I].
    In memory: `experts.gate_up_proj` [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I].
    """
    out, experts = {}, {}
    for name, t in written.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
        assert out[f"{prefix}.gate_up_proj"].shape[1] == 2 * inter
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_exactly_the_written_weights(tiny, family):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[family])
    written = _as_loaded(_weights(tiny[family]), model.config.to_dict().get("moe_intermediate_size", 0))
    loaded = model.state_dict()
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in written
        written["lm_head.weight"] = written["model.embed_tokens.weight"]
    assert set(written) == set(loaded)
    for name, tensor in written.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_finite_and_far_from_uniform(tiny, family):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[family])
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.inference_mode():
        logits = model(ids).logits[0]  # [T, V]
    assert logits.shape == (ids.shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert logits.std(-1).min() > 0.5
    # Different positions predict different things (the context matters).
    assert len(set(logits.argmax(-1).tolist())) > 3


@pytest.mark.parametrize("family", FAMILIES)
def test_norm_weights_are_not_identity(tiny, family):
    norms = {n: w for n, w in _weights(tiny[family]).items() if "norm" in n}
    assert norms
    for name, w in norms.items():
        gated = family == "qwen3_next" and ".linear_attn.norm." in name
        zero_centred = family == "qwen3_next" and not gated
        centre = 0.0 if zero_centred else 1.0
        spread = (w - centre).abs()
        assert spread.mean() > 0.03 and spread.max() < 0.6, name


def test_qwen3_next_has_both_layer_kinds_and_gated_norms(tiny):
    cfg = json.loads((tiny["qwen3_next"] / "config.json").read_text())
    assert cfg["layer_types"] == list(DEFAULT_LAYER_TYPES)
    names = _weights(tiny["qwen3_next"]).keys()
    for i, kind in enumerate(DEFAULT_LAYER_TYPES):
        mixer = "linear_attn.in_proj_qkvz" if kind == "linear_attention" else "self_attn.q_proj"
        assert f"model.layers.{i}.{mixer}.weight" in names
        assert f"model.layers.{i}.mlp.shared_expert_gate.weight" in names


def test_deltanet_decays_neither_erase_nor_freeze_the_state(tiny):
    w = _weights(tiny["qwen3_next"])
    for i, kind in enumerate(DEFAULT_LAYER_TYPES):
        if kind != "linear_attention":
            continue
        a_log, dt_bias = w[f"model.layers.{i}.linear_attn.A_log"], w[f"model.layers.{i}.linear_attn.dt_bias"]
        decay = torch.exp(-a_log.exp() * F.softplus(dt_bias))  # exp(g) for a = 0
        assert (decay > 0.3).all() and (decay < 0.999).all()
        assert dt_bias.std() > 0.1 and a_log.std() > 0.1


def test_layer_types_override_sets_the_pattern_and_layer_count(tmp_path):
    pattern = ["full_attention", "linear_attention", "linear_attention"]
    out = make_tiny("qwen3_next", tmp_path, layer_types=pattern)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 3
    assert [hasattr(layer, "linear_attn") for layer in model.model.layers] == [False, True, True]
    assert ModelConfig.from_hf(json.loads((out / "config.json").read_text())).linear_attention_layers == (1, 2)


def test_attention_bias_override_gives_nonzero_biases(tmp_path):
    w = _weights(make_tiny("qwen3_moe", tmp_path, attention_bias=True))
    biases = {n: t for n, t in w.items() if n.endswith(".bias")}
    assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(t.abs().mean() > 0.03 for t in biases.values())


def test_same_seed_writes_identical_files_and_another_seed_does_not(tmp_path, tiny):
    again = make_tiny("qwen3_next", tmp_path / "again", seed=0)
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (again / f).read_bytes() == (tiny["qwen3_next"] / f).read_bytes(), f
    other = _weights(make_tiny("qwen3_next", tmp_path / "other", seed=1))
    assert not torch.equal(other["model.embed_tokens.weight"], _weights(again)["model.embed_tokens.weight"])


def test_make_tiny_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny("llama", tmp_path)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_config_reads_the_tiny_config(tiny, family):
    hf = transformers.AutoConfig.from_pretrained(tiny[family])
    cfg = ModelConfig.from_hf(json.loads((tiny[family] / "config.json").read_text()))
    assert cfg.family == family
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (VOCAB_SIZE, 64, hf.num_hidden_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    if family != "llama":
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (hf.num_experts, hf.num_experts_per_tok)
        assert cfg.moe_layers == tuple(range(hf.num_hidden_layers))
    if family == "qwen3_next":
        assert cfg.rotary_dim == 4 and cfg.shared_expert_intermediate_size == 32
        assert cfg.layer_types == tuple(hf.layer_types)


def test_tokenizer_is_a_trained_bpe_with_chatml(tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["qwen3_next"])
    assert len(tok) == VOCAB_SIZE
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (IM_END_ID, ENDOFTEXT_ID, ENDOFTEXT_ID)
    text = "What is the capital of France? Paris, 2024 — ünïcode ✓"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned
    assert len(tok(" the").input_ids) == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(chat).input_ids
    assert chat_ids[0] == IM_START_ID and chat_ids.count(IM_END_ID) == 1
    gen = json.loads((tiny["qwen3_next"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [IM_END_ID, ENDOFTEXT_ID]


def test_cli_writes_a_checkpoint(tmp_path, capsys):
    from tools.make_tiny import main

    assert main(["qwen3_next", str(tmp_path), "--seed", "2", "--layer-types", "full_attention", "linear_attention",
                 "--set", "num_experts_per_tok=2"]) == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["layer_types"] == ["full_attention", "linear_attention"] and cfg["num_experts_per_tok"] == 2
    assert capsys.readouterr().out.strip() == str(tmp_path)
