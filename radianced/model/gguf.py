"""GGUF (llama, qwen3moe and qwen3next architectures) -> `.rad`.

llama.cpp's file differs from a Hugging Face checkpoint in four ways, each undone here:

1. Names: `blk.N.attn_q.weight` for `model.layers.N.self_attn.q_proj.weight` (`hf_name`);
   qwen3moe's and qwen3next's routed experts come stacked per layer
   (`blk.N.ffn_gate_exps.weight` [E, I, H], `ffn_up_exps`, `ffn_down_exps` [E, H, I])
   and become one extent per expert (`RadWriter.add_expert`), their slices of the
   three stacks. What llama.cpp changes in a Qwen3-Next besides names (the q/k/v/z
   split, norms stored as 1 + w, -exp(A_log)) is undone by `gguf_qwen3next.py`.
2. Storage: block-quantized tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) are kept as
   they are with `compact` (their bytes copied, the format in the header: the layouts
   are ggml's, `kernels/formats.py`), else dequantized to fp32 with
   `gguf.quants.dequantize`; F32 / F16 / BF16 keep their dtype unless one is asked for.
3. Rotary layout (llama only): llama.cpp interleaves the two rotary halves of every Q
   and K head (`LlamaModel.permute` in convert_hf_to_gguf.py); `unpermute_qk` restores
   HF's rotate-half row order, the same reverse transformers' GGUF loader applies.
   Qwen3's converter does not permute.
4. Config and tokenizer live in metadata: `gguf_config.model_config` builds the
   `ModelConfig`, `gguf_tokenizer.gguf_tokenizer` a `tokenizers.Tokenizer` (byte-level
   BPE, `tokenizer.ggml.model` "gpt2") that encodes like transformers' tokenizer from
   the same file.

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

from radianced.kernels.compact import CompactWeight
from radianced.model.config import ModelConfig, UnsupportedModel
from radianced.model import gguf_qwen3next as qwen3next
from radianced.model.gguf_config import model_config
from radianced.model.gguf_tokenizer import gguf_tokenizer
from radianced.model.quantize import fits, plain_format, quantize
from radianced.model.rad_writer import RadWriter

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
_QWEN3MOE_NAMES = {  # qwen3moe: no dense MLP; q/k norms, the router, the stacked experts
    **{k: v for k, v in _BLOCK_NAMES.items() if not k.startswith("ffn_") or k == "ffn_norm"},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
_EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_ATTENTION_BIASES = {"attn_q", "attn_k", "attn_v", "attn_output"}
_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<part>\w+)(?:\.(?P<kind>weight|bias))?")


def convert_gguf(src: Path, dst: Path, dtype: str | None = None, compact: bool = False,
                 formats: dict[str, str] | None = None) -> None:
    """Write the llama, qwen3moe or qwen3next GGUF `src` as the `.rad` `dst`.

    `dtype`: None keeps F32/F16/BF16 tensors as stored and dequantizes block types to
    fp32; "bf16" or "fp32" casts every tensor to it. `compact` (dtype None only) keeps
    the block types' bytes as they are instead. `formats` (class -> compact format,
    `quantize.parse_quantize`) requantizes those classes from the file's values (block
    types dequantized first) and keeps or dequantizes the rest as above. Refuses (`UnsupportedModel`, naming
    the culprit) another architecture, a tensor type other than F32/F16/BF16/Q8_0/Q4_0/
    Q4_1/Q4_K/Q5_K/Q6_K, a tensor it cannot name, rope scaling, llama experts, compact
    experts whose three stacks differ in type, or a non-"gpt2" tokenizer, all before
    `dst` is touched. On any error no file is left at `dst`
    (RadWriter writes a temporary file and renames it on success).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of: {', '.join(DTYPES)} (or None to keep the file's)")
    if (compact or formats) and dtype is not None:
        raise ValueError(f"dtype {dtype!r} casts every tensor; it cannot be combined with compact or requantized ones")
    src = Path(src)
    reader = gguf.GGUFReader(src)
    meta = read_metadata(reader)
    cfg = model_config(meta, reader.tensors)
    arch = meta["general.architecture"]
    check_tensors(reader, arch, compact and not (formats or {}).get("experts"))
    tokenizer = gguf_tokenizer(meta)
    with RadWriter(
        Path(dst),
        model=cfg,
        tokenizer_json=tokenizer.to_str(),
        chat_template=meta.get("tokenizer.chat_template"),
        generation={},
        source=str(src),
    ) as writer:
        stacks: dict[int, dict[str, Any]] = {}  # layer -> the expert stacks (or qwen3next's qkv and gate) so far
        for t in reader.tensors:
            m = _NAME.fullmatch(t.name)
            if m["part"] in ("attn_qkv", "attn_gate"):  # qwen3next: in_proj_qkvz comes in two
                pair = stacks.setdefault(-1 - int(m["layer"]), {})
                pair[m["part"]] = _load(t, cfg, compact, DTYPES.get(dtype))
                if len(pair) == 2:
                    qkvz = qwen3next.join_qkvz(pair["attn_qkv"], pair["attn_gate"], cfg)
                    _write(writer, hf_name(t.name, arch), qkvz, formats or {})
                    del stacks[-1 - int(m["layer"])]
                continue
            if m["part"] not in _EXPERT_STACKS:
                value = _load(t, cfg, compact, DTYPES.get(dtype))
                if arch == "qwen3next":
                    value = qwen3next.restore(m["part"], value, cfg)
                _write(writer, hf_name(t.name, arch), value, formats or {})
                continue
            layer = stacks.setdefault(int(m["layer"]), {})
            layer[m["part"]] = t
            if len(layer) == 3:
                _add_experts(writer, int(m["layer"]), stacks.pop(int(m["layer"])), compact, DTYPES.get(dtype),
                             (formats or {}).get("experts"))


# -- metadata -----------------------------------------------------------------


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key-value of the file as plain Python (str, int, float, bool, list)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


# -- tensors ------------------------------------------------------------------


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of architecture `arch` (a qwen3moe expert stack: its
    layer's `mlp.experts.` prefix); `UnsupportedModel` for one we cannot place."""
    m = _NAME.fullmatch(gguf_name)
    part = m and m["part"]
    names = _QWEN3MOE_NAMES if arch == "qwen3moe" else _BLOCK_NAMES
    if m and m["layer"] is None and part in _GLOBAL_NAMES and m["kind"] == "weight":
        return f"{_GLOBAL_NAMES[part]}.weight"
    if m and m["layer"] is not None and arch != "llama" and part in _EXPERT_STACKS and m["kind"] == "weight":
        return f"model.layers.{m['layer']}.mlp.experts."
    if m and m["layer"] is not None and arch == "qwen3next":
        if (name := qwen3next.hf_name(m["layer"], part, m["kind"])) is not None:
            return name
    if m and m["layer"] is not None and part in names:
        if m["kind"] == "weight" or part in _ATTENTION_BIASES:
            return f"model.layers.{m['layer']}.{names[part]}.{m['kind']}"
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no place in a {arch} model; cannot convert this file")


def check_tensors(reader: gguf.GGUFReader, arch: str = "llama", compact: bool = False) -> None:
    """Refuse, before writing anything, a tensor of a type we do not read or a name we cannot map, and
    (with `compact`) a layer whose gate and up stacks differ in type, or whose down stack is a float
    beside quantized gate/up: an extent holds one format, or gate/up and down in two compact ones."""
    stack_types: dict[str, dict[str, Any]] = {}
    for t in reader.tensors:
        if t.tensor_type not in FLOAT_TYPES and t.tensor_type not in QUANT_TYPES:
            supported = ", ".join(q.name for q in (*FLOAT_TYPES, *QUANT_TYPES))
            raise UnsupportedModel(
                f"GGUF tensor {t.name!r} is stored as {t.tensor_type.name}, which is not supported; "
                f"supported types: {supported} (re-quantize the file, e.g. to Q8_0)"
            )
        if hf_name(t.name, arch).endswith(".experts."):
            stack_types.setdefault(t.name.split(".")[1], {})[t.name.split(".")[2]] = t.tensor_type
    for layer, types in stack_types.items():
        gate, up, down = (types.get(s) for s in _EXPERT_STACKS)
        mixed = gate != up or (gate != down and (down not in QUANT_TYPES or gate not in QUANT_TYPES))
        if compact and mixed:
            names = ", ".join(f"{s} {q.name}" for s, q in types.items())
            raise UnsupportedModel(
                f"GGUF layer {layer}'s expert stacks are stored as {names}; a compact expert holds gate and up "
                f"in one format and down in that or another block format (convert without --compact to dequantize)")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleave on a Q or K projection (weight or bias).

    w: [n_head * head_dim, ...]. llama.cpp stores each head's rows as pairs
    (x0, x_{d/2}), (x1, x_{d/2+1}), ...; HF keeps the halves apart (rotate-half).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_tensor(t, cfg: ModelConfig | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One GGUF tensor as an HF-layout torch tensor, in HF shape (rows, cols); Q/K rows un-permuted
    for a llama `cfg`."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dim first
    if t.tensor_type in QUANT_TYPES:
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping dominates dequantize otherwise
        x = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))
    elif t.tensor_type == Q.BF16:  # numpy has no bfloat16: the reader hands raw bytes
        x = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    else:
        x = torch.from_numpy(np.array(t.data))
    x = _unpermute(x.reshape(shape), t.name, cfg)
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    return x.contiguous()


def _load(t, cfg: ModelConfig, compact: bool, dtype: torch.dtype | None) -> torch.Tensor | CompactWeight:
    """One non-expert GGUF tensor in HF layout: its blocks kept (`compact`), else dequantized / cast."""
    return load_blocks(t, cfg) if compact and t.tensor_type in QUANT_TYPES else load_tensor(t, cfg, dtype)


def _write(writer: RadWriter, name: str, value: torch.Tensor | CompactWeight, formats: dict[str, str]) -> None:
    """Write tensor `name`, requantized if `formats` gives its class a format."""
    fmt = plain_format(name, tuple(value.shape), formats)
    if fmt is not None:
        value = quantize(value.dequantize() if isinstance(value, CompactWeight) else value.float(), fmt)
    if isinstance(value, CompactWeight):
        writer.add_compact(name, value)
    else:
        writer.add_tensor(name, value)


def _add_experts(writer: RadWriter, layer: int, stacks: dict[str, Any], compact: bool,
                 dtype: torch.dtype | None, fmt: str | None) -> None:
    """Write the E experts of one layer from its three stacks ([E, I, H], [E, I, H], [E, H, I]),
    requantized to `fmt` when given (and both shapes fit it)."""
    gate, up, down = (stacks[name] for name in _EXPERT_STACKS)
    shapes = [tuple(int(d) for d in reversed(t.shape.tolist()))[1:] for t in (gate, down)]
    requantize = fmt is not None and all(fits(fmt, s) for s in shapes)
    if compact and gate.tensor_type in QUANT_TYPES and not requantize:
        pieces = [_stack_blocks(t) for t in (gate, up, down)]
    else:
        pieces = [load_tensor(t, None, dtype) for t in (gate, up, down)]
        if len({p.dtype for p in pieces}) > 1 or requantize:  # e.g. an F16 down stack beside Q8_0 gate/up: all fp32
            pieces = [p.float() for p in pieces]
    for e in range(len(pieces[0])):
        experts = [quantize(p[e], fmt) if requantize else p[e] for p in pieces]
        writer.add_expert(layer, e, *experts)


def _stack_blocks(t) -> list[CompactWeight]:
    """A stack of E block-quantized matrices [E, rows, cols] as E `CompactWeight`s over its bytes."""
    experts, rows, cols = (int(d) for d in reversed(t.shape.tolist()))
    data = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(experts, rows, -1)
    fmt = t.tensor_type.name.lower()
    return [CompactWeight(fmt, (rows, cols), data[e]) for e in range(experts)]


def load_blocks(t, cfg: ModelConfig) -> CompactWeight:
    """One block-quantized GGUF matrix, its bytes untouched, in HF row order (Q/K rows un-permuted:
    each row's blocks move whole, so the values are those `load_tensor` would dequantize)."""
    rows, cols = (int(d) for d in reversed(t.shape.tolist()))
    data = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(rows, -1)
    return CompactWeight(t.tensor_type.name.lower(), (rows, cols), _unpermute(data, t.name, cfg).contiguous())


def _unpermute(x: torch.Tensor, name: str, cfg: ModelConfig | None) -> torch.Tensor:
    """x with a llama Q or K projection's rows back in HF order (`unpermute_qk`); other tensors as they are."""
    if cfg is None or cfg.family != "llama":
        return x
    if ".attn_q." in name:
        return unpermute_qk(x, cfg.num_attention_heads)
    if ".attn_k." in name:
        return unpermute_qk(x, cfg.num_key_value_heads)
    return x
