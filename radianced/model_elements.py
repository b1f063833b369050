"""The weights of a model known only by its config: elements of each resident weight class, by how
`--tp` splits them (`sharding.split_kind`). `sizing.ModelFacts.from_config` prices them; a `.rad`'s
header gives the stored bytes instead (`ModelFacts.from_header`)."""

from __future__ import annotations

from collections.abc import Callable

from radianced.model.config import ModelConfig


def class_elements(m: ModelConfig) -> tuple[dict[tuple[str, str], int], int]:
    """Elements of every resident class by split kind (`sharding.split_kind`), and of the MTP head's
    routed experts."""
    H, E = m.hidden_size, m.num_experts
    n: dict[tuple[str, str], int] = {}

    def add(cls: str, kind: str, elements: int) -> None:
        n[cls, kind] = n.get((cls, kind), 0) + elements

    add("embeddings", "vocab", m.vocab_size * H)
    add("lm_head", "vocab", 0 if m.tie_word_embeddings else m.vocab_size * H)
    for i in range(m.num_hidden_layers):
        add("norms", "replicated", 2 * H)
        if m.layer_type(i) == "full_attention":
            _add_attention(m, add, "attention", "norms")
        else:
            key = m.linear_num_key_heads * m.linear_key_head_dim
            val = m.linear_num_value_heads * m.linear_value_head_dim
            nv = m.linear_num_value_heads
            add("attention", "k_heads", H * (2 * key + 2 * val) + H * 2 * nv  # in_proj_qkvz, in_proj_ba
                + (2 * key + val) * m.linear_conv_kernel_dim  # conv1d
                + 2 * nv + val * H)  # dt_bias, A_log, out_proj
            add("norms", "replicated", m.linear_value_head_dim)
        if m.is_moe_layer(i):
            add("router", "replicated", E * H)
            _add_shared(m, add, "shared experts")
        else:
            add("dense MLP", "columns", 3 * H * m.intermediate_size)
    add("norms", "replicated", H)
    mtp_experts = 0
    if m.num_mtp_layers:
        # fc [H, 2H], pre_fc_norm_embedding, pre_fc_norm_hidden, norm; each layer a
        # gated-attention decoder layer with its own MoE
        add("mtp", "replicated", 2 * H * H + 3 * H)
        for _ in range(m.num_mtp_layers):
            _add_attention(m, add, "mtp", "mtp")
            add("mtp", "replicated", 2 * H + E * H)
            _add_shared(m, add, "mtp")
        mtp_experts = m.num_mtp_layers * E * 3 * H * m.moe_intermediate_size
    return n, mtp_experts


def _add_attention(m: ModelConfig, add: Callable[[str, str, int], None], cls: str, norms: str) -> None:
    """One full-attention layer: projections in `cls`, its q/k norms in `norms`."""
    H, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_key_value_heads * d
    gated = 2 if m.family == "qwen3_next" else 1  # q_proj carries the output gate
    add(cls, "q_heads", H * q * gated + q * H)  # q_proj, o_proj
    add(cls, "kv_heads", 2 * H * kv)
    if m.attention_bias:
        add(cls, "q_heads", q * gated)
        add(cls, "kv_heads", 2 * kv)
        add(cls, "replicated", H)  # o_proj's bias
    add(norms, "replicated", 0 if m.family == "llama" else 2 * d)


def _add_shared(m: ModelConfig, add: Callable[[str, str, int], None], cls: str) -> None:
    Is = m.shared_expert_intermediate_size
    if Is:
        add(cls, "shared_columns", 3 * m.hidden_size * Is)  # gate/up/down
        add(cls, "replicated", m.hidden_size)  # shared_expert_gate
