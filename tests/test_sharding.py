"""Each card's share of a model split over --tp N cards, checked by hand: heads, columns, vocab rows
and experts per card, and each card's class bytes, written out as the arithmetic."""

from __future__ import annotations

import pytest

from radianced.sharding import card_share, most_cards, shard_facts, split_kind, split_range
from radianced.sizing import WEIGHT_CLASSES, ModelFacts
from tests.test_budget import QWEN3_30B, QWEN3_NEXT, SMOLLM2, TINY_LLAMA, TINY_MOE, TINY_NEXT

MODELS = (SMOLLM2, QWEN3_30B, QWEN3_NEXT, TINY_LLAMA, TINY_MOE, TINY_NEXT)


def test_units_split_in_contiguous_ranges_with_the_remainder_to_the_first_cards():
    assert [split_range(32, r, 3) for r in range(3)] == [(0, 11), (11, 22), (22, 32)]
    assert [split_range(9, r, 2) for r in range(2)] == [(0, 5), (5, 9)]
    assert [split_range(8, r, 1) for r in range(1)] == [(0, 8)]


def test_a_card_holds_the_kv_heads_its_query_heads_read():
    # SmolLM2: 9 query heads in 3 groups of 3; card 0 has 0-4 (groups 0, 1), card 1 5-8 (groups 1, 2)
    assert [card_share(SMOLLM2, r, 2).kv_heads for r in range(2)] == [(0, 2), (1, 3)]
    # Qwen3-30B: 32 query heads, 4 KV heads: over 8 cards each card's 4 query heads read one KV head
    assert [card_share(QWEN3_30B, r, 8).q_heads for r in range(8)] == [(4 * r, 4 * r + 4) for r in range(8)]
    assert [card_share(QWEN3_30B, r, 8).kv_heads for r in range(8)] == [(r // 2, r // 2 + 1) for r in range(8)]
    assert [card_share(QWEN3_30B, r, 2).kv_heads for r in range(2)] == [(0, 2), (2, 4)]


def test_qwen3_next_shares_over_two_cards():
    a, b = card_share(QWEN3_NEXT, 0, 2), card_share(QWEN3_NEXT, 1, 2)
    assert (a.q_heads, a.kv_heads, a.k_heads, a.shared_columns, a.vocab, a.experts) == (
        (0, 8), (0, 1), (0, 8), (0, 256), (0, 75968), (0, 256))
    assert (b.q_heads, b.kv_heads, b.k_heads, b.shared_columns, b.vocab, b.experts) == (
        (8, 16), (1, 2), (8, 16), (256, 512), (75968, 151936), (256, 512))
    assert a.columns == (0, 0)  # every layer is MoE: no dense MLP columns to split
    assert b.words() == ("query heads 8-15, KV heads 1-1, DeltaNet key heads 8-15, shared expert columns 256-511, "
                         "vocab rows 75968-151935, experts 256-511")


def test_how_each_stored_tensor_splits():
    kinds = {
        "model.embed_tokens.weight": "vocab", "lm_head.weight": "vocab",
        "model.layers.0.self_attn.q_proj.weight": "q_heads", "model.layers.0.self_attn.q_proj.bias": "q_heads",
        "model.layers.0.self_attn.o_proj.weight": "q_heads", "model.layers.0.self_attn.o_proj.bias": "replicated",
        "model.layers.0.self_attn.k_proj.weight": "kv_heads", "model.layers.0.self_attn.v_proj.bias": "kv_heads",
        "model.layers.0.self_attn.q_norm.weight": "replicated",
        "model.layers.0.linear_attn.in_proj_qkvz.weight": "k_heads", "model.layers.0.linear_attn.A_log": "k_heads",
        "model.layers.0.linear_attn.conv1d.weight": "k_heads", "model.layers.0.linear_attn.norm.weight": "replicated",
        "model.layers.0.mlp.down_proj.weight": "columns", "model.layers.0.mlp.gate.weight": "replicated",
        "model.layers.0.mlp.shared_expert.up_proj.weight": "shared_columns",
        "model.layers.0.mlp.shared_expert_gate.weight": "replicated",
        "model.layers.0.input_layernorm.weight": "replicated", "mtp.fc.weight": "replicated",
        "mtp.layers.0.self_attn.k_proj.weight": "kv_heads",
    }
    assert {name: split_kind(name) for name in kinds} == kinds


def test_qwen3_30b_card_bytes_by_hand():
    whole = ModelFacts.from_config(QWEN3_30B, 2)
    for rank in range(2):
        card = shard_facts(whole, rank, 2)
        w = dict(card.weights)
        assert w["embeddings"] == w["lm_head"] == 75968 * 2048 * 2  # half the vocab rows each
        # 16 query heads (q_proj, o_proj) and 2 KV heads (k_proj, v_proj) of 128 dims, 48 layers
        assert w["attention"] == 48 * (2 * 2048 * 16 * 128 + 2 * 2048 * 2 * 128) * 2
        assert w["norms"] == whole.weight("norms") and w["router"] == 48 * 128 * 2048 * 2  # replicated
        assert card.expert_count == 48 * 64 and card.expert_total_bytes == whole.expert_total_bytes // 2
        assert card.experts_per_layer == 64 and card.expert_extent_bytes == whole.expert_extent_bytes
        m = card.model
        assert (m.num_attention_heads, m.num_key_value_heads, m.num_experts, m.vocab_size) == (16, 2, 128, 151936)


def test_qwen3_next_card_bytes_by_hand():
    whole = ModelFacts.from_config(QWEN3_NEXT, 2)
    card = shard_facts(whole, 1, 2)
    w, H = dict(card.weights), 2048
    key, val, nv = 8 * 128, 16 * 128, 16  # 8 of 16 key heads, each with 2 value heads
    deltanet = H * (2 * key + 2 * val) + H * 2 * nv + (2 * key + val) * 4 + 2 * nv + val * H
    full = H * 8 * 256 * 2 + 2 * H * 1 * 256 + 8 * 256 * H  # gated q_proj, k/v of one KV head, o_proj
    assert w["attention"] == (36 * deltanet + 12 * full) * 2
    assert w["shared experts"] == 48 * (3 * H * 256 + H) * 2  # half the columns, the whole sigmoid gate
    # the MTP head: fc and its norms whole; its layer as a full-attention layer with its own MoE, experts halved
    mtp = 2 * H * H + 3 * H + full + 2 * 256 + 2 * H + 512 * H + 3 * H * 256 + H + 256 * 3 * H * 512
    assert w["mtp"] == mtp * 2
    m = card.model
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.shared_expert_intermediate_size) == (8, 16, 256)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"{m.family}-{m.num_hidden_layers}")
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_cards_add_up_to_the_whole_plus_what_each_holds_again(model, tp):
    whole = ModelFacts.from_config(model, 2)
    if tp > most_cards(model)[0]:
        return
    cards = [shard_facts(whole, r, tp) for r in range(tp)]
    kv_held = sum(c.share.kv_heads[1] - c.share.kv_heads[0] for c in cards)  # KV heads over the cards
    for cls in WEIGHT_CLASSES:
        replicated = sum(n for c, k, n in whole.parts if c == cls and k == "replicated")
        kv = sum(n for c, k, n in whole.parts if c == cls and k == "kv_heads")
        again = (tp - 1) * replicated + kv * (kv_held - model.num_key_value_heads) // model.num_key_value_heads
        assert sum(c.weight(cls) for c in cards) == whole.weight(cls) + again, cls
    experts = [e for c in cards for e in range(*c.share.experts)]
    assert experts == list(range(model.num_experts))  # disjoint and covering, in order
    assert sum(c.expert_count for c in cards) == whole.expert_count
    assert sum(c.expert_total_bytes for c in cards) == whole.expert_total_bytes
    if tp == 1:
        assert cards[0].weights == whole.weights


def test_a_card_share_is_not_split_again_and_facts_without_a_split_are_refused():
    whole = ModelFacts.from_config(TINY_MOE, 4)
    with pytest.raises(ValueError, match="already card 0 of 2's share"):
        shard_facts(shard_facts(whole, 0, 2), 0, 2)
    bare = ModelFacts(TINY_MOE, 4, whole.weights)
    with pytest.raises(ValueError, match="carry no split of their weights"):
        shard_facts(bare, 0, 2)


def test_the_most_cards_a_model_splits_over():
    assert most_cards(SMOLLM2) == (9, "query heads")
    assert most_cards(QWEN3_30B) == (32, "query heads")
    assert most_cards(QWEN3_NEXT) == (16, "DeltaNet key heads")
    assert most_cards(TINY_MOE) == (4, "query heads")


def test_a_headers_tensors_and_the_mtp_heads_experts_split_by_name():
    tensors = [("model.embed_tokens.weight", "f32", (400, 64), 400 * 64 * 4),
               ("model.layers.0.self_attn.q_proj.weight", "f32", (64, 64), 64 * 64 * 4),
               ("model.layers.0.self_attn.k_proj.weight", "f32", (32, 64), 32 * 64 * 4),
               ("model.layers.0.input_layernorm.weight", "f32", (64,), 64 * 4),
               ("mtp.fc.weight", "f32", (64, 128), 64 * 128 * 4),
               ("mtp.layers.0.self_attn.q_proj.weight", "f32", (64, 64), 64 * 64 * 4)]
    experts = [(layer, e, 1000 if layer < 3 else 500) for layer in range(4) for e in range(8)]  # layer 3: MTP's
    whole = ModelFacts.from_rows(TINY_MOE, tensors, experts)
    card = shard_facts(whole, 1, 2)
    assert card.weight("embeddings") == 200 * 64 * 4  # vocab rows 200-399
    assert card.weight("attention") == 32 * 64 * 4 + 16 * 64 * 4  # query heads 2-3, KV head 1
    assert card.weight("norms") == 64 * 4
    assert card.weight("mtp") == 64 * 128 * 4 + 32 * 64 * 4 + 4 * 500  # fc whole, half its q_proj, 4 of 8 experts
    assert (card.expert_count, card.expert_total_bytes, card.experts_per_layer) == (3 * 4, 3 * 4 * 1000, 4)
