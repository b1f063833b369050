"""The card split, checked by hand: every expected number below is written out as
the arithmetic an operator would do with a calculator, not taken from budget.py."""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radianced.budget import (
    PlanError, Room, Short, Split, deterministic, lending, plan, resident, with_disk_buffers,
)
from radianced.card import ALLOC_GRANULE, Card
from radianced.charges import CAPTURE_WORKSPACE_BYTES, fixed_charges, recurrent_state_charge
from radianced.config import Config, parse_config
from radianced.model.config import ModelConfig
from radianced.model.hf_plan import expected_layer
from radianced.receipt import Part, fmt_gib
from radianced.sizing import BLOCK_TOKENS, ModelFacts, PagingGroup, kv_pages, kv_token_bytes, paging_groups, slot_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# -- arithmetic by hand (the tests' own, not the package's) -----------------------


def expert_slots(free_bytes: int, reserved_bytes: int, extent_bytes: int) -> int:
    """Slots in what is left: floor((free - reserved) / aligned slot), never negative."""
    return max(0, (free_bytes - reserved_bytes) // slot_bytes(extent_bytes))


def kv_bytes(groups, tokens: int) -> int:
    """Bytes of `tokens` tokens of one sequence, in whole blocks of every group."""
    return sum(g.blocks(tokens) * g.block_bytes for g in groups)


def kv_tokens_by_hand(sessions: int, context_tokens: int, held_pct: int = 100) -> int:
    """Pool tokens that `sessions` sessions of `context_tokens` need when each holds
    `held_pct`% of its context (prefix caching keeps earlier turns: about 180%)."""
    return -(-sessions * context_tokens * held_pct // 100)

# -- models: real shapes (REFERENCE.md) and the tiny test models ----------------

SMOLLM2 = ModelConfig(
    family="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
    tie_word_embeddings=True, intermediate_size=1536)
QWEN3_30B = ModelConfig(
    family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
    intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
QWEN3_NEXT = ModelConfig(
    family="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=262144,
    partial_rotary_factor=0.25, intermediate_size=5120, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=512, shared_expert_intermediate_size=512,
    layer_types=tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)),
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, num_mtp_layers=1)
_TINY = dict(vocab_size=400, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=4096)
TINY_LLAMA = ModelConfig(family="llama", num_hidden_layers=2, intermediate_size=128, tie_word_embeddings=True, **_TINY)
TINY_MOE = ModelConfig(family="qwen3_moe", num_hidden_layers=3, intermediate_size=128, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, **_TINY)
TINY_NEXT = ModelConfig(
    family="qwen3_next", num_hidden_layers=4, intermediate_size=128, num_experts=8, num_experts_per_tok=3,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, partial_rotary_factor=0.25,
    layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=32, **_TINY)


def flags(text: str = "") -> Config:
    return parse_config(text.split())


# -- the test vectors ---------------------------------------------------


def test_two_paging_groups_cost_7_3125_kib_per_token_and_1_43_gib_for_200ki_tokens():
    groups = [PagingGroup("kv_attn", 1, 4, 26 * KiB), PagingGroup("kv_idx", 1, 4, 13 * KiB // 4)]  # 3.25 KiB
    assert kv_token_bytes(groups) == Fraction(7.3125 * KiB)
    assert kv_bytes(groups, 204_800) == 204_800 // 4 * (26 * KiB + 3.25 * KiB)
    assert fmt_gib(kv_bytes(groups, 204_800)) == "1.43 GiB"


def test_prefix_cached_sessions_need_about_662_ki_pool_tokens():
    tokens = kv_tokens_by_hand(sessions=2, context_tokens=184 * KiB, held_pct=180)
    assert tokens == 678_298  # ceil(2 x 188,416 x 1.8)
    assert round(tokens / KiB) == 662


def test_expert_slots_are_the_floor_of_available_over_the_4_kib_aligned_slot():
    extent = round(1.318 * MiB)  # 1,382,023 B, the reference's 1.318 MiB slot
    assert slot_bytes(extent) == 338 * 4096  # our alignment: whole 4 KiB pages, 1.3203 MiB
    # before alignment the reference counts hold: 5,785 and 19,537
    assert (8509 - 884) * MiB // extent == 5785
    assert (26634 - 884) * MiB // extent == 19537
    # after our alignment (the reference engine reported 5,784 and 19,530 after its own)
    assert expert_slots(8509 * MiB, 884 * MiB, extent) == (8509 - 884) * MiB // (338 * 4096) == 5775
    assert expert_slots(26634 * MiB, 884 * MiB, extent) == 19502


def test_recurrent_state_with_draft_decoding_charges_two_copies_3456_mib():
    assert recurrent_state_charge(54 * MiB, seqs=32, speculative=1) == 3456 * MiB
    assert recurrent_state_charge(54 * MiB, seqs=32, speculative=0) == 1728 * MiB


# -- model facts ----------------------------------------------------------------


def test_smollm2_kv_costs_22_5_kib_per_token_in_bf16_and_45_in_fp32():
    for dtype_bytes, per_token in ((2, 22.5 * KiB), (4, 45 * KiB)):
        r = plan(Card.from_mib(8192), ModelFacts.from_config(SMOLLM2, dtype_bytes), flags())
        (g,) = r.groups
        assert g.token_bytes == per_token == 30 * 2 * 3 * 64 * dtype_bytes
        assert g.block_bytes == 16 * per_token


def _tiny_next_rows() -> list[tuple[str, str, tuple[int, ...], int]]:
    """The tensor index of tools/make_tiny's qwen3_next checkpoint (fp32), as written."""
    shapes = {"model.embed_tokens.weight": (400, 64), "lm_head.weight": (400, 64), "model.norm.weight": (64,)}
    for i, kind in enumerate(TINY_NEXT.layer_types):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            shapes |= {p + "linear_attn.A_log": (4,), p + "linear_attn.conv1d.weight": (192, 1, 4),
                       p + "linear_attn.dt_bias": (4,), p + "linear_attn.in_proj_ba.weight": (8, 64),
                       p + "linear_attn.in_proj_qkvz.weight": (320, 64), p + "linear_attn.norm.weight": (32,),
                       p + "linear_attn.out_proj.weight": (64, 128)}
        else:
            shapes |= {p + "self_attn.q_proj.weight": (128, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,)}
        shapes |= {p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
                   p + "mlp.gate.weight": (8, 64), p + "mlp.shared_expert.gate_proj.weight": (32, 64),
                   p + "mlp.shared_expert.up_proj.weight": (32, 64), p + "mlp.shared_expert.down_proj.weight": (64, 32),
                   p + "mlp.shared_expert_gate.weight": (1, 64)}
        for e in range(8):
            for n, s in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                shapes[p + f"mlp.experts.{e}.{n}.weight"] = s
    rows = []
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        rows.append((name, "f32", shape, 4 * n))
    return rows


def test_from_config_matches_the_tensor_index_of_a_real_checkpoint():
    experts = [(layer, e, 3 * 32 * 64 * 4) for layer in range(4) for e in range(8)]
    from_index = ModelFacts.from_rows(TINY_NEXT, _tiny_next_rows(), experts)
    assert from_index == ModelFacts.from_config(TINY_NEXT, 4)
    w = dict(from_index.weights)
    assert w["attention"] == 4 * (2 * (4 + 192 * 4 + 4 + 8 * 64 + 320 * 64 + 64 * 128)  # two DeltaNet layers
                                  + 2 * (128 * 64 + 2 * 32 * 64 + 64 * 64))  # two gated-attention layers
    assert w["norms"] == 4 * (4 * 2 * 64 + 2 * 32 + 2 * 2 * 16 + 64)
    assert w["router"] == 4 * 4 * 8 * 64
    assert w["shared experts"] == 4 * 4 * (3 * 32 * 64 + 64)
    assert (from_index.expert_count, from_index.expert_extent_bytes) == (32, 24 * KiB)


def test_from_header_reads_a_rad_header_and_counts_mtp_experts_with_the_mtp_head():
    rows = [("model.embed_tokens.weight", "bf16", (400, 64), 400 * 64 * 2),
            ("model.layers.0.mlp.experts.0.gate_proj.weight", "bf16", (32, 64), 4096),  # counted by its extent
            ("mtp.fc.weight", "bf16", (64, 128), 64 * 128 * 2)]
    header = SimpleNamespace(
        model=TINY_MOE,
        tensors=[SimpleNamespace(name=n, dtype=d, shape=list(s), nbytes=b) for n, d, s, b in rows],
        experts=[SimpleNamespace(layer=layer, expert=e, nbytes=12 * KiB) for layer in range(4) for e in range(8)])
    facts = ModelFacts.from_header(header)
    assert facts.act_bytes == 2
    assert (facts.expert_count, facts.expert_extent_bytes, facts.expert_total_bytes) == (24, 12 * KiB, 24 * 12 * KiB)
    assert facts.weight("mtp") == 64 * 128 * 2 + 8 * 12 * KiB  # layer 3 is past the 3 decoder layers


# -- receipts computed by hand ------------------------------------------------


def test_smollm2_bf16_receipt_by_hand():
    # 4096 MiB card with 96 MiB used by another process; every flag at its default
    r = plan(Card(4096 * MiB, 4000 * MiB), ModelFacts.from_config(SMOLLM2, 2), flags())
    lm_head = 49152 * 576 * 2  # tied: the one copy of the embeddings lives on the card
    attention = 30 * (576 * 576 + 2 * 576 * 192 + 576 * 576) * 2
    norms = (30 * 2 * 576 + 576) * 2
    mlp = 30 * 3 * 576 * 1536 * 2
    assert [(p.name, p.bytes) for p in r.weights] == [
        ("lm_head", lm_head), ("attention", attention), ("norms", norms), ("dense MLP", mlp)]
    assert r.host_weights == ()  # tied embeddings need no host copy
    rows = 16  # min(2048 batched tokens, 16 seqs x 1 token)
    logits = rows * 49152 * (2 + 20)

    def layer(t):  # 4 hidden buffers + q, k, v, attention out + gate, up, act
        return 4 * t * 576 * 2 + t * (576 + 2 * 192 + 576) * 2 + t * 3 * 1536 * 2

    # no step graphs on this card (not CUDA): a graph pool of 0
    assert [(p.name, p.bytes) for p in r.workspace] == [
        ("logits", logits), ("activations", layer(2048)), ("graph pool", 0), ("libraries", 32 * MiB)]
    assert [(p.name, p.bytes) for p in r.state] == [("block tables", 16 * (8192 // 16) * 4)]
    page = 5 * 16 * 23040  # five whole 360 KiB blocks (16 tokens x 22.5 KiB) fit in 2 MiB
    assert r.page_bytes == page == 1_843_200
    elastic = 4000 * MiB - 96 * MiB - (lm_head + attention + norms + mlp) \
        - (logits + layer(2048) + 32 * MiB) - 16 * 512 * 4
    assert r.elastic == elastic
    assert r.arena_pages == elastic // page == 2028
    assert (r.expert_slots, r.kv_max_pages, r.kv_pool_tokens) == (0, 2028, 2028 * 5 * 16)
    assert r.full_sessions == 2028 * 5 * 16 // 8192 == 19
    assert r.worst_case_percent == 100 * 2028 * 80 // (16 * 8192) == 123
    lines = r.lines()
    assert "card: 4096.00 MiB total, 4000.00 MiB free, 96.00 MiB in use elsewhere" in lines
    assert ("kv_attn 360.00 KiB per 16-token block in auto: the activations' dtype, 2 bytes an element "
            "(22.50 KiB per token, 30 layers), 5 blocks per page") in lines
    assert "expert cache: none (dense model: every page holds KV)" in lines
    assert lines[-1] == "kv: the pool backs 123% of the worst case (16 seqs x 8192 tokens) = 19 full-length sessions"


def test_graph_pool_charges_the_largest_graph_on_a_gpu_and_nothing_where_no_graph_is_captured():
    facts, cfg = ModelFacts.from_config(SMOLLM2, 2), flags("--max-model-len 4096")

    def pool(card, cfg=cfg, facts=facts):
        return next(p for p in plan(card, facts, cfg).workspace if p.name == "graph pool")

    gpu = pool(Card.from_mib(4096, cuda=True))
    t, rows = 2048, 16  # the largest mixed graph (16 seqs: 32 .. 256, then 512 .. 2,048 by 256); 16 logits rows
    layer = 4 * t * 576 * 2 + t * (576 + 2 * 192 + 576) * 2 + t * 3 * 1536 * 2  # as in the receipt by hand
    # the flash-decoding partials: min(2,048 rows x 32 splits, 8 programs x 256 SMs / 3 KV heads) partial rows x 9
    # query heads x (64 dims + lse) in fp32
    partials = 682 * 9 * 65 * 4
    logits, held = rows * 49152 * (2 + 20), rows * 49152 * 4  # the temporary, and the outputs the graphs hold
    assert gpu.bytes == layer + partials + logits + held + CAPTURE_WORKSPACE_BYTES and CAPTURE_WORKSPACE_BYTES == 32 * MiB
    assert "capture stream's cuBLAS workspace" in gpu.detail
    assert (pool(Card.from_mib(4096)).bytes, pool(Card.from_mib(4096)).detail) == (
        0, "none: the host backend runs every step eagerly")
    eager = pool(Card.from_mib(4096, cuda=True), flags("--max-model-len 4096 --enforce-eager"))
    assert (eager.bytes, eager.detail) == (0, "none: --enforce-eager")
    mtp = pool(Card.from_mib(200000, cuda=True), flags("--max-model-len 4096 --speculative 2 --host-pool-mib 200000"),
               ModelFacts.from_config(QWEN3_NEXT, 2))
    assert (mtp.bytes, mtp.detail) == (0, "none: the MTP head drafts after every step")


def test_smollm2_fp32_pages_hold_two_720_kib_blocks():
    r = plan(Card.from_mib(4096), ModelFacts.from_config(SMOLLM2, 4), flags("--max-model-len 4096"))
    assert r.page_bytes == 2 * 16 * 45 * KiB  # 1440 KiB: a third block would pass 2 MiB
    assert r.weights[0].bytes == 49152 * 576 * 4


def _tiny_moe_fixed(seqs=2, tokens=64, model_len=256) -> int:
    """Everything but the elastic line for TINY_MOE (fp32), --gpu-headroom-mib 0."""
    weights = 400 * 64 * 4 + 3 * (64 * 64 + 2 * 32 * 64 + 64 * 64) * 4 + (3 * (2 * 64 + 2 * 16) + 64) * 4 \
        + 3 * 8 * 64 * 4  # lm_head, attention, norms, router (embeddings stay in host RAM)
    rows = min(tokens, seqs)

    def layer(t):  # hidden + q, k, v, out + router logits, top-k ids and weights, routed rows
        return 4 * t * 64 * 4 + t * (64 + 64 + 64) * 4 + t * 8 * 4 + 2 * t * 12 + 2 * t * (2 * 64 + 3 * 32) * 4

    logits = rows * 400 * (4 + 20)
    workspace = logits + layer(tokens) + 32 * MiB  # a CPU card: no graph pool (the host captures no graphs)
    state = seqs * (model_len // 16) * 4 + 3 * 8 * 8  # block tables, expert pointers
    return weights + workspace + state


TINY_SLOT = 3 * 32 * 64 * 4  # 24 KiB: already a multiple of 4 KiB
TINY_FLAGS = "--gpu-headroom-mib 0 --max-model-len 256 --max-num-seqs 2 --max-num-batched-tokens 64"


def tiny_moe_plan(pages: int, extra: str = "", slack: int = 0):
    free = _tiny_moe_fixed() + pages * TINY_SLOT + slack
    return plan(Card(free, free), ModelFacts.from_config(TINY_MOE, 4), flags(f"{TINY_FLAGS} {extra}"))


def test_tiny_moe_lending_pins_experts_the_host_pool_cannot_hold():
    r = tiny_moe_plan(319, slack=11_728)
    assert (r.arena_pages, r.page_bytes, r.elastic - r.arena_bytes) == (319, TINY_SLOT, 11_728)
    # kv: 3 layers x 2 x 2 heads x 16 x 4 B = 768 B per token, 12 KiB blocks, two per page
    assert r.groups == (PagingGroup("kv_attn", 3, 16, 16 * 768),)
    # no host pool: all 3 x 8 experts pinned; one 256-token sequence = 16 blocks = 8 pages
    assert (r.experts, r.experts_pinned, r.experts_host, r.experts_disk) == (24, 24, 0, 0)
    assert (r.expert_slots, r.expert_floor) == (24, 24)
    assert r.kv_buffer_pages == 3  # one step's growth: 64 + 2 x 16 tokens = 6 blocks
    assert r.kv_max_pages == 319 - 24 == 295
    assert r.kv_pool_tokens == 295 * 2 * 16
    assert r.full_sessions == 36  # 36 x 8 pages = 288 <= 295 < 296
    assert r.worst_case_percent == 100 * 9440 // (2 * 256) == 1843
    # free: the elastic 7,851,472 B; reserved: 295 KV pages + 11,728 B unpaged = 7,261,648 B
    assert "expert cache: 0.01 GiB free, 6.93 MiB reserved -> 24 slots" in r.lines()


def test_tiny_moe_lending_with_a_host_pool_lends_all_but_the_floor():
    r = tiny_moe_plan(319, "--host-pool-mib 1")  # 1 MiB holds 42 slots: every expert
    assert (r.experts_pinned, r.experts_host) == (0, 24)
    assert r.expert_floor == 2 * 3  # one token's top-2 in each of 3 MoE layers
    assert r.expert_slots == 24 and r.kv_start_pages == 295
    assert r.kv_max_pages == 319 - 6


def test_expert_slots_cap_limits_the_cache_not_the_floor():
    r = tiny_moe_plan(319, "--host-pool-mib 1 --expert-slots 10")
    assert (r.expert_slots, r.expert_floor, r.kv_start_pages, r.kv_max_pages) == (10, 6, 309, 313)


def test_deterministic_puts_experts_first_and_keeps_one_sequence_of_kv():
    r = tiny_moe_plan(20, "--deterministic --host-pool-mib 1")
    assert r.mode == "deterministic"
    assert (r.expert_slots, r.experts_pinned, r.experts_host) == (12, 12, 12)  # 20 pages - 8 for one sequence
    assert (r.kv_start_pages, r.kv_max_pages, r.full_sessions) == (8, 8, 1)


def test_deterministic_refuses_experts_that_fit_neither_card_nor_host_pool():
    with pytest.raises(PlanError) as e:
        tiny_moe_plan(20, "--deterministic")
    msg = str(e.value)
    assert msg.startswith("the card is 0.28 MiB short: 12 experts fit neither the card")  # 12 x 24 KiB
    assert "--host-pool-mib 1" in msg
    assert "--weights-disk-tier" not in msg  # its two buffers (16 pages) would not leave room


def test_resident_refuses_saying_how_many_mib_are_missing():
    with pytest.raises(PlanError) as e:
        tiny_moe_plan(31, "--placement resident")  # needs 24 slots + 8 pages of KV
    assert str(e.value).startswith("the card is 0.02 MiB short: all 24 experts (24 slots) plus one full-length "
                                   "sequence of KV (8 pages, --max-model-len 256)")
    assert tiny_moe_plan(32, "--placement resident").kv_max_pages == 8


def test_lending_refuses_pinned_experts_and_names_the_host_pool_that_would_work():
    with pytest.raises(PlanError) as e:
        tiny_moe_plan(31)  # 24 pinned + 8 pages of KV do not fit 31 pages
    msg = str(e.value)
    assert "24 experts pinned on the card (beyond the host pool, --host-pool-mib 0)" in msg
    assert "--host-pool-mib 1" in msg and "--max-model-len 224" in msg  # 7 pages of KV = 224 tokens


def test_disk_tier_leaves_what_the_host_pool_cannot_hold_in_the_file():
    # 30 pages cannot pin 24 experts beside 8 pages of KV; the file keeps them, and
    # two buffers of one layer's 8 experts (16 pages) leave 14 pages
    r = tiny_moe_plan(30, "--weights-disk-tier")
    assert (r.experts_pinned, r.experts_host, r.experts_disk) == (0, 0, 24)
    assert r.state[-1].name == "disk-tier buffers" and r.state[-1].bytes == 2 * 8 * TINY_SLOT
    assert r.arena_pages == 14 and r.expert_floor == 6 and r.kv_max_pages == 8
    # the arena allocates the buffers beside its pages: what start-up holds counts them once
    assert r.held_bytes == r.weights_bytes + r.state_bytes + r.arena_pages * TINY_SLOT


def _graph_pool(r) -> Part:
    return next(p for p in r.workspace if p.name == "graph pool")


def test_a_disk_tier_on_a_gpu_is_charged_no_graph_pool_and_its_bytes_go_to_the_arena():
    """The disk tier's steps run eagerly (a host sync per routed layer), so its split is planned again
    without the pool: the receipt does not charge graphs the engine never captures."""
    facts = ModelFacts.from_config(QWEN3_30B, 2)
    cfg = flags("--max-model-len 4096 --max-num-seqs 4 --host-pool-mib 8192 --weights-disk-tier")
    card = Card.from_mib(24576, cuda=True)
    charged = fixed_charges(card, facts, cfg, paging_groups(facts, cfg), 4096)
    pool = _graph_pool(charged).bytes
    r = plan(card, facts, cfg)
    assert pool > 300 * MiB and r.experts_disk > 0
    assert (_graph_pool(r).bytes, _graph_pool(r).detail) == (
        0, "none: the disk tier reads experts with a host sync in every routed layer")
    assert r.elastic + r.disk_buffer_pages * r.page_bytes == charged.elastic + pool  # the pool's bytes: the arena's


def test_where_the_pool_alone_would_take_every_expert_off_the_disk_the_first_split_stands():
    """With a host pool of 34,000 MiB, 2,367 experts stay in the file; planned without the pool's 324 MiB
    the card would pin what the host cannot hold (no disk tier: graphs captured after all), so the
    first split stands, its pool charged though the disk tier captures none."""
    facts = ModelFacts.from_config(QWEN3_30B, 2)
    card = Card.from_mib(24576, cuda=True)
    given = "--max-model-len 4096 --max-num-seqs 4 --host-pool-mib 34000 --weights-disk-tier"
    r = plan(card, facts, flags(given))
    assert r.experts_disk == 2367 and _graph_pool(r).bytes > 300 * MiB
    eager = plan(card, facts, flags(given + " --enforce-eager"))  # the same split without the pool's bytes
    assert eager.experts_disk == 0 and eager.experts_pinned > 0


def test_refusals_that_are_not_about_memory():
    facts = ModelFacts.from_config(TINY_MOE, 4)
    with pytest.raises(PlanError, match=r"--max-model-len 5000 is past the model's trained context \(4096\)"):
        plan(Card.from_mib(1024), facts, flags("--max-model-len 5000"))
    with pytest.raises(PlanError, match="--gpu-memory-mib 2000 is more than the card's 1024.00 MiB: give at most 1024"):
        plan(Card.from_mib(1024), facts, flags("--gpu-memory-mib 2000"))
    with pytest.raises(PlanError, match="--expert-slots 3 is below the 24 experts that must stay on the card"):
        plan(Card.from_mib(1024), facts, flags("--expert-slots 3"))


def test_gpu_memory_mib_is_headroom_written_as_a_claim():
    facts = ModelFacts.from_config(SMOLLM2, 2)
    a = plan(Card.from_mib(8192), facts, flags("--gpu-memory-mib 6000"))
    b = plan(Card.from_mib(8192), facts, flags("--gpu-headroom-mib 2192"))
    assert a.headroom == b.headroom == 2192 * MiB and a.elastic == b.elastic
    assert a.lines()[2] == "headroom: 2192.00 MiB (--gpu-memory-mib 6000)"


def test_qwen3_next_recurrent_state_is_about_74_mib_per_sequence():
    r = plan(Card.from_mib(80_000), ModelFacts.from_config(QWEN3_NEXT, 2),
             flags("--max-model-len 32768 --max-num-seqs 4 --host-pool-mib 200000"))
    per_copy = 36 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)  # fp32 state + bf16 conv window
    assert per_copy == 73.6875 * MiB
    assert r.state[0].name == "recurrent" and r.state[0].bytes == 4 * per_copy
    assert r.state[0].detail == ("4 seqs x 1 copy x 73.69 MiB; fp32 state and the conv window in the activations' "
                                 "dtype, whatever --kv-cache-dtype")
    fp8 = plan(Card.from_mib(80_000), ModelFacts.from_config(QWEN3_NEXT, 2),
               flags("--max-model-len 32768 --max-num-seqs 4 --host-pool-mib 200000 --kv-cache-dtype fp8"))
    assert fp8.state[0] == r.state[0]  # the state keeps its dtype where the KV halves
    assert fp8.groups[0].token_bytes < r.groups[0].token_bytes
    assert r.groups[0].token_bytes == 24 * KiB  # 12 layers x 2 x 2 heads x 256 x 2 B
    assert r.idle_weights[0].name == "mtp"  # no --speculative: the MTP head stays in the file


def test_speculative_doubles_recurrent_state_and_pages_the_mtp_layer_with_the_attention_layers():
    cfg = Config(max_model_len=32768, max_num_seqs=4, host_pool_mib=200000, speculative=1)  # auto: the MTP head
    r = plan(Card.from_mib(80_000), ModelFacts.from_config(QWEN3_NEXT, 2), cfg)
    assert r.state[0].bytes == 2 * 4 * 73.6875 * MiB
    assert [(g.name, g.layers, g.mtp) for g in r.groups] == [("kv_attn", 12 + 1, True)]
    assert "13 layers, the MTP head's included" in " ".join(r.lines())
    assert r.groups[0].token_bytes == 13 * 2 * 2 * 256 * 2  # the MTP layer: one more layer of the same geometry
    assert "mtp" in [p.name for p in r.weights] and not r.idle_weights
    ngram = plan(Card.from_mib(80_000), ModelFacts.from_config(QWEN3_NEXT, 2),
                 Config(max_model_len=32768, max_num_seqs=4, host_pool_mib=200000, speculative=3,
                        speculative_method="ngram"))
    assert ngram.state[0].bytes == 4 * 4 * 73.6875 * MiB  # N+1 copies of the state per sequence
    assert [g.name for g in ngram.groups] == ["kv_attn"] and ngram.idle_weights[0].name == "mtp"


# -- the pieces of plan: the fixed part, the room, one function per placement mode ------


def test_the_fixed_part_of_tiny_moe_leaves_the_rest_elastic():
    facts, cfg = ModelFacts.from_config(TINY_MOE, 4), flags(TINY_FLAGS)
    free = _tiny_moe_fixed() + 1000
    fixed = fixed_charges(Card(free, free), facts, cfg, (PagingGroup("kv_attn", 3, 16, 16 * 768),), 256)
    assert (fixed.headroom, fixed.headroom_flag, fixed.elastic) == (0, "--gpu-headroom-mib 0", 1000)
    assert fixed.host_weights == (
        Part("embeddings", 400 * 64 * 4, "--embedding-placement ram, the default"),)
    assert fixed.idle_weights == ()
    assert [p.name for p in fixed.workspace] == ["logits", "activations", "graph pool", "libraries"]
    # 2 seqs x 16 blocks of a 256-token sequence x int32; 3 MoE layers x 8 experts x int64
    assert [(p.name, p.bytes) for p in fixed.state] == [("block tables", 2 * 16 * 4), ("expert pointers", 3 * 8 * 8)]


def test_kv_pages_count_whole_blocks_in_pages_of_whole_blocks_of_each_group():
    attn, idx = PagingGroup("kv_attn", 3, 16, 12 * KiB), PagingGroup("kv_idx", 1, 16, 6 * KiB)
    # a 24 KiB page holds 2 attention blocks or 4 index blocks
    assert kv_pages((attn,), 24 * KiB, 256) == 8  # 16 blocks
    assert kv_pages((attn,), 24 * KiB, 257) == 9  # 17 blocks: the last page half used
    assert kv_pages((attn, idx), 24 * KiB, 256) == 8 + 4
    assert kv_pages((attn, idx), 24 * KiB, 256, seqs=3) == 24 + 12
    assert kv_pages((attn,), 24 * KiB, 17, seqs=3) == 3  # 3 x 2 blocks share 3 pages


def tiny_room(pages: int, **change) -> Room:
    """TINY_MOE's room under TINY_FLAGS with `pages` whole pages: 24 experts of one 24 KiB page,
    a disk-tier buffer of one layer's 8 experts, a floor of top-2 in 3 MoE layers, one 256-token
    sequence = 16 blocks = 8 pages, one step's growth (64 + 2 x 16 tokens = 6 blocks) = 3 pages."""
    return Room(**dict(
        elastic=pages * TINY_SLOT, page_bytes=TINY_SLOT, alloc_granule=4096, disk_buffer_pages=0, experts=24,
        slot_cap=24, host_slots=0, host_pool_mib=0, disk_tier=False, buffer_experts=8, floor_experts=6,
        kv_seq_pages=8, kv_step_pages=3, max_model_len=256) | change)


SEQ_TEXT = "one full-length sequence of KV (8 pages, --max-model-len 256)"


def test_plan_divides_its_room_with_the_mode_the_flags_pick():
    for extra, mode, change in (("", lending, {}), ("--placement resident", resident, {}),
                                ("--deterministic --host-pool-mib 1", deterministic,
                                 {"host_slots": 42, "host_pool_mib": 1})):  # 1 MiB holds 42 slots
        r = tiny_moe_plan(40, extra)
        assert (r.mode, r.elastic, r.arena_pages, r.disk_buffer_pages, r.experts_pinned, r.experts_host,
                r.experts_disk, r.expert_slots, r.expert_floor, r.kv_buffer_pages) == \
            dataclasses.astuple(mode(tiny_room(40, **change))), extra


def test_room_pages_are_whole_allocator_units_beside_the_disk_buffers():
    room = tiny_room(0, elastic=1000 * 4096 + 100, page_bytes=4096)
    assert room.arena_pages == 1000
    cuda = dataclasses.replace(room, alloc_granule=ALLOC_GRANULE)  # 512 pages a unit
    assert cuda.arena_pages == 512
    assert dataclasses.replace(cuda, disk_buffer_pages=16).arena_pages == 496  # 496 + 16 = one unit
    assert tiny_room(0, elastic=-1).arena_pages == 0


def test_disk_buffers_take_a_page_for_each_expert_two_layers_route():
    room = with_disk_buffers(tiny_room(30))
    assert (room.elastic, room.disk_buffer_pages, room.arena_pages) == (14 * TINY_SLOT, 16, 14)
    assert room == tiny_room(14, disk_buffer_pages=16)


def test_resident_pins_every_expert_and_leaves_kv_the_rest():
    assert resident(tiny_room(32)) == Split("resident", 32 * TINY_SLOT, 32, 0, experts_pinned=24, experts_host=0,
                                            experts_disk=0, expert_slots=24, expert_floor=24, kv_buffer_pages=8)
    with pytest.raises(Short) as e:
        resident(tiny_room(31))
    assert (e.value.missing, e.value.what) == (TINY_SLOT, f"all 24 experts (24 slots) plus {SEQ_TEXT}")


def test_deterministic_fills_slots_then_the_host_pool_then_the_file():
    assert deterministic(tiny_room(20, host_slots=42)) == Split(
        "deterministic", 20 * TINY_SLOT, 20, 0, experts_pinned=12, experts_host=12, experts_disk=0, expert_slots=12,
        expert_floor=12, kv_buffer_pages=8)
    # 22 slots beside one sequence leave 2 experts for the file: its buffers take 16 of the 30 pages
    assert deterministic(tiny_room(30, disk_tier=True)) == Split(
        "deterministic", 14 * TINY_SLOT, 14, 16, experts_pinned=6, experts_host=0, experts_disk=18, expert_slots=6,
        expert_floor=6, kv_buffer_pages=8)


def test_deterministic_refusals_say_what_is_missing():
    with pytest.raises(Short) as e:
        deterministic(tiny_room(7))
    assert (e.value.missing, e.value.what) == (TINY_SLOT, SEQ_TEXT)
    with pytest.raises(Short) as e:
        deterministic(tiny_room(20))
    assert (e.value.missing, e.value.what) == (
        12 * TINY_SLOT, f"12 experts fit neither the card (12 slots beside {SEQ_TEXT}) nor the host pool "
                        f"(--host-pool-mib 0)")
    with pytest.raises(Short) as e:
        deterministic(tiny_room(20, disk_tier=True))  # 4 pages beside the buffers
    assert (e.value.missing, e.value.what) == (4 * TINY_SLOT, f"{SEQ_TEXT} beside the disk-tier buffers")


def test_lending_pins_what_the_host_pool_cannot_hold_and_lends_the_rest_down_to_the_floor():
    assert lending(tiny_room(319)) == Split(
        "lending", 319 * TINY_SLOT, 319, 0, experts_pinned=24, experts_host=0, experts_disk=0, expert_slots=24,
        expert_floor=24, kv_buffer_pages=3)
    assert lending(tiny_room(319, host_slots=42)) == Split(
        "lending", 319 * TINY_SLOT, 319, 0, experts_pinned=0, experts_host=24, experts_disk=0, expert_slots=24,
        expert_floor=6, kv_buffer_pages=3)
    capped = lending(tiny_room(319, host_slots=42, slot_cap=10))
    assert (capped.expert_slots, capped.expert_floor) == (10, 6)
    dense = lending(tiny_room(100, experts=0, slot_cap=0, floor_experts=0))
    assert dense == Split("lending", 100 * TINY_SLOT, 100, 0, 0, 0, 0, 0, 0, 3)


def test_lending_leaves_experts_in_the_file_only_when_card_or_slot_cap_cannot_pin_them():
    assert lending(tiny_room(30, disk_tier=True)) == Split(
        "lending", 14 * TINY_SLOT, 14, 16, experts_pinned=0, experts_host=0, experts_disk=24, expert_slots=11,
        expert_floor=6, kv_buffer_pages=3)
    assert lending(tiny_room(319, disk_tier=True)).experts_pinned == 24  # room to pin them all
    assert lending(tiny_room(319, disk_tier=True, slot_cap=10)) == Split(
        "lending", 303 * TINY_SLOT, 303, 16, experts_pinned=0, experts_host=0, experts_disk=24, expert_slots=10,
        expert_floor=6, kv_buffer_pages=3)


def test_lending_refusals_say_what_is_missing():
    with pytest.raises(Short) as e:
        lending(tiny_room(31))
    assert (e.value.missing, e.value.what) == (
        TINY_SLOT, f"24 experts pinned on the card (beyond the host pool, --host-pool-mib 0) plus {SEQ_TEXT}")
    with pytest.raises(PlanError, match="--expert-slots 3 is below the 24 experts that must stay on the card"):
        lending(tiny_room(319, slot_cap=3))


# -- the guide's worked example ---------------------------------------------------

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "GUIDE.md"


def _bf16_header_facts(m: ModelConfig) -> ModelFacts:
    """The facts `radiancectl plan` reads from the header of `m` converted in bf16: every tensor's own
    row, so the allocator tails are priced as they are for a real file (a config alone has none)."""
    names = [("model.embed_tokens.weight", (m.vocab_size, m.hidden_size)), ("model.norm.weight", (m.hidden_size,))]
    names += [] if m.tie_word_embeddings else [("lm_head.weight", (m.vocab_size, m.hidden_size))]
    for i in range(m.num_hidden_layers):
        names += expected_layer(m, f"model.layers.{i}.", m.layer_type(i), m.is_moe_layer(i))
    rows = [(n, "bf16", s, 2 * math.prod(s)) for n, s in names]
    extent = 3 * m.hidden_size * m.moe_intermediate_size * 2
    experts = [(i, e, extent) for i in m.moe_layers for e in range(m.num_experts)]
    facts = ModelFacts.from_rows(m, rows, experts)
    assert facts == ModelFacts.from_config(m, 2)  # the same bytes, class by class
    return facts


def test_the_guide_worked_example_is_what_plan_prints():
    text = GUIDE.read_text()
    block = re.search(r"```\n\$ radiancectl plan (?P<args>[^\n]+)\n(?P<out>.*?)```", text, re.S)
    args = block["args"].split()
    assert args[:2] == ["--model", "qwen3-30b-a3b.rad"]
    cfg = parse_config(args[2:])
    r = plan(Card.from_mib(cfg.card_mib, cuda=True), _bf16_header_facts(QWEN3_30B), cfg)
    assert block["out"].splitlines() == r.lines()
    # the hand arithmetic in the prose
    assert "96 KiB per token" in text and r.groups[0].token_bytes == 96 * KiB
    assert f"{r.kv_max_pages} pages" in text and f"{r.full_sessions} full-length sessions" in text
    assert f"{kv_tokens_by_hand(4, 32768, 180)} tokens" in text
    # the refusal shown for Qwen3-Next on the same card
    shown = re.search(r"When plan refuses.*?\n\n((?:    [^\n]*\n)+)", text, re.S)[1]
    with pytest.raises(PlanError) as e:
        plan(Card.from_mib(cfg.card_mib, cuda=True), ModelFacts.from_config(QWEN3_NEXT, 2), cfg)
    assert " ".join(shown.split()) == str(e.value)


# -- properties ---------------------------------------------------------------------


@st.composite
def models(draw):
    family = draw(st.sampled_from(["llama", "qwen3_moe", "qwen3_next"]))
    layers = draw(st.integers(1, 6))
    heads = draw(st.sampled_from([2, 4, 8]))
    base = dict(family=family, vocab_size=draw(st.integers(16, 5000)), hidden_size=draw(st.sampled_from([32, 64, 96])),
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=draw(st.sampled_from([1, 2])),
                head_dim=draw(st.sampled_from([8, 16, 64])), rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=draw(st.sampled_from([256, 1000, 4096])),
                tie_word_embeddings=draw(st.booleans()), intermediate_size=draw(st.integers(8, 256)))
    if family != "llama":
        base |= dict(num_experts=draw(st.integers(2, 16)), num_experts_per_tok=2,
                     moe_intermediate_size=draw(st.integers(8, 128)))
    if family == "qwen3_next":
        base |= dict(shared_expert_intermediate_size=16, linear_conv_kernel_dim=4, linear_num_key_heads=1,
                     linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                     layer_types=tuple(draw(st.sampled_from(["full_attention", "linear_attention"]))
                                       for _ in range(layers - 1)) + ("full_attention",))
    return ModelFacts.from_config(ModelConfig(**base), draw(st.sampled_from([2, 4])),
                                  draw(st.sampled_from([1, 2, 4])))


@st.composite
def configs(draw):
    seqs = draw(st.integers(1, 8))
    kw = dict(max_num_seqs=seqs, max_num_batched_tokens=draw(st.integers(seqs, 512)),
              max_model_len=draw(st.sampled_from([0, 1, 17, 200, 256])),
              host_pool_mib=draw(st.sampled_from([0, 1, 2, 5, 100])),
              placement=draw(st.sampled_from(["auto", "expert_tiered", "resident"])),
              deterministic=draw(st.booleans()), embedding_placement=draw(st.sampled_from(["ram", "vram"])))
    if kw["placement"] != "resident":
        kw["weights_disk_tier"] = draw(st.booleans())
        kw["expert_slots"] = draw(st.one_of(st.none(), st.integers(0, 40)))
    if draw(st.booleans()):
        kw["gpu_headroom_mib"] = draw(st.integers(0, 8))
    else:
        kw["gpu_memory_mib"] = draw(st.integers(1, 120))
    return Config(**kw)


def _fits_with(card, facts, cfg, fix: str) -> bool:
    flag, _, value = fix.partition(" ")
    field = flag[2:].replace("-", "_")
    change = {field: True} if not value else {field: value if field in ("placement", "embedding_placement")
                                                else int(value)}
    try:
        plan(card, facts, Config(**{f: getattr(cfg, f) for f in cfg.__struct_fields__} | change))
        return True
    except PlanError:
        return False


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(facts=models(), cfg=configs(), total_mib=st.integers(1, 120), used_pct=st.integers(0, 60),
       extra=st.integers(0, 1 << 20))
def test_any_split_adds_up_to_the_card_or_is_refused(facts, cfg, total_mib, used_pct, extra):
    total = total_mib * MiB + extra
    card = Card(total, total - total * used_pct // 100)
    try:
        r = plan(card, facts, cfg)
    except PlanError as e:
        msg = str(e)
        assert "MiB" in msg or "--" in msg
        fixes = re.findall(r"(--[a-z-]+(?: [a-z_]+| \d+)?)(?:,|$)", msg.split("would work: ")[-1]) \
            if "would work" in msg else []
        for fix in fixes:  # every suggested value really fits
            assert _fits_with(card, facts, cfg, fix), (fix, msg)
        return
    assert sum(b for _, b in r.parts()) == card.total_bytes
    assert all(b >= 0 for _, b in r.parts())
    assert all(p.bytes >= 0 for p in r.weights + r.workspace + r.state)
    assert 0 <= r.elastic - r.arena_bytes < r.page_bytes and r.page_bytes % 4096 == 0
    assert r.experts_pinned + r.experts_host + r.experts_disk == r.experts
    assert r.experts_pinned <= r.expert_floor <= r.expert_slots <= max(r.experts, 0)
    assert r.expert_slots <= r.arena_pages and r.kv_max_pages == r.arena_pages - r.expert_floor
    assert 0 <= r.kv_start_pages <= r.kv_max_pages
    one_seq = 0
    for g in r.groups:
        blocks = -(-r.max_model_len // g.block_tokens)
        one_seq += -(-blocks // r.blocks_per_page(g))
    assert r.kv_max_pages >= one_seq and r.full_sessions >= 1
    if r.experts:
        assert r.experts_host * r.page_bytes <= cfg.host_pool_mib * MiB
        assert r.expert_extent <= r.page_bytes
    if r.experts_disk:
        assert cfg.weights_disk_tier
    if cfg.placement == "resident":
        assert r.expert_slots == r.experts_pinned == r.experts
    elif cfg.deterministic:
        assert r.kv_start_pages == r.kv_max_pages
    for g in r.groups:
        assert g.block_tokens == BLOCK_TOKENS and r.blocks_per_page(g) >= 1
