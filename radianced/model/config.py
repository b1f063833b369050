"""The model's architecture as plain data, shared by every family.

`ModelConfig` is stored in the `.rad` header and is the only description of a
model the rest of radianced sees (budget, engine, runner). It is built from a
Hugging Face `config.json` dict (`from_hf`) or by the GGUF converter.
"""

from __future__ import annotations

import msgspec

FAMILIES = ("llama", "qwen3_moe", "qwen3_next")

# Hugging Face `model_type` / `architectures` -> our family name.
HF_MODEL_TYPES = {"llama": "llama", "qwen3_moe": "qwen3_moe", "qwen3_next": "qwen3_next"}

# qwen3_next's Gated DeltaNet sizes: the same names in config.json and in ModelConfig
_LINEAR_ATTENTION_KEYS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                          "linear_num_key_heads", "linear_num_value_heads")


class UnsupportedModel(ValueError):
    """The source describes an architecture radianced does not serve."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    family: str  # one of FAMILIES
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    # dense MLP (llama; qwen3 layers listed in mlp_only_layers)
    intermediate_size: int = 0
    # routed experts (qwen3_moe, qwen3_next)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # qwen3_next: sigmoid-gated shared expert
    # hybrid attention (qwen3_next): "full_attention" | "linear_attention" per layer
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    num_mtp_layers: int = 0  # qwen3_next multi-token-prediction head (kept in the file)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    # -- derived facts ------------------------------------------------------

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def is_moe_layer(self, layer: int) -> bool:
        """True where the layer's MLP is routed experts (HF's rule, both families)."""
        if self.num_experts == 0 or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) == "linear_attention")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict; refuses unknown architectures."""
        model_type = hf.get("model_type", "")
        family = HF_MODEL_TYPES.get(model_type)
        if family is None:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported; radianced serves {', '.join(FAMILIES)}"
            )
        rope_theta, partial = _hf_rope(hf, family)
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        layers = hf["num_hidden_layers"]
        moe = family in ("qwen3_moe", "qwen3_next")
        hybrid = family == "qwen3_next"
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            partial_rotary_factor=float(partial),
            attention_bias=bool(hf.get("attention_bias", False)),
            intermediate_size=hf.get("intermediate_size", 0) or 0,
            # transformers 5 writes qwen3_moe's count as num_local_experts; the Qwen checkpoints say num_experts
            num_experts=(hf.get("num_experts") or hf.get("num_local_experts", 0)) if moe else 0,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=hf.get("moe_intermediate_size", 0) if moe else 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
            layer_types=_hf_layer_types(hf, layers) if hybrid else (),
            **{key: hf.get(key, 0) if hybrid else 0 for key in _LINEAR_ATTENTION_KEYS},
            num_mtp_layers=hf.get("num_nextn_predict_layers", hf.get("mtp_num_hidden_layers", 0)) or 0,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _hf_rope(hf: dict, family: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from config.json's top level or its rope_parameters;
    refuses rope scaling. Only qwen3_next rotates part of each head (the rest keep 1.0)."""
    rope = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if family != "qwen3_next":
        partial = 1.0
    scaling = hf.get("rope_scaling") or {}
    for kind in (rope.get("rope_type", "default"), scaling.get("rope_type", scaling.get("type", "default"))):
        if kind != "default":
            raise UnsupportedModel(f"rope scaling {kind!r} is not supported yet; only plain RoPE")
    return rope_theta, partial


def _hf_layer_types(hf: dict, layers: int) -> tuple[str, ...]:
    """qwen3_next's attention kind per layer: config.json's layer_types, else every
    full_attention_interval-th layer (default 4) full attention, the others linear."""
    return tuple(hf.get("layer_types") or [
        "linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else "full_attention"
        for i in range(layers)
    ])
