"""GGUF (llama architecture) -> `.rad`.

llama.cpp's file differs from a Hugging Face checkpoint in four ways, each undone here:

1. Names: `blk.N.attn_q.weight` for `model.layers.N.self_attn.q_proj.weight` (`hf_name`).
2. Storage: block-quantized tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) are kept as
   they are with `compact` (their bytes copied, the format in the header: the layouts
   are ggml's, `kernels/formats.py`), else dequantized to fp32 with
   `gguf.quants.dequantize`; F32 / F16 / BF16 keep their dtype unless one is asked for.
3. Rotary layout: llama.cpp interleaves the two rotary halves of every Q and K head
   (`LlamaModel.permute` in convert_hf_to_gguf.py); `unpermute_qk` restores HF's
   rotate-half row order, the same reverse transformers' GGUF loader applies.
4. Config and tokenizer live in metadata: `model_config` builds the `ModelConfig`,
   `gguf_tokenizer` a `tokenizers.Tokenizer` (byte-level BPE, `tokenizer.ggml.model`
   "gpt2") that encodes like transformers' tokenizer from the same file.

Tensors stream one at a time (read from the memory map, dequantize, write, drop), so
peak memory is one fp32 tensor, not the model (one tensor's bytes with `compact`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from radianced.kernels.compact import CompactWeight
from radianced.model.config import ModelConfig, UnsupportedModel
from radianced.model.rad_writer import RadWriter

ARCHITECTURE = "llama"

Q = gguf.GGMLQuantizationType
# ggml types kept as they are (unless a dtype is asked for) and the block types we dequantize.
FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
QUANT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ATTENTION_BIASES = {"attn_q", "attn_k", "attn_v", "attn_output"}
_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<part>\w+)\.(?P<kind>weight|bias)")


def convert_gguf(src: Path, dst: Path, dtype: str | None = None, compact: bool = False) -> None:
    """Write the llama GGUF `src` as the `.rad` `dst`.

    `dtype`: None keeps F32/F16/BF16 tensors as stored and dequantizes block types to
    fp32; "bf16" or "fp32" casts every tensor to it. `compact` (dtype None only) keeps
    the block types' bytes as they are instead. Refuses (`UnsupportedModel`, naming
    the culprit) another architecture, a tensor type other than F32/F16/BF16/Q8_0/Q4_0/
    Q4_1/Q4_K/Q5_K/Q6_K, a tensor it cannot name, rope scaling, experts or a non-"gpt2"
    tokenizer, all before `dst` is touched. On any error no file is left at `dst`
    (RadWriter writes a temporary file and renames it on success).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of: {', '.join(DTYPES)} (or None to keep the file's)")
    if compact and dtype is not None:
        raise ValueError(f"dtype {dtype!r} casts every tensor; it cannot be combined with keeping blocks compact")
    src = Path(src)
    reader = gguf.GGUFReader(src)
    meta = read_metadata(reader)
    cfg = model_config(meta, reader.tensors)
    check_tensors(reader)
    tokenizer = gguf_tokenizer(meta)
    with RadWriter(
        Path(dst),
        model=cfg,
        tokenizer_json=tokenizer.to_str(),
        chat_template=meta.get("tokenizer.chat_template"),
        generation={},
        source=str(src),
    ) as writer:
        for t in reader.tensors:
            if compact and t.tensor_type in QUANT_TYPES:
                writer.add_compact(hf_name(t.name), load_blocks(t, cfg))
            else:
                writer.add_tensor(hf_name(t.name), load_tensor(t, cfg, DTYPES.get(dtype)))


# -- metadata -----------------------------------------------------------------


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key-value of the file as plain Python (str, int, float, bool, list)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _f32(x: float) -> float:
    # GGUF stores these as float32 (1e-5 arrives as 9.999999747e-06): keep the shortest decimal
    # that rounds to the same float32, i.e. the value the source config wrote.
    return float(str(np.float32(x)))


def model_config(meta: dict[str, Any], tensors: list) -> ModelConfig:
    """The `ModelConfig` a llama GGUF describes; refuses what radianced's llama cannot run."""
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported; the GGUF converter reads {ARCHITECTURE!r} only "
            f"(convert other models from their Hugging Face folder)"
        )
    p = f"{ARCHITECTURE}."

    def need(key: str):
        if key not in meta:
            raise UnsupportedModel(f"the GGUF metadata lacks {key!r}; the file is incomplete or not a llama model")
        return meta[key]

    if meta.get(p + "expert_count", 0):
        raise UnsupportedModel(
            "this llama GGUF has routed experts (Mixtral style), which radianced's llama does not run"
        )
    scaling = meta.get(p + "rope.scaling.type", "none")
    names = {t.name for t in tensors}
    if scaling not in ("none", "") or "rope_freqs.weight" in names:
        what = scaling if scaling not in ("none", "") else "llama3 rope_freqs.weight"
        raise UnsupportedModel(f"rope scaling ({what}) is not supported yet; only plain RoPE")
    hidden = need(p + "embedding_length")
    heads = need(p + "attention.head_count")
    head_dim = meta.get(p + "attention.key_length") or hidden // heads
    rotary = meta.get(p + "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise UnsupportedModel(f"partial rotary ({rotary} of {head_dim} dims per head) is not supported for llama")
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise UnsupportedModel("the GGUF has no token_embd.weight tensor")
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.get(f"tokenizer.ggml.{key}")
        if token is not None and token not in eos:
            eos.append(int(token))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        family="llama",
        vocab_size=int(embed.shape[1]),  # ggml order: [hidden, vocab]
        hidden_size=hidden,
        num_hidden_layers=need(p + "block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta.get(p + "attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta.get(p + "rope.freq_base", 10000.0)),
        max_position_embeddings=meta.get(p + "context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=any(n.endswith(".bias") for n in names),
        intermediate_size=need(p + "feed_forward_length"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
    )


# -- tensors ------------------------------------------------------------------


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama GGUF tensor; `UnsupportedModel` for one we cannot place."""
    m = _NAME.fullmatch(gguf_name)
    part = m and m["part"]
    if m and m["layer"] is None and part in _GLOBAL_NAMES and m["kind"] == "weight":
        return f"{_GLOBAL_NAMES[part]}.weight"
    if m and m["layer"] is not None and part in _BLOCK_NAMES:
        if m["kind"] == "weight" or part in _ATTENTION_BIASES:
            return f"model.layers.{m['layer']}.{_BLOCK_NAMES[part]}.{m['kind']}"
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no place in a llama model; cannot convert this file")


def check_tensors(reader: gguf.GGUFReader) -> None:
    """Refuse, before writing anything, a tensor of a type we do not read or a name we cannot map."""
    for t in reader.tensors:
        if t.tensor_type not in FLOAT_TYPES and t.tensor_type not in QUANT_TYPES:
            supported = ", ".join(q.name for q in (*FLOAT_TYPES, *QUANT_TYPES))
            raise UnsupportedModel(
                f"GGUF tensor {t.name!r} is stored as {t.tensor_type.name}, which is not supported; "
                f"supported types: {supported} (re-quantize the file, e.g. to Q8_0)"
            )
        hf_name(t.name)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleave on a Q or K projection (weight or bias).

    w: [n_head * head_dim, ...]. llama.cpp stores each head's rows as pairs
    (x0, x_{d/2}), (x1, x_{d/2+1}), ...; HF keeps the halves apart (rotate-half).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_tensor(t, cfg: ModelConfig, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One GGUF tensor as an HF-layout torch tensor, in HF shape (rows, cols)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dim first
    if t.tensor_type in QUANT_TYPES:
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping dominates dequantize otherwise
        x = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))
    elif t.tensor_type == Q.BF16:  # numpy has no bfloat16: the reader hands raw bytes
        x = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    else:
        x = torch.from_numpy(np.array(t.data))
    x = x.reshape(shape)
    if ".attn_q." in t.name:
        x = unpermute_qk(x, cfg.num_attention_heads)
    elif ".attn_k." in t.name:
        x = unpermute_qk(x, cfg.num_key_value_heads)
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    return x.contiguous()


def load_blocks(t, cfg: ModelConfig) -> CompactWeight:
    """One block-quantized GGUF matrix, its bytes untouched, in HF row order (Q/K rows un-permuted:
    each row's blocks move whole, so the values are those `load_tensor` would dequantize)."""
    rows, cols = (int(d) for d in reversed(t.shape.tolist()))
    data = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(rows, -1)
    if ".attn_q." in t.name:
        data = unpermute_qk(data, cfg.num_attention_heads)
    elif ".attn_k." in t.name:
        data = unpermute_qk(data, cfg.num_key_value_heads)
    return CompactWeight(t.tensor_type.name.lower(), (rows, cols), data.contiguous())


# -- tokenizer ----------------------------------------------------------------

# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE (llama-vocab.cpp).
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (every byte-level BPE vocab is spelled in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_PRE:  # single digits first, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    known = ", ".join((*_GPT2_PRE, *_DIGITS_PRE, *_LLAMA3_PRE))
    raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} is not supported; known: {known}")


def gguf_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """A `tokenizers.Tokenizer` from `tokenizer.ggml.*`: byte-level BPE ("gpt2" files).

    Control tokens (type 3, `<|im_start|>`) become special added tokens and user-defined
    ones (type 4) plain added tokens, so both are matched whole in text; the post-processor
    adds BOS / EOS as `add_bos_token` / `add_eos_token` say.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(
            f"GGUF tokenizer model {kind!r} is not supported; the converter reads byte-level BPE ('gpt2') vocabularies"
        )
    if "tokenizer.ggml.tokens" not in meta:
        raise UnsupportedModel("the GGUF has no tokenizer.ggml.tokens; radianced needs the vocabulary in the file")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (a stray literal space) is respelled from its UTF-8 bytes.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the alphabet is a llama.cpp mislabel; adding it would grow the vocab.
    tok.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == _CONTROL and set(t) <= alphabet
    ])
    tok.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types)
        if ty == _USER_DEFINED and t in vocab
    ])

    def special(key: str) -> tuple[str, int] | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else (tokens[i], int(i))

    bos, eos = special("bos"), special("eos")
    single, pair, specials = ["$A:0"], ["$A:0", "$B:1"], []
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        single, pair = [f"{bos[0]}:0", *single], [f"{bos[0]}:0", "$A:0", f"{bos[0]}:1", "$B:1"]
        specials.append(bos)
    if meta.get("tokenizer.ggml.add_eos_token", False) and eos is not None:
        single = [*single, f"{eos[0]}:0"]
        pair = [*pair[: len(pair) // 2], f"{eos[0]}:0", *pair[len(pair) // 2 :], f"{eos[0]}:1"]
        specials.append(eos)
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(specials))
    )
    return tok
