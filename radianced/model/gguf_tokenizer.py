"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers.Tokenizer`.

Byte-level BPE (`tokenizer.ggml.model` "gpt2") that encodes like transformers'
tokenizer from the same file; the pre-tokenizer follows `tokenizer.ggml.pre`.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from radianced.model.config import UnsupportedModel

# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE (llama-vocab.cpp).
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PRE = ("qwen2",)  # Qwen2 / Qwen3: llama3's split with single digits (Qwen2's tokenizer.json)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
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
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    known = ", ".join((*_GPT2_PRE, *_DIGITS_PRE, *_LLAMA3_PRE, *_QWEN2_PRE))
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
