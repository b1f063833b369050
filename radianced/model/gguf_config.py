"""The `ModelConfig` a GGUF file's metadata describes (`llama`, `qwen3moe` and `qwen3next` architectures).

llama.cpp writes the config as `<arch>.<key>` metadata. qwen3moe adds the experts
(`expert_count`, `expert_used_count`, `expert_feed_forward_length`) and always
renormalizes the top-k weights (its graph passes norm_w = true; transformers' GGUF
loader sets `norm_topk_prob` for the same reason). qwen3next adds the DeltaNet
shapes, the shared expert and partial rotary (`gguf_qwen3next.config_fields`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from radianced.model.config import ModelConfig, UnsupportedModel
from radianced.model.gguf_qwen3next import config_fields

ARCHITECTURES = {"llama": "llama", "qwen3moe": "qwen3_moe", "qwen3next": "qwen3_next"}  # GGUF architecture -> radianced family


def _f32(x: float) -> float:
    # GGUF stores these as float32 (1e-5 arrives as 9.999999747e-06): keep the shortest decimal
    # that rounds to the same float32, i.e. the value the source config wrote.
    return float(str(np.float32(x)))


def model_config(meta: dict[str, Any], tensors: list) -> ModelConfig:
    """The `ModelConfig` a llama, qwen3moe or qwen3next GGUF describes; refuses what radianced cannot run."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported; the GGUF converter reads "
            f"{', '.join(map(repr, ARCHITECTURES))} (convert other models from their Hugging Face folder)"
        )
    p = f"{arch}."

    def need(key: str):
        if key not in meta:
            raise UnsupportedModel(f"the GGUF metadata lacks {key!r}; the file is incomplete or not a {arch} model")
        return meta[key]

    experts = meta.get(p + "expert_count", 0)
    if arch == "llama" and experts:
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
    if rotary != head_dim and arch != "qwen3next":
        raise UnsupportedModel(f"partial rotary ({rotary} of {head_dim} dims per head) is not supported for {arch}")
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise UnsupportedModel("the GGUF has no token_embd.weight tensor")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    moe = {}
    if arch != "llama":
        moe = dict(num_experts=experts, num_experts_per_tok=need(p + "expert_used_count"),
                   moe_intermediate_size=need(p + "expert_feed_forward_length"), norm_topk_prob=True)
    if arch == "qwen3next":
        moe |= config_fields(meta, p, head_dim, need(p + "block_count"))
    return ModelConfig(
        family=ARCHITECTURES[arch],
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
        attention_bias=any(n.endswith(".bias") and ".attn_" in n for n in names),  # not qwen3next's ssm_dt.bias
        intermediate_size=need(p + "feed_forward_length") if arch == "llama" else meta.get(p + "feed_forward_length", 0),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(meta),
        **moe,
    )


def _eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """The end-of-sequence ids llama.cpp stops on: eos, eot and eom, once each."""
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.get(f"tokenizer.ggml.{key}")
        if token is not None and token not in eos:
            eos.append(int(token))
    return tuple(eos)
